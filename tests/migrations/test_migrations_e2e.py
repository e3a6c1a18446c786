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


def test_a_turn_refused_at_admission_leaves_the_session_its_tokens_and_its_pins(
    kv_gateway: ServedGateway, kv_cluster: dict
) -> None:
    """(Before the test that kills an engine.) Engines with engine_ext: a turn the gateway refuses after analysing it (its slots full)
    leaves the session's record, the prompt tokens kept for its prefetch, its planned move and
    the pins on every engine exactly as they were (analysis only reads)."""
    svc = kv_gateway.service
    m = msgs("refuse", 80)
    post(kv_gateway, m, {"session_id": "ref-1", "expected_tool_latency_ms": 20000})
    wait_migration(kv_gateway, "ref-1")

    def snapshot() -> dict[str, Any]:
        assert kv_gateway.loop is not None
        rec = asyncio.run_coroutine_threadsafe(
            svc.sessions.get("ref-1", svc.clock()), kv_gateway.loop
        ).result(10)
        current = svc.migrations.current.get("ref-1")
        pins = {
            name: httpx.get(f"{control}/v1/kv/sessions/ref-1", headers=AUTH, timeout=10).json()
            for name, (_, control) in kv_cluster.items()
        }
        return {
            "record": {k: v for k, v in rec.to_dict().items() if k not in ("last_activity", "observed_gaps")},
            "tokens": svc.prompts.session_tokens("ref-1"),
            "move": None if current is None else current.to_dict(),
            "pins": pins,
        }

    before = snapshot()
    assert before["tokens"]
    slots = svc.admission.global_slots
    limit, waiters = slots.limit, slots.max_waiters
    slots.limit, slots.max_waiters = 0, 0  # the gateway is full and keeps no queue
    try:
        m2 = m + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "refused " * 300}]
        r = httpx.post(
            kv_gateway.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": m2, "max_tokens": 4, "agent_hints": {"session_id": "ref-1"}},
            timeout=60,
        )
        assert (r.status_code, r.json()["error"]["code"]) == (503, "gateway_busy"), r.text
        after = snapshot()
    finally:
        slots.limit, slots.max_waiters = limit, waiters
    # a pin's time left runs down; a re-pin (the refused turn's) would have reset it
    for name, pin in before["pins"].items():
        left = ttl_left(pin), ttl_left(after["pins"][name])
        assert (left[0] is None) == (left[1] is None) and (left[0] is None or left[1] <= left[0]), (
            name,
            left,
        )
    assert without_ttl_left(after) == without_ttl_left(before)


def ttl_left(doc: dict[str, Any]) -> float | None:
    pin = doc.get("pin")
    return None if not pin else float(pin["ttl_left_s"])


def without_ttl_left(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: without_ttl_left(v) for k, v in doc.items() if k != "ttl_left_s"}
    if isinstance(doc, list):
        return [without_ttl_left(v) for v in doc]
    return doc


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
