"""The Responses store against real engines: bounded, and its owner engine killed.

Two real engines: ``ra`` keeps at most ``MAX_ENTRIES`` stored responses and ``MAX_BYTES`` bytes
(engine_ext's bounded store, asked for through the environment as the gateway's local engines
do), ``rb`` runs with the local engines' defaults.

- Bound: one response more than the entry bound, and the oldest is gone (vLLM's own OpenAI-shaped
  404, for ``GET`` and for ``previous_response_id``) while the newest are kept; long histories,
  and the bytes held (the engine's ``agentgw_engine_responses_store_bytes``) never pass the bound
  while evictions grow; a response the gateway routed there and the engine evicted gets OpenAI's
  400 ``previous_response_not_found`` through the gateway.
- Background streams: the events vLLM appends to a stored stream count toward the bytes bound.
- Owner killed: a response stored on ``ra`` through the gateway, ``ra`` SIGKILLed; a follow-up
  with its ``previous_response_id`` (streamed or not) gets OpenAI's 400
  ``previous_response_not_found`` and ``GET /v1/responses/{id}`` its 404 ``response_not_found``,
  each naming the field, whether the gateway has not yet noticed (the
  connection is refused) or has ejected the engine; never a 5xx, a hang, or an answer from ``rb``
  without the history. The gateway goes on serving new chains on ``rb``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_ext.response_store import ENV_MAX_BYTES, ENV_MAX_ENTRIES
from gateway.local.engines import EngineSpec, LocalEngine, free_ports, start_engines, stop_engines
from gateway.service.responses import owner_key
from tests.conftest import MODEL, ServedGateway, wait_ready

pytestmark = pytest.mark.engine

MAX_ENTRIES = 3
MAX_BYTES = 24_000
#: A history of ~8 KB: two fit in MAX_BYTES, a third does not (the bytes bound acts first).
LONG = "Refactor the parser module and keep every test green. " * 150
_SAMPLE = re.compile(r'^(agentgw_engine_responses_store_\w+)\{store="(\w+)"\} ([0-9.e+]+)$', re.M)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path, workdir: Path) -> Iterator[dict[str, LocalEngine]]:
    ports = free_ports(2)
    bounded = {ENV_MAX_ENTRIES: str(MAX_ENTRIES), ENV_MAX_BYTES: str(MAX_BYTES)}
    specs = [
        EngineSpec(
            name=name,
            model_dir=tiny_llama,
            served_model_name=MODEL,
            port=port,
            log_path=workdir / f"{name}.log",
            max_model_len=8192,
            extra_env=env,
        )
        for name, port, env in (("ra", ports[0], bounded), ("rb", ports[1], {}))
    ]
    started = start_engines(specs, timeout_s=300)
    try:
        yield {e.spec.name: e for e in started}
    finally:
        stop_engines(started)


def store_stats(engine: LocalEngine) -> dict[tuple[str, str], float]:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return {(m, s): float(v) for m, s, v in _SAMPLE.findall(text)}


def create(url: str, text: str, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "input": text, "max_output_tokens": 4, **kw}
    return httpx.post(url + "/v1/responses", json=body, timeout=120)


def assert_not_found(r: httpx.Response, param: str) -> dict[str, Any]:
    # OpenAI's answers: 400 previous_response_not_found for a chain, 404 for an id (vLLM's own
    # answer on the engine is a 404 for both)
    assert r.status_code == (400 if param == "previous_response_id" else 404), r.text
    err: dict[str, Any] = r.json()["error"]
    # vLLM's own type, or the gateway's for a 404 (both OpenAI's shape, naming the field)
    assert err["type"] in ("invalid_request_error", "not_found_error") and err["param"] == param, err
    assert "not found" in err["message"], err
    return err


def test_one_response_more_than_the_bound_and_the_oldest_is_gone(engines: dict[str, LocalEngine]) -> None:
    ra = engines["ra"]
    before = store_stats(ra)
    assert ("agentgw_engine_responses_store_entries", "response_store") in before, "store not bounded"
    ids = []
    for i in range(MAX_ENTRIES + 1):
        r = create(ra.url, f"short request {i}")
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    err = assert_not_found(httpx.get(f"{ra.url}/v1/responses/{ids[0]}", timeout=30), "response_id")
    assert ids[0] in err["message"]
    assert_not_found(create(ra.url, "continue", previous_response_id=ids[0]), "response_id")
    for rid in ids[1:]:
        assert httpx.get(f"{ra.url}/v1/responses/{rid}", timeout=30).status_code == 200
    assert create(ra.url, "continue", previous_response_id=ids[-1]).status_code == 200
    after = store_stats(ra)
    assert after["agentgw_engine_responses_store_entries", "response_store"] == MAX_ENTRIES
    assert after["agentgw_engine_responses_store_entries", "msg_store"] == MAX_ENTRIES
    grew = sum(after[k] - before.get(k, 0.0) for k in after if k[0].endswith("evictions_total"))
    assert grew >= 2  # the oldest, then the follow-up's own newcomer pushed another out


def test_long_histories_stay_within_the_bytes_bound(engines: dict[str, LocalEngine]) -> None:
    ra = engines["ra"]
    ids = []
    for i in range(4):
        r = create(ra.url, f"{i}: {LONG}")
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
        stats = store_stats(ra)
        for store in ("response_store", "msg_store"):
            assert stats["agentgw_engine_responses_store_bytes", store] <= MAX_BYTES, stats
    # the bytes bound, not the entry bound, decided: fewer entries than MAX_ENTRIES are left
    assert stats["agentgw_engine_responses_store_entries", "msg_store"] < MAX_ENTRIES, stats
    assert stats["agentgw_engine_responses_store_bytes", "msg_store"] > len(LONG)  # the newest is kept
    assert_not_found(httpx.get(f"{ra.url}/v1/responses/{ids[0]}", timeout=30), "response_id")
    assert httpx.get(f"{ra.url}/v1/responses/{ids[-1]}", timeout=30).status_code == 200


def test_a_background_streams_events_are_counted_within_the_bytes_bound(
    engines: dict[str, LocalEngine],
) -> None:
    ra = engines["ra"]
    body = {"model": MODEL, "input": "stream it in the background", "max_output_tokens": 8}
    with httpx.stream(
        "POST", ra.url + "/v1/responses", json=body | {"background": True, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        data = [line for line in r.iter_lines() if line.startswith("data:")]
    assert '"response.completed"' in data[-1], data[-1]
    stats = store_stats(ra)
    # vLLM appended every event to the entry after storing it: the bound counted each of them
    held = stats["agentgw_engine_responses_store_bytes", "event_store"]
    assert sum(len(line) - len("data: ") for line in data) * 0.8 < held <= MAX_BYTES, (held, stats)
    assert stats["agentgw_engine_responses_store_entries", "event_store"] >= 1


def _gateway_config(engines: dict[str, LocalEngine]) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "p",
                "role": "any",
                "engines": [{"name": n, "url": e.url, "model": MODEL} for n, e in engines.items()],
            }
        ],
        "routing": {"profile": "round_robin"},
        # probes far apart: right after the kill, the gateway still believes the engine healthy
        "timeouts": {"health_interval_s": 60, "metrics_interval_s": 0.5},
    }


def _stored_on(gw: ServedGateway, engine: str) -> str:
    """A response stored through the gateway that landed on ``engine`` (round robin)."""
    for i in range(6):
        r = create(gw.url, f"first turn {i}")
        assert r.status_code == 200, r.text
        if r.headers["x-agentgw-engine"] == engine:
            return str(r.json()["id"])
    raise AssertionError(f"round robin never reached {engine}")


def test_a_lost_owner_record_is_found_again_on_the_engines(engines: dict[str, LocalEngine]) -> None:
    """The record of a response's engine is gone (as after Redis restarted empty): the gateway asks
    the engines, finds it on ``rb`` and the chain goes on there; an id no engine holds is still
    OpenAI's 400, and the engines are not asked for it again at once."""
    with ServedGateway(_gateway_config(engines)) as gw:
        wait_ready(gw.url)
        rid = _stored_on(gw, "rb")
        assert gw.loop is not None
        lost = asyncio.run_coroutine_threadsafe(gw.service.sessions.delete(owner_key(rid)), gw.loop)
        assert lost.result(10) is not None
        got = httpx.get(f"{gw.url}/v1/responses/{rid}", timeout=60)
        assert got.status_code == 200 and got.json()["id"] == rid, got.text
        follow = create(gw.url, "second turn", previous_response_id=rid)
        assert follow.status_code == 200, follow.text
        assert (follow.headers["x-agentgw-engine"], follow.headers["x-agentgw-reason"]) == ("rb", "owner")
        unknown = "resp_" + "0" * 32
        for _ in range(2):
            err = assert_not_found(
                create(gw.url, "next", previous_response_id=unknown), "previous_response_id"
            )
            assert err["code"] == "previous_response_not_found", err
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        for outcome, n in (("found", 1), ("not_found", 1), ("remembered_missing", 1)):
            assert f'agentgw_response_owner_searches_total{{outcome="{outcome}"}} {n}.0' in metrics, metrics


def test_owner_engine_killed_gets_the_clear_404(engines: dict[str, LocalEngine]) -> None:
    ra = engines["ra"]
    with ServedGateway(_gateway_config(engines)) as gw:
        wait_ready(gw.url)
        # evicted by its engine: the follow-up reaches the owner, which answers its own 404
        evicted = _stored_on(gw, "ra")
        for i in range(MAX_ENTRIES):
            assert create(ra.url, f"filler {i}").status_code == 200
        err = assert_not_found(create(gw.url, "next", previous_response_id=evicted), "previous_response_id")
        assert err["code"] == "previous_response_not_found" and evicted in err["message"], err

        rid = _stored_on(gw, "ra")
        follow = create(gw.url, "second turn", previous_response_id=rid)
        assert follow.status_code == 200 and follow.headers["x-agentgw-engine"] == "ra"
        assert follow.headers["x-agentgw-reason"] == "owner"
        ra.kill()
        # not yet noticed: the calls reach for the dead engine, are refused, and say so
        err = assert_not_found(httpx.get(f"{gw.url}/v1/responses/{rid}", timeout=60), "response_id")
        assert err["code"] == "response_not_found" and "'ra'" in err["message"], err
        err = assert_not_found(create(gw.url, "third turn", previous_response_id=rid), "previous_response_id")
        assert err["code"] == "previous_response_not_found" and "'ra'" in err["message"], err
        assert not gw.service.cluster.engines["ra"].healthy  # the refused connection ejected it
        # ejected: the same answers, without trying it
        for stream in (False, True):
            r = create(gw.url, "third turn", previous_response_id=rid, stream=stream)
            assert_not_found(r, "previous_response_id")
        assert_not_found(httpx.get(f"{gw.url}/v1/responses/{rid}", timeout=60), "response_id")
        # the gateway goes on: a new chain on the engine that is left
        new = create(gw.url, "a new chain")
        assert new.status_code == 200 and new.headers["x-agentgw-engine"] == "rb"
        nxt = create(gw.url, "its next turn", previous_response_id=new.json()["id"])
        assert nxt.status_code == 200 and nxt.headers["x-agentgw-engine"] == "rb"
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert not re.search(r'agentgw_requests_total\{[^}]*status="5\d\d"', metrics), metrics
