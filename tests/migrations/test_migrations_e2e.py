"""Inter-turn KV prefetch and migration with real engines and a real Mooncake store."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.local.engines import LocalEngine
from tests.conftest import MODEL, ServedGateway, engine_metric
from tests.engine_ext.offload_support import AUTH

pytestmark = [pytest.mark.engine, pytest.mark.store]

SYSTEM = "You are an agent that edits code carefully and explains every change. " * 10


def msgs(tag: str, words: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"[{tag}] " + "refactor module " * words},
    ]


def post(
    gw: ServedGateway, messages: list[dict[str, Any]], hints: dict[str, Any], max_tokens: int = 8
) -> httpx.Response:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "agent_hints": hints,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def wait_migration(gw: ServedGateway, sid: str, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = httpx.get(f"{gw.url}/v1/agent/sessions/{sid}").json()
        m = s.get("migration")
        if m and m["state"] != "running":
            return s
        time.sleep(0.25)
    raise AssertionError(f"migration of {sid} did not finish: {s}")


def computed(engine: LocalEngine) -> float:
    return engine_metric(engine.url, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


def test_first_turn_moves_to_warm_during_the_gap_with_zero_recompute(
    kv_gateway: ServedGateway, kv_cluster: dict
) -> None:
    m = msgs("move", 200)
    r1 = post(kv_gateway, m, {"session_id": "mv-1", "expected_tool_latency_ms": 20000})
    assert r1.headers["x-agentgw-pool"] == "first_turn"
    state = wait_migration(kv_gateway, "mv-1")
    mig = state["migration"]
    assert (mig["kind"], mig["reason"], mig["state"]) == ("move", "first_turn_to_warm", "done"), mig
    target = mig["targets"][0]
    assert state["home_engine"] == target and state["pool"] == "warm"
    # the tool gap is over: turn 2 arrives
    m2 = m + [
        {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "next"},
    ]
    engine = kv_cluster[target][0]
    before = computed(engine)
    r2 = post(kv_gateway, m2, {"session_id": "mv-1"})
    assert r2.headers["x-agentgw-engine"] == target and r2.headers["x-agentgw-reason"] == "sticky"
    prompt = r2.json()["usage"]["prompt_tokens"]
    recomputed = computed(engine) - before
    # only the tokens after the previous prompt's last full block are computed: zero prefix tokens
    assert recomputed < 128 + 64, (recomputed, prompt)
    assert prompt > 1000
    text = httpx.get(kv_gateway.url + "/metrics").text
    assert 'agentgw_migrations_total{kind="move",outcome="completed"}' in text
    assert 'agentgw_moved_next_turn_total{outcome="hit"} 1.0' in text


def test_fan_out_replicates_the_shared_prefix_before_subagents_arrive(
    kv_gateway: ServedGateway, kv_cluster: dict
) -> None:
    parent = msgs("fan", 60)
    r = post(kv_gateway, parent, {"session_id": "fan-p"})  # short prompt: warm pool
    parent = parent + [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "spawn 4 explorers"},
    ]
    r = post(kv_gateway, parent, {"session_id": "fan-p", "fan_out": 4})
    home = r.headers["x-agentgw-engine"]
    state = wait_migration(kv_gateway, "fan-p")
    mig = state["migration"]
    assert (mig["kind"], mig["state"]) == ("replicate", "done"), mig
    others = [t for t in mig["targets"]]
    assert others and home not in others
    # before any subagent request: every chosen engine holds the parent's prefix (KV events)
    svc = kv_gateway.service
    rec = asyncio.run_coroutine_threadsafe(svc.sessions.get("fan-p", svc.clock()), kv_gateway.loop).result(10)
    rec_hashes = rec.prefix_hashes
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        matches = svc.index.match(rec_hashes)
        if all(matches.get(t) and matches[t].blocks >= len(rec_hashes) - 1 for t in [home, *others]):
            break
        time.sleep(0.2)
    matches = svc.index.match(rec_hashes)
    for t in [home, *others]:
        assert matches[t].blocks >= len(rec_hashes) - 1, (t, matches)
    # subagents then hit the cache wherever they land
    for k in range(4):
        child = parent + [{"role": "user", "content": f"explore area {k}"}]
        rc = post(kv_gateway, child, {"session_id": f"fan-p/{k}", "parent_session_id": "fan-p"})
        assert int(rc.headers["x-agentgw-cached-tokens-est"]) >= 128 * (len(rec_hashes) - 1)


def test_session_end_cancels_migrations_and_releases_pins(
    kv_gateway: ServedGateway, kv_cluster: dict
) -> None:
    m = msgs("end", 40)
    r = post(kv_gateway, m, {"session_id": "end-1", "expected_tool_latency_ms": 60000})
    home = r.headers["x-agentgw-engine"]
    control = kv_cluster[home][1]
    deadline = time.monotonic() + 20
    pinned = {}
    while time.monotonic() < deadline:
        pinned = httpx.get(f"{control}/v1/kv/sessions/end-1", headers=AUTH).json()
        if pinned.get("pin"):
            break
        time.sleep(0.2)
    assert pinned.get("pin"), pinned
    assert httpx.delete(f"{kv_gateway.url}/v1/agent/sessions/end-1").status_code == 200
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pinned = httpx.get(f"{control}/v1/kv/sessions/end-1", headers=AUTH).json()
        if not pinned.get("pin"):
            break
        time.sleep(0.2)
    assert not pinned.get("pin"), pinned
    text = httpx.get(kv_gateway.url + "/metrics").text
    assert 'agentgw_migrations_total{kind="release",outcome="completed"}' in text


def test_killing_the_target_mid_migration_leaves_the_session_served(
    kv_gateway: ServedGateway, kv_cluster: dict
) -> None:
    m = msgs("kill", 600)  # a long first turn: the move takes a while
    r1 = post(kv_gateway, m, {"session_id": "kill-1", "expected_tool_latency_ms": 30000})
    assert r1.headers["x-agentgw-pool"] == "first_turn"
    mig = httpx.get(f"{kv_gateway.url}/v1/agent/sessions/kill-1").json()["migration"]
    assert mig["kind"] == "move"
    victim = kv_cluster[mig["targets"][0]][0]
    shm = Path(f"/dev/shm/vllm_offload_{victim.engine_id}.mmap")
    assert victim.engine_id is not None and shm.exists()  # its CPU tier's region
    victim.kill()
    assert not shm.exists()  # removed with the killed engine, not left in RAM
    state = wait_migration(kv_gateway, "kill-1")
    m2 = m + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "continue"}]
    r2 = post(kv_gateway, m2, {"session_id": "kill-1"})
    assert r2.headers["x-agentgw-engine"] != victim.spec.name
    assert r2.json()["choices"][0]["message"]["content"] is not None
    assert state["migration"]["state"] in ("failed", "done")
