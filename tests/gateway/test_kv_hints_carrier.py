"""A turn's pin or release on the turn's own request (a KV hint envelope in
``kv_transfer_params.kv_hints``) for engines with ``kv_hints``, instead of the control call the
migration executor sends after the turn; the control call stays the default.

Engine-less: the envelope the gateway writes is read back by engine_ext's own parser and mapped
to the control calls it stands for; a stand-in engine on a loopback socket (its control API on
the same URL) records every generation body and control call of a served gateway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from engine_ext.kv_hints import ControlCall, control_calls, request_envelope
from gateway.config import ConfigError, load_config
from gateway.core.kv_hints import kv_transfer_params
from testing.recording_engine import RecordingEngine
from tests.conftest import ServedGateway, wait_ready

MODEL = "m"


def carried(action_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The kv_transfer_params of session "s"'s second turn carrying one action."""
    action = {"action_id": "turn", "action_version": "1.0", "action_type": action_type, "payload": payload}
    return {
        "agentgw": {"session_id": "s"},
        "kv_hints": {"protocol_version": "1.0", "message_id": "s#2", "actions": [action]},
    }


@pytest.mark.parametrize(
    ("ttl", "release", "envelope", "expected"),
    [
        (30.0, False, False, {"agentgw": {"session_id": "s", "pin_ttl_s": 30.0}}),
        (None, True, False, {"agentgw": {"session_id": "s", "release": True}}),
        (30.0, False, True, carried("kv.pin", {"ttl_s": 30.0})),
        (None, True, True, carried("kv.release", {})),
    ],
)
def test_a_turns_kv_transfer_params(
    ttl: float | None, release: bool, envelope: bool, expected: dict[str, Any]
) -> None:
    assert kv_transfer_params("s", ttl, release, "s#2", envelope) == expected


@pytest.mark.parametrize(
    ("ttl", "release", "call"),
    [
        (30.0, False, ControlCall("turn", "kv.pin", "/v1/kv/pin", {"session_id": "s", "ttl_s": 30.0})),
        (None, True, ControlCall("turn", "kv.release", "/v1/kv/unpin", {"session_id": "s"})),
    ],
)
def test_engine_ext_reads_the_gateways_envelope_as_the_control_call_it_replaces(
    ttl: float | None, release: bool, call: ControlCall
) -> None:
    params = kv_transfer_params("s", ttl, release, "s#2", envelope=True)
    envelope = request_envelope(None, params)
    assert envelope is not None
    assert control_calls(envelope, params["agentgw"]["session_id"]) == ([call], [])


def test_kv_hints_needs_a_control_url() -> None:
    engine = {"name": "e0", "url": "http://e:1", "model": MODEL, "kv_hints": True}
    with pytest.raises(ConfigError, match=r"'pools.0.engines.0'.*kv_hints needs control_url"):
        load_config(None, pools=[{"name": "any", "engines": [engine]}])


@pytest.fixture
def stand_in() -> Iterator[RecordingEngine]:
    s = RecordingEngine()
    try:
        yield s
    finally:
        s.close()


def wait_until(check: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + 20
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.05)


def turn(gw: ServedGateway, session: str, end: bool = False, **extra: Any) -> None:
    hints: dict[str, Any] = {"session_id": session, "expected_tool_latency_ms": 4000}
    if end:
        hints["session_end"] = True
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "agent_hints": hints,
        **extra,
    }
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kv_hints", [False, True])
def test_a_turns_pin_and_release_ride_on_the_request_only_for_engines_with_kv_hints(
    stand_in: RecordingEngine, kv_hints: bool
) -> None:
    engine = {
        "name": "e0",
        "url": stand_in.url,
        "model": MODEL,
        "control_url": stand_in.url,
        "kv_hints": kv_hints,
    }
    cfg = {
        "pools": [{"name": "any", "role": "any", "engines": [engine]}],
        "migration": {"control_token": "t"},
    }
    with ServedGateway(cfg) as gw:
        wait_ready(gw.url)
        svc = gw.service
        # a client's own envelope, in the carrier or as a body field, never reaches the engine
        theirs = {"protocol_version": "1.0", "message_id": "x", "actions": []}
        turn(gw, "s1", kv_transfer_params={"kv_hints": theirs}, kv_hints=theirs)
        wait_until(
            lambda: any(m.state == "done" for m in svc.migrations.recent), "the turn's plan was carried out"
        )
        (stay,) = svc.migrations.recent
        assert (stay.action.kind.value, stay.carried) == ("stay", kv_hints)
        (sent,) = stand_in.turns()
        assert "kv_hints" not in sent
        params = sent["kv_transfer_params"]
        sid = params["agentgw"]["session_id"]
        if kv_hints:
            assert params["agentgw"] == {"session_id": sid}
            (act,) = params["kv_hints"]["actions"]
            assert (act["action_type"], act["payload"]) == ("kv.pin", {"ttl_s": stay.action.pin_ttl_s})
            assert stand_in.control_calls() == []  # the pin rode on the turn
        else:
            assert params == {"agentgw": {"session_id": sid, "pin_ttl_s": stay.action.pin_ttl_s}}
            assert stand_in.control_calls() == ["/v1/kv/pin"]

        turn(gw, "s1", end=True)
        wait_until(lambda: len(svc.migrations.recent) == 2, "the session's release was carried out")
        release = svc.migrations.recent[-1]
        assert (release.action.kind.value, release.state, release.carried) == ("release", "done", kv_hints)
        last = stand_in.turns()[-1]["kv_transfer_params"]
        if kv_hints:
            assert last["agentgw"] == {"session_id": sid}
            assert [a["action_type"] for a in last["kv_hints"]["actions"]] == ["kv.release"]
            assert stand_in.control_calls() == []
        else:
            assert last == {"agentgw": {"session_id": sid, "release": True}}
            assert stand_in.control_calls() == ["/v1/kv/pin", "/v1/kv/unpin"]
