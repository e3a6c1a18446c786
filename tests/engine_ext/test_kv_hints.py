"""KV hint envelopes: vLLM's `KvHintsEnvelope` actions applied as the control API's calls.

Without an engine: the carrier's parsing and validation, the action -> control call mapping,
and the real pin-aware policy driven once by control API calls over a socket and once by
envelopes at request ends (the same state after). With two real engines (the `engines` pair
of conftest.py): the same pin / retain / release / demote sequence sent to engine A as control
API calls and to engine B as envelopes in the completion requests' `kv_transfer_params`, then
host pressure: the same pins, host-tier contents and device pins on both; and malformed
envelopes over HTTP leave the engine serving. Those two run in test_offload_engines.py, on its
engine pair.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from engine_ext.control import ControlServer, ControlService
from engine_ext.kv_hints import (
    CARRIER_KEY,
    MAX_ACTIONS,
    ControlCall,
    InvalidEnvelope,
    Refusal,
    carrier,
    control_calls,
    request_envelope,
)
from engine_ext.pinned_policy import PinnedLRUCachePolicy
from tests.engine_ext.offload_support import AUTH, BLOCK, Engine, complete, tokens, until
from tests.engine_ext.test_pinned_policy import Clock, insert

TOKEN = "s3cret"


def action(action_type: str, action_id: str = "a1", version: str = "1.0", **payload: Any) -> dict[str, Any]:
    return {"action_id": action_id, "action_type": action_type, "action_version": version, "payload": payload}


def envelope(*actions: dict[str, Any], version: str = "1.0", message_id: str = "m1") -> dict[str, Any]:
    return {"protocol_version": version, "message_id": message_id, "actions": list(actions)}


# -- the carrier and the mapping (pure) -------------------------------------------------------------
def test_the_carrier_holds_the_envelopes_json_form_and_a_native_envelope_wins() -> None:
    raw = envelope(action("kv.pin", session_id="s", ttl_s=30))
    parsed = request_envelope(None, {CARRIER_KEY: raw})
    assert parsed == KvHintsEnvelope(
        "1.0", "m1", [KvHintAction("a1", "kv.pin", "1.0", {"session_id": "s", "ttl_s": 30})]
    )
    assert carrier(parsed) == raw  # what a client writes is what the engine reads
    native = KvHintsEnvelope("1.2", "native", [])
    assert request_envelope(native, {CARRIER_KEY: raw}) is native
    assert request_envelope(None, {"agentgw": {"session_id": "s"}}) is None
    assert request_envelope(None, None) is None


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("junk", "must be an object"),
        ([envelope()], "must be an object"),
        ({"message_id": "m", "actions": []}, "protocol_version"),
        (envelope(version="2.0"), "not supported"),
        (envelope(version="1.0.0"), "not supported"),
        ({**envelope(), "actions": {"a": 1}}, "actions"),
        (envelope({"action_id": "a", "action_type": "kv.pin"}), "action_version"),
        (envelope({**action("kv.pin"), "payload": [1]}), "payload"),
        (envelope(*[action("kv.release", session_id="s")] * (MAX_ACTIONS + 1)), f"at most {MAX_ACTIONS}"),
    ],
)
def test_a_malformed_carrier_is_refused_whole_with_the_reason(raw: Any, why: str) -> None:
    with pytest.raises(InvalidEnvelope, match=why):
        request_envelope(None, {CARRIER_KEY: raw})


def test_the_docs_example_request_maps_to_the_calls_it_describes() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine_ext.md").read_text()
    section = doc.split("## KV hint envelopes", 1)[1].split("\n## ", 1)[0]
    body = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    params = body["kv_transfer_params"]
    env = request_envelope(None, params)
    assert env is not None
    assert control_calls(env, params["agentgw"]["session_id"]) == (
        [
            ControlCall("pin", "kv.pin", "/v1/kv/pin", {"session_id": "s-1", "ttl_s": 30}),
            ControlCall("old", "kv.demote", "/v1/kv/evict", {"session_id": "s-0"}),
        ],
        [],
    )


def test_a_native_envelope_of_another_major_version_is_refused() -> None:
    with pytest.raises(InvalidEnvelope, match="not supported"):
        request_envelope(KvHintsEnvelope("2", "m", []), None)


@pytest.mark.parametrize(
    ("act", "expected"),
    [
        (
            action("kv.pin", session_id="s", ttl_s=30),
            ControlCall("a1", "kv.pin", "/v1/kv/pin", {"session_id": "s", "ttl_s": 30}),
        ),
        (
            action("kv.pin", ttl_s=30),
            ControlCall("a1", "kv.pin", "/v1/kv/pin", {"session_id": "own", "ttl_s": 30}),
        ),
        (
            action("kv.retain", version="1.3", ttl_s=9, priority=5),
            ControlCall("a1", "kv.retain", "/v1/kv/pin", {"session_id": "own", "ttl_s": 9}),
        ),
        (action("kv.release"), ControlCall("a1", "kv.release", "/v1/kv/unpin", {"session_id": "own"})),
        (
            action("kv.demote", session_id="t"),
            ControlCall("a1", "kv.demote", "/v1/kv/evict", {"session_id": "t"}),
        ),
        (
            action("kv.prefetch", token_ids=[1, 2], pin_ttl_s=4, session_id="s"),
            ControlCall(
                "a1",
                "kv.prefetch",
                "/v1/kv/prefetch",
                {"token_ids": [1, 2], "pin_ttl_s": 4, "session_id": "s"},
            ),
        ),
        # a prefetch keeps the control API's rule: no session named, no pin (not the request's)
        (
            action("kv.prefetch", token_ids=[1]),
            ControlCall("a1", "kv.prefetch", "/v1/kv/prefetch", {"token_ids": [1]}),
        ),
        (action("kv.fetch", source="engine-b"), Refusal("a1", "kv.fetch", "unknown action_type 'kv.fetch'")),
        (action("kv.share"), Refusal("a1", "kv.share", "unknown action_type 'kv.share'")),
        (
            action("kv.pin", version="2.0", ttl_s=1),
            Refusal("a1", "kv.pin", "action_version '2.0' is not supported"),
        ),
        (
            action("kv.pin", ttl_s=1, until=5),
            Refusal("a1", "kv.pin", "payload fields ['until'] are not defined"),
        ),
    ],
)
def test_each_action_maps_to_its_control_call_or_is_refused(act: dict[str, Any], expected: Any) -> None:
    env = request_envelope(None, {CARRIER_KEY: envelope(act)})
    assert env is not None
    calls, refused = control_calls(env, "own")
    if isinstance(expected, ControlCall):
        assert (calls, refused) == ([expected], [])
    else:
        assert calls == [] and len(refused) == 1
        got = refused[0]
        assert (got.action_id, got.action_type) == (expected.action_id, expected.action_type)
        assert got.reason.startswith(expected.reason), got.reason


def test_an_action_without_a_session_on_a_request_without_one_is_refused_and_the_rest_kept() -> None:
    env = request_envelope(
        None, {CARRIER_KEY: envelope(action("kv.release"), action("kv.demote", "a2", session_id="s"))}
    )
    assert env is not None
    calls, refused = control_calls(env, None)
    assert [c.action_id for c in calls] == ["a2"]
    assert [r.action_id for r in refused] == ["a1"] and "names no session" in refused[0].reason


# -- applied to the real pin-aware policy, against the same calls over the control API ------------
class Node:
    """A real `PinnedLRUCachePolicy` (8 chunks, a manual clock) served by a started control server."""

    def __init__(self, engine_url: str | None = None) -> None:
        self.clock = Clock()
        self.policy = PinnedLRUCachePolicy(cache_capacity=8, clock=self.clock)
        self.server = ControlServer(
            ControlService(self.policy, lambda: {"host": {}, "tiers": {}}, engine_url=engine_url),
            "127.0.0.1",
            0,
            TOKEN,
            max_inflight=2,
        )
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.stored = 0

    def store(self, n: int) -> list[bytes]:
        keys = []
        for _ in range(n):
            chunk = ChunkStatus(self.stored)
            chunk.ref_cnt = 0
            key = self.stored.to_bytes(4, "big")
            insert(self.policy, key, chunk)
            keys.append(key)
            self.stored += 1
        return keys

    def finish(self, keys: list[bytes], native: KvHintsEnvelope | None = None, **params: Any) -> None:
        """A request that used ``keys`` ends (as vLLM's host tier reports it)."""
        ctx = ReqContext(req_id=f"r{self.stored}", kv_transfer_params=params or None, kv_hints=native)
        self.policy.on_request_finished((tuple(keys),), set(), set(keys), ctx)

    def control(self, path: str, **body: Any) -> httpx.Response:
        return httpx.post(
            self.url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/v1/kv/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        return r.json()["kv_hints"]  # type: ignore[no-any-return]

    def state(self, *sessions: str) -> dict[str, Any]:
        return {s: self.policy.session_state(s) for s in sessions}

    def evicted(self, n: int) -> list[bytes]:
        out = self.policy.evict(n, set())
        return [k for k, _ in out] if out is not None else []


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    a, b = Node(), Node()
    try:
        yield a, b
    finally:
        a.server.stop()
        b.server.stop()


def test_envelopes_leave_the_policy_as_the_same_control_calls_do(nodes: tuple[Node, Node]) -> None:
    """Node a: each turn ends bound to its session, then the control API is called over HTTP.
    Node b: the same turns carry the actions as an envelope. Same pins, same eviction order."""
    a, b = nodes
    turns = [
        ("s-pin", 2, [action("kv.pin", session_id="s-pin", ttl_s=60)]),
        ("s-rel", 2, [action("kv.retain", ttl_s=60, priority=1)]),
        ("s-dem", 2, [action("kv.pin", ttl_s=60)]),
        ("s-rel", 0, [action("kv.release")]),
        ("s-dem", 0, [action("kv.demote")]),
    ]
    routes = {
        "kv.pin": "/v1/kv/pin",
        "kv.retain": "/v1/kv/pin",
        "kv.release": "/v1/kv/unpin",
        "kv.demote": "/v1/kv/evict",
    }
    keys_a: dict[str, list[bytes]] = {}
    keys_b: dict[str, list[bytes]] = {}
    for session, new, acts in turns:
        keys_a[session] = keys_a.get(session, []) + a.store(new)
        a.finish(keys_a[session], agentgw={"session_id": session})
        for act in acts:
            body = {"session_id": session, **{k: v for k, v in act["payload"].items() if k != "priority"}}
            assert a.control(routes[act["action_type"]], **body).status_code == 200
        keys_b[session] = keys_b.get(session, []) + b.store(new)
        b.finish(keys_b[session], agentgw={"session_id": session}, kv_hints=envelope(*acts))
    sessions = ("s-pin", "s-rel", "s-dem")
    assert a.state(*sessions) == b.state(*sessions)
    assert b.state("s-pin")["s-pin"]["pin"] == {"session_id": "s-pin", "num_keys": 2, "ttl_left_s": 60.0}
    assert b.state("s-rel")["s-rel"]["pin"] is None
    # host pressure: the demoted session goes first, the released one next, the pinned one stays
    b.store(2)  # the tier's last free chunks (a request's end then applies the queued demotion)
    a.store(2)
    a.finish([])
    b.finish([])
    evicted_a, evicted_b = a.evicted(4), b.evicted(4)
    assert [set(evicted_a[:2]), set(evicted_a[2:])] == [set(evicted_b[:2]), set(evicted_b[2:])]
    assert [set(evicted_b[:2]), set(evicted_b[2:])] == [set(keys_b["s-dem"]), set(keys_b["s-rel"])]
    counts = b.stats()
    assert counts["applied"] == 5 and counts["refused"] == 0 and counts["envelopes"] == 5
    assert counts["by_action"] == {"kv.pin": 2, "kv.retain": 1, "kv.release": 1, "kv.demote": 1}
    assert a.stats()["envelopes"] == 0


def test_a_native_envelope_is_applied_like_the_carriers(nodes: tuple[Node, Node]) -> None:
    _, b = nodes
    keys = b.store(3)
    native = KvHintsEnvelope("1.0", "m", [KvHintAction("a", "kv.pin", "1.0", {"ttl_s": 5})])
    b.finish(keys, native, agentgw={"session_id": "s"}, kv_hints=envelope(action("kv.release")))
    assert b.state("s")["s"]["pin"] == {"session_id": "s", "num_keys": 3, "ttl_left_s": 5.0}
    assert b.stats()["by_action"] == {"kv.pin": 1}


@pytest.mark.parametrize(
    ("raw", "refused_envelopes", "refused_actions", "applied"),
    [
        ("junk", 1, 0, 0),
        (envelope(version="7"), 1, 0, 0),
        ({"protocol_version": 1, "message_id": "m", "actions": []}, 1, 0, 0),
        (envelope(action("kv.fetch", source="x"), action("kv.pin", "a2", ttl_s=5)), 0, 1, 1),
        # refused by the control API's own validation, as the HTTP call would be (400)
        (envelope(action("kv.pin", ttl_s=-1), action("kv.pin", "a2", ttl_s=1e308)), 0, 2, 0),
        (envelope(action("kv.pin", session_id="x" * 2000, ttl_s=5)), 0, 1, 0),
        (envelope(action("kv.prefetch", token_ids=[])), 0, 1, 0),
    ],
)
def test_bad_envelopes_are_counted_and_logged_never_raised(
    nodes: tuple[Node, Node],
    raw: Any,
    refused_envelopes: int,
    refused_actions: int,
    applied: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, b = nodes
    keys = b.store(1)
    with caplog.at_level("WARNING", logger="engine_ext.control"):
        b.finish(keys, agentgw={"session_id": "s"}, kv_hints=raw)
    counts = b.stats()
    assert (counts["envelopes_refused"], counts["refused"], counts["applied"]) == (
        refused_envelopes,
        refused_actions,
        applied,
    )
    assert "KV hints refused" in caplog.text and counts["last_refusal"]
    if refused_actions == 2:  # the control API's message for the same body
        assert "ttl_s (a number of seconds in (0, 604800])" in counts["last_refusal"]


def test_an_envelope_on_a_request_without_a_control_server_changes_nothing() -> None:
    """The policy alone (no control_port): the carrier is not read, the turn's own hint still is."""
    policy = PinnedLRUCachePolicy(cache_capacity=4, clock=Clock())
    chunk = ChunkStatus(0)
    chunk.ref_cnt = 0
    insert(policy, b"k", chunk)
    ctx = ReqContext(req_id="r", kv_transfer_params={"agentgw": {"session_id": "s"}, CARRIER_KEY: "junk"})
    policy.on_request_finished(((b"k",),), set(), {b"k"}, ctx)
    assert policy.session_state("s") == {"host_chunks": 1, "known_chunks": 1, "pin": None}


class StandInEngine:
    """What a prefetch calls on its own engine (``engine_url``): /v1/models and /v1/completions;
    records the completions' bodies. ``gate`` holds the answers until set."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.gate = threading.Event()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def _send(self, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"data": [{"id": "tiny"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                stand_in.bodies.append(body)
                stand_in.gate.wait(10)
                n = len(body["prompt"])
                self._send({"usage": {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n}}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_prefetch_action_runs_off_the_engine_thread_bounded() -> None:
    """The prefetch completes the prefix through the engine (it would deadlock the engine-core
    thread that hands the envelope over): it runs on the control server's pool, at most
    ``max_inflight // 2`` at once; past that the action is refused."""
    engine = StandInEngine()
    node = Node(engine_url=engine.url)
    try:
        keys = node.store(1)
        acts = [
            action("kv.prefetch", f"p{i}", token_ids=[1, 2, 3], session_id="s", pin_ttl_s=9) for i in range(2)
        ]
        node.finish(keys, agentgw={"session_id": "s"}, kv_hints=envelope(*acts))  # returns at once
        assert node.server.max_hint_prefetches == 1
        until(lambda: engine.bodies, timeout_s=10)
        counts = node.stats()
        assert (
            counts["prefetches_running"] == 1
            and counts["refused"] == 1
            and "1 running" in counts["last_refusal"]
        )
        engine.gate.set()
        until(lambda: node.stats()["prefetches_running"] == 0, timeout_s=10)
        assert node.stats()["by_action"] == {"kv.prefetch": 1}
        assert engine.bodies == [
            {
                "model": "tiny",
                "prompt": [1, 2, 3],
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"agentgw": {"session_id": "s", "pin_ttl_s": 9.0}},
            }
        ]
    finally:
        node.server.stop()
        engine.close()


# -- on real engines: the same sequence as control calls (engine A) and as envelopes (engine B) ---
SESSIONS = ("s-pin", "s-release", "s-demote")
TTL_S = 600.0
PROMPT = 500  # a session's first turn: 3 chunks; its next turn (61 more tokens): 4
FILLER = 45 * BLOCK  # one filler request: 45 chunks (and 46 of the 64 device blocks)
ROUTES = {
    "kv.pin": "/v1/kv/pin",
    "kv.retain": "/v1/kv/pin",
    "kv.release": "/v1/kv/unpin",
    "kv.demote": "/v1/kv/evict",
}
DEVICE_KEYS = (
    "pinned_sessions",
    "pinned_blocks",
    "pinned",
    "released",
    "expired",
    "yielded_to_bound",
    "released_for_admission",
    "refused_over_bound",
)


def control(engine: Engine, method: str, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.request(method, f"{engine.control_url}{path}", json=body or None, headers=AUTH, timeout=30)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def kv_state(engine: Engine, device: bool) -> dict[str, Any]:
    """What is pinned and what the host tier holds, per session and in all (deadlines left out);
    with ``device``, the device pins too (once no pin command waits for the engine's next step)."""
    out: dict[str, Any] = {}
    for s in SESSIONS:
        st = control(engine, "GET", f"/v1/kv/sessions/{s}")
        out[s] = {
            "host_chunks": st["host_chunks"],
            "known_chunks": st["known_chunks"],
            "pinned_keys": None if st["pin"] is None else st["pin"]["num_keys"],
        }
        if device:
            out[s]["device_blocks"] = None if st["device_pin"] is None else st["device_pin"]["blocks"]
    stats = control(engine, "GET", "/v1/kv/stats")
    host = stats["host"]
    out["host"] = {k: host[k] for k in ("chunks_used", "pinned_sessions", "evictions_refused_for_pins")}
    if device:
        assert stats["device"]["commands_pending"] == 0
        out["device"] = {k: stats["device"][k] for k in DEVICE_KEYS}
        out["device"]["sessions"] = {s: v["blocks"] for s, v in stats["device"]["sessions"].items()}
    return out


def recorded(engine: Engine, session: str, chunks: int) -> bool:
    """The session's last turn has ended in the host tier (its chunks are recorded)."""
    return bool(control(engine, "GET", f"/v1/kv/sessions/{session}")["known_chunks"] >= chunks)


def run_sequence(engine: Engine, seed: int, via: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Three sessions' turns with pin / retain / pin, then release and demote on their next turns,
    then host pressure; the state before and after the pressure. ``via``: "control" calls the
    control API after each turn (once the turn's chunks are recorded); "envelope" sends the
    same actions in the turn's ``kv_transfer_params.kv_hints``."""
    rng = random.Random(seed)
    prompts = {s: tokens(rng, PROMPT) for s in SESSIONS}
    turns: list[tuple[str, list[int], list[dict[str, Any]]]] = [
        ("s-pin", prompts["s-pin"], [action("kv.pin", session_id="s-pin", ttl_s=TTL_S)]),
        ("s-release", prompts["s-release"], [action("kv.retain", ttl_s=TTL_S, priority=3)]),
        ("s-demote", prompts["s-demote"], [action("kv.pin", ttl_s=TTL_S)]),
        ("s-release", prompts["s-release"] + tokens(rng, 61), [action("kv.release")]),
        ("s-demote", prompts["s-demote"] + tokens(rng, 61), [action("kv.demote")]),
    ]
    for i, (session, prompt, acts) in enumerate(turns):
        chunks = len(prompt) // BLOCK  # the full blocks the turn stores (1 token of output)
        if via == "envelope":
            hints = envelope(*acts, message_id=f"t{i}")
            complete(engine, prompt, max_tokens=1, agentgw={"session_id": session}, kv_hints=hints)
            # applied at the request's end, right after its chunks are recorded
            until(lambda n=i + 1: control(engine, "GET", "/v1/kv/stats")["kv_hints"]["applied"] == n, 120)
        else:
            complete(engine, prompt, max_tokens=1, agentgw={"session_id": session})
            until(lambda s=session, n=chunks: recorded(engine, s, n), 120)
            for act in acts:
                body = {"session_id": session, **{k: v for k, v in act["payload"].items() if k != "priority"}}
                control(engine, "POST", ROUTES[act["action_type"]], **body)
        assert recorded(engine, session, chunks)
    before = kv_state(engine, device=False)
    for i in range(2):  # 90 more chunks through the 96-chunk host tier (11 used): 5 evicted
        complete(engine, tokens(rng, FILLER), max_tokens=1, agentgw={"session_id": f"fill-{i}"})
    until(lambda: recorded(engine, "fill-1", FILLER // BLOCK), 120)  # its stores (and their evictions) done
    return before, kv_state(engine, device=True)


def envelopes_leave_the_same_state_as_control_calls(a: Engine, b: Engine) -> None:
    """Run by test_offload_engines.py first, on its fresh engine pair (an engine pair of this
    module's own would cost another start): the sequence as control calls on ``a``, as envelopes
    on ``b``; the same state on both; then every pin it left released."""
    with ThreadPoolExecutor(2) as pool:
        via_control = pool.submit(run_sequence, a, 36, "control")
        via_envelope = pool.submit(run_sequence, b, 37, "envelope")
        (before_a, after_a), (before_b, after_b) = via_control.result(), via_envelope.result()
    assert before_b == before_a
    assert after_b == after_a
    # and they are the pins asked for: before the pressure every session's chunks are in the host
    # tier, only s-pin is still pinned (retained s-release released, s-demote demoted)
    assert before_b["s-pin"]["pinned_keys"] == before_b["s-pin"]["host_chunks"] == 3
    assert before_b["s-release"]["pinned_keys"] is None and before_b["s-release"]["host_chunks"] == 4
    assert before_b["s-demote"]["pinned_keys"] is None and before_b["s-demote"]["host_chunks"] == 4
    assert before_b["host"]["pinned_sessions"] == 1
    # after it: the pinned session whole, the demoted one gone first, the released one partly
    assert after_b["s-pin"]["host_chunks"] == 3 and after_b["s-pin"]["pinned_keys"] == 3
    assert after_b["s-demote"]["host_chunks"] == 0
    assert 0 < after_b["s-release"]["host_chunks"] < 4
    assert after_b["device"]["sessions"] == {"s-pin": 3}
    hints = control(b, "GET", "/v1/kv/stats")["kv_hints"]
    assert hints["by_action"] == {"kv.pin": 2, "kv.retain": 1, "kv.release": 1, "kv.demote": 1}
    assert hints["refused"] == hints["envelopes_refused"] == 0
    assert control(a, "GET", "/v1/kv/stats")["kv_hints"]["envelopes"] == 0
    for engine in (a, b):  # the module's later tests start without these pins
        control(engine, "POST", "/v1/kv/unpin", session_id="s-pin")


def malformed_envelopes_are_refused_and_the_engine_keeps_serving(b: Engine) -> None:
    """Run by test_offload_engines.py on its engine B."""
    rng = random.Random(38)
    before = control(b, "GET", "/v1/kv/stats")["kv_hints"]
    for raw in (
        "junk",
        envelope(version="9.0"),
        {"actions": 5},
        envelope(action("kv.fetch"), action("kv.pin")),
    ):
        out, _ = complete(b, tokens(rng, 200), max_tokens=2, kv_hints=raw)
        assert len(out) == 2

    def refusals() -> dict[str, Any] | None:
        s = control(b, "GET", "/v1/kv/stats")["kv_hints"]
        return s if s["refused"] - before["refused"] >= 2 else None

    after = until(refusals)  # the last request's end (each request's envelope is read at its end)
    assert after["envelopes_refused"] - before["envelopes_refused"] == 3
    # kv.fetch: unknown; kv.pin: the request names no session
    assert after["refused"] - before["refused"] == 2
    assert after["applied"] == before["applied"]
