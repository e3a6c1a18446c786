"""Agentic routing end to end: 3 real engines (1 first-turn, 2 warm), exact block hashes, KV
events, sticky sessions, subagents, Redis-shared placement, hint errors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai
import pytest
import zmq

from gateway.analysis.tokenize import ChatTokenizer
from gateway.local.engines import HASH_SEED, start_engines
from tests.conftest import MODEL, ServedGateway, cluster_config, engine_metric, engine_specs, wait_ready

pytestmark = pytest.mark.engine

SYSTEM = "You are a meticulous coding agent working in a large repository. " * 12


def sdk(gw: ServedGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def chat(
    gw: ServedGateway, messages: list[dict[str, Any]], hints: dict[str, Any] | None = None, **kw: Any
) -> tuple[str, dict[str, str]]:
    r = sdk(gw).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=kw.pop("max_tokens", 8),
        temperature=0,
        extra_body={"agent_hints": hints} if hints else None,
        **kw,
    )
    return r.parse().choices[0].message.content or "", dict(r.headers)


def collect_events(endpoint: str) -> tuple[zmq.Socket, list[dict[str, Any]]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sock.connect(endpoint)
    time.sleep(0.5)  # PUB/SUB drops what is published before the subscription is live
    return sock, []


def drain(sock: zmq.Socket, events: list[dict[str, Any]], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(200):
            frames = sock.recv_multipart()
            events.extend(msgpack.unpackb(frames[2], raw=False)[1])


def stored_hashes(
    events: list[dict[str, Any]], kinds: tuple[str | None, ...] = (None, "full_attention")
) -> list[int]:
    out: list[int] = []
    for ev in events:
        if ev.get("type") == "BlockStored" and ev.get("kv_cache_spec_kind") in kinds:
            out.extend(ev["block_hashes"])
    return out


def messages_of(n_words: int, tag: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"[{tag}] " + "inspect module " * n_words},
    ]


def test_gateway_block_hashes_equal_vllm_kv_events(cluster: dict, tiny_llama: Path) -> None:
    eng = cluster["warm1"]
    sock, events = collect_events(eng.spec.kv_events_endpoint)
    msgs = messages_of(120, "hash-check")
    httpx.post(
        eng.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2}, timeout=60
    )
    drain(sock, events)
    sock.close(0)
    ours = ChatTokenizer(tiny_llama, 128, HASH_SEED).prompt_info("chat", {"messages": msgs}, None).hashes
    assert len(ours) >= 3
    theirs = stored_hashes(events)
    assert theirs[: len(ours)] == ours


def test_gemma3_hybrid_hashes_equal_vllm_kv_events(tiny_gemma3: Path, workdir: Path) -> None:
    (eng,) = start_engines(engine_specs(tiny_gemma3, ["gemma"], workdir, served="tiny-gemma3"), timeout_s=300)
    try:
        sock, events = collect_events(eng.spec.kv_events_endpoint)
        msgs = messages_of(150, "gemma")
        r = httpx.post(
            eng.url + "/v1/chat/completions",
            json={"model": "tiny-gemma3", "messages": msgs, "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200
        drain(sock, events)
        sock.close(0)
    finally:
        eng.stop()
    ours = ChatTokenizer(tiny_gemma3, 128, HASH_SEED).prompt_info("chat", {"messages": msgs}, None).hashes
    groups = {ev.get("group_idx") for ev in events if ev.get("type") == "BlockStored"}
    assert len(groups) >= 2  # several cache groups publish
    full = stored_hashes(events)
    assert full[: len(ours)] == ours
    # sliding-window groups publish their tail window: matched by value, each one of ours
    sliding = stored_hashes(events, ("sliding_window",))
    assert sliding and set(sliding) <= set(ours) | set(full)


def test_ten_turn_session_stays_home_and_hits_prefix_cache(gateway: ServedGateway, cluster: dict) -> None:
    msgs = messages_of(150, "ten-turn")
    hints = {"session_id": "ten-turn", "expected_tool_latency_ms": 2000}
    placements = []
    for turn in range(10):
        before = {n: engine_metric(e.url, "vllm:prefix_cache_hits_total") for n, e in cluster.items()}
        text, headers = chat(gateway, msgs, hints)
        engine = headers["x-agentgw-engine"]
        hit = engine_metric(cluster[engine].url, "vllm:prefix_cache_hits_total") - before[engine]
        placements.append((engine, headers["x-agentgw-pool"], headers["x-agentgw-reason"], hit))
        msgs = msgs + [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": f"result of step {turn}: " + "ok " * 40},
            {"role": "user", "content": f"continue with step {turn + 1}"},
        ]
    first, rest = placements[0], placements[1:]
    assert first[1] == "first_turn", placements  # a long fresh prefill goes to the first-turn pool
    # no engine_ext here, so nothing moves the session's KV to a warm engine: it stays home
    # (a warm engine would recompute the whole prefix), and every later turn hits its cache
    assert all(p[0] == first[0] and p[2] == "sticky" for p in rest), placements
    assert all(p[3] >= 512 for p in rest), placements
    state = httpx.get(f"{gateway.url}/v1/agent/sessions/ten-turn").json()
    assert state["home_engine"] == first[0] and state["turns"] == 10 and state["pool"] == "first_turn"
    assert state["last_decision"]["reason"] == "sticky"


def test_first_turns_of_new_sessions_land_in_first_turn_pool(gateway: ServedGateway) -> None:
    for i in range(3):
        _, h = chat(gateway, messages_of(150, f"fresh-{i}"), {"session_id": f"fresh-{i}"})
        assert h["x-agentgw-pool"] == "first_turn"
    # a new session whose prompt is already cached somewhere is warm-classified
    _, h = chat(gateway, messages_of(10, "short"), {"session_id": "short-new"})
    assert h["x-agentgw-pool"] == "warm"


def test_subagents_land_by_their_parents_prefix(gateway: ServedGateway) -> None:
    parent = messages_of(60, "parent")
    hints = {"session_id": "parent-1"}
    for turn in range(3):
        text, h = chat(gateway, parent, hints)
        parent = parent + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"go on {turn}"},
        ]
    home = h["x-agentgw-engine"]
    for k in range(2):
        child = parent + [{"role": "user", "content": f"subtask {k}: check the tests"}]
        _, ch = chat(gateway, child, {"session_id": f"parent-1/sub{k}", "parent_session_id": "parent-1"})
        assert ch["x-agentgw-engine"] == home
        assert ch["x-agentgw-reason"] in ("subagent_parent", "prefix", "new_session")
    state = httpx.get(f"{gateway.url}/v1/agent/sessions/parent-1").json()
    assert set(state["children"]) == {"parent-1/sub0", "parent-1/sub1"}


def test_priority_is_forwarded_to_priority_scheduling_engines(gateway: ServedGateway) -> None:
    _, h = chat(
        gateway, messages_of(5, "prio"), {"session_id": "prio", "priority": 3, "latency_class": "background"}
    )
    assert h["x-agentgw-engine"]


def test_bad_hints_are_400s_naming_the_field(gateway: ServedGateway) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(gateway, messages_of(5, "bad"), {"session_id": "ok", "fan_out": -1})
    assert err.value.body["param"] == "agent_hints.fan_out"  # type: ignore[index]
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages_of(5, "bad")},
        headers={"X-Agent-Tool-Latency-Ms": "soon"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-agent-tool-latency-ms"


def test_invalid_hints_can_be_ignored_with_a_warning(cluster: dict, tiny_llama: Path) -> None:
    with ServedGateway(cluster_config(cluster, tiny_llama, hints={"on_invalid": "ignore"})) as gw:
        wait_ready(gw.url)
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": messages_of(5, "warn"),
                "max_tokens": 2,
                "agent_hints": {"fan_out": "x"},
            },
            timeout=60,
        )
        assert r.status_code == 200
        assert "agent_hints.fan_out" in r.headers["x-agentgw-warning"]


def test_session_api_and_dry_run(gateway: ServedGateway) -> None:
    _, h = chat(gateway, messages_of(20, "api"), {"session_id": "api-1"})
    r = httpx.post(f"{gateway.url}/v1/agent/sessions/api-1/hints", json={"expected_tool_latency_ms": 40000})
    assert r.status_code == 200 and r.json()["expected_gap_s"] == 40.0
    r = httpx.post(f"{gateway.url}/v1/agent/sessions/api-1/hints", json={"fan_out": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "fan_out"
    dry = httpx.post(
        f"{gateway.url}/debug/route",
        json={"model": MODEL, "messages": messages_of(20, "api")},
        headers={"x-agent-session-id": "api-1"},
    ).json()
    assert dry["decision"]["engine"] == h["x-agentgw-engine"] and dry["decision"]["reason"] == "sticky"
    assert dry["exact_hashes"] and dry["blocks"] >= 1
    assert {c["engine"] for c in dry["decision"]["candidates"]} >= {h["x-agentgw-engine"]}
    assert "prefix" in dry["decision"]["candidates"][0]["scores"]
    assert (
        httpx.get(f"{gateway.url}/v1/agent/sessions/api-1").json()["turns"] == 1
    )  # the dry run changed nothing
    assert httpx.delete(f"{gateway.url}/v1/agent/sessions/api-1").status_code == 200
    r = httpx.get(f"{gateway.url}/v1/agent/sessions/api-1")
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"


def test_session_end_hint_releases_the_session(gateway: ServedGateway) -> None:
    chat(gateway, messages_of(5, "end"), {"session_id": "end-1"})
    chat(gateway, messages_of(5, "end"), {"session_id": "end-1", "session_end": True})
    assert httpx.get(f"{gateway.url}/v1/agent/sessions/end-1").status_code == 404


def test_two_replicas_sharing_redis_route_a_session_identically(
    cluster: dict, tiny_llama: Path, redis_url: str
) -> None:
    cfg = cluster_config(cluster, tiny_llama, sessions={"backend": "redis", "redis_url": redis_url})
    with ServedGateway(cfg) as a, ServedGateway(cfg) as b:
        wait_ready(a.url)
        wait_ready(b.url)
        msgs = messages_of(30, "redis")
        engines = []
        for turn, gw in enumerate([a, b, a, b]):
            text, h = chat(gw, msgs, {"session_id": "shared-1"})
            engines.append(h["x-agentgw-engine"])
            msgs = msgs + [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"turn {turn}"},
            ]
        assert len(set(engines[1:])) == 1, engines
        sa = httpx.get(f"{a.url}/v1/agent/sessions/shared-1").json()
        sb = httpx.get(f"{b.url}/v1/agent/sessions/shared-1").json()
        assert sa["home_engine"] == sb["home_engine"] == engines[-1] and sa["turns"] == sb["turns"] == 4
