"""Retention policies of the Mooncake tier on real engines: `selective` (Marconi-style) vs `interval`.

Two tiny-Llama engines, identical but for the tier's retention policy, get the same requests.
vLLM offers a chunk to the Mooncake tier once, when it enters the host tier; with a small host
tier (`HOST_CHUNKS` chunks) and a small device cache, a prefix that comes back after other
traffic has left both, so it is looked up in the tier and re-enters the host tier: its second
sighting. Expected (one 10-block prefix, tiny Llama, 128-token blocks):

- interval stores every chunk the host tier stores, at its first sighting;
- selective stores a one-off prefix almost not at all: only its first chunk, which the tier
  lookup (a miss, counted as a sighting) saw before the offer;
- selective stores a repeated prefix at its second sighting, and a third visit loads it.

Each engine writes under its own `key_namespace`, so neither sees the other's objects. The
retention test sends requests to one engine at a time; the second test asks both engines for
Mooncake-resident prefixes at the same moment (each may read objects placed in the other's
segment): once seen to stall >10 s and fail with LEASE_EXPIRED (the test master's 2 s lease), it
is kept here as a bounded check (every chunk loads, no load failure; a get that outlives its
lease is read again by the tier and counted in `lease_retries`). See docs/engine_ext.md.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.local.engines import free_ports
from gateway.local.mooncake import MooncakeMaster
from tests.engine_ext.offload_support import (
    BLOCK,
    BLOCK_BYTES,
    Engine,
    complete,
    delta,
    metrics,
    plugin_engine,
    plugin_kv,
    running_engines,
    tier_log,
    tier_stats,
    tokens,
)

pytestmark = [pytest.mark.engine, pytest.mark.store]

PORTS = range(23200, 23400)
POLICIES = ("selective", "interval")
HOST_CHUNKS = 24
DEVICE_BLOCKS = 64
PREFIX_BLOCKS = 10
PROMPT = PREFIX_BLOCKS * BLOCK + 100  # 10 full blocks; max_tokens=1 completes no other block


def settled(engine: Engine, quiet_s: float = 1.0, timeout_s: float = 20.0) -> dict[str, float]:
    """The tier's counters once no store has been offered or finished for `quiet_s`."""

    def mark(s: dict[str, float]) -> tuple[float, float, float]:
        return s["stored_chunks"], s["retention_skipped"], s["duplicate_stores_skipped"]

    deadline = time.monotonic() + timeout_s
    last = tier_stats(engine)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = tier_stats(engine)
        if mark(now) != mark(last):
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return now
    return last


@pytest.fixture(scope="module")
def retention_engines(
    tiny_llama: Path, mooncake: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("retention-engines")
    ports = free_ports(4, PORTS)
    specs = []
    for i, policy in enumerate(POLICIES):
        kv = plugin_kv(
            HOST_CHUNKS * BLOCK_BYTES,
            ports[2 + i],
            mooncake=mooncake,
            retention={"policy": policy},
            key_namespace=f"retention-{policy}",
        )
        specs.append(plugin_engine(policy, tiny_llama, logs, ports[i], kv, device_blocks=DEVICE_BLOCKS))
    with running_engines(specs, ports[2 : 2 + len(specs)]) as engines:
        yield engines


Step = tuple[dict[str, float], dict[str, float]]  # (tier counters, engine metrics) after a step


def run_on_both(engines: dict[str, Engine], prompts: list[list[int]]) -> dict[str, Step]:
    """Send `prompts` in order to one engine, settle, then the other (one engine busy at a time)."""
    out = {}
    for name, engine in engines.items():
        for p in prompts:
            complete(engine, p, max_tokens=1)
        out[name] = (settled(engine), metrics(engine))
    return out


def test_selective_keeps_only_repeated_prefixes_while_interval_keeps_every_delta(
    retention_engines: dict[str, Engine],
) -> None:
    rng = random.Random(4242)
    one_off = tokens(rng, PROMPT)
    repeated = tokens(rng, PROMPT)
    # 7 x 10 blocks: the repeated prefix leaves the 64-block device cache and the 24-chunk host tier.
    fillers = [[tokens(rng, PROMPT) for _ in range(7)] for _ in range(2)]

    start = {name: (settled(e), metrics(e)) for name, e in retention_engines.items()}
    first = run_on_both(retention_engines, [one_off, repeated])
    run_on_both(retention_engines, fillers[0])
    pre_second = {name: (settled(e), metrics(e)) for name, e in retention_engines.items()}
    second = run_on_both(retention_engines, [repeated])
    run_on_both(retention_engines, fillers[1])
    pre_third = {name: (settled(e), metrics(e)) for name, e in retention_engines.items()}
    third = run_on_both(retention_engines, [repeated])

    def stored(after: dict[str, Step], before: dict[str, Step], name: str) -> float:
        return after[name][0]["stored_chunks"] - before[name][0]["stored_chunks"]

    def host_stored(after: dict[str, Step], before: dict[str, Step], name: str) -> float:
        return delta(after[name][1], before[name][1], "vllm:kv_offload_store_bytes_total") / BLOCK_BYTES

    def loaded(after: dict[str, Step], before: dict[str, Step], name: str) -> float:
        return delta(after[name][1], before[name][1], "source:external_kv_transfer") / BLOCK

    report = {
        name: {
            "first_sighting(one_off+repeated): host_stored": host_stored(first, start, name),
            "first_sighting: tier_stored": stored(first, start, name),
            "second_sighting: host_stored": host_stored(second, pre_second, name),
            "second_sighting: tier_stored": stored(second, pre_second, name),
            "second_sighting: loaded_blocks": loaded(second, pre_second, name),
            "third_visit: tier_stored": stored(third, pre_third, name),
            "third_visit: loaded_blocks": loaded(third, pre_third, name),
            "retention_skipped_total": third[name][0]["retention_skipped"],
            "tier_counters_at_end": third[name][0],
        }
        for name in POLICIES
    }
    print(f"retention on engines: {json.dumps(report, indent=1)}")
    sel, itv = report["selective"], report["interval"]

    # interval: every chunk the host tier stored went to Mooncake at its first sighting.
    assert itv["first_sighting(one_off+repeated): host_stored"] == 2 * PREFIX_BLOCKS
    assert itv["first_sighting: tier_stored"] == 2 * PREFIX_BLOCKS
    assert itv["retention_skipped_total"] == 0
    for name in POLICIES:
        assert report[name]["tier_counters_at_end"]["load_failures"] == 0, (
            name,
            tier_log(retention_engines[name]),
        )
    # ... so the repeated prefix is loaded from Mooncake at its second visit, nothing stored again.
    assert itv["second_sighting: loaded_blocks"] == PREFIX_BLOCKS
    assert itv["second_sighting: tier_stored"] == 0

    # selective: the host tier stores the same, Mooncake keeps at most each prefix's first chunk
    # (its tier lookup, a miss, was the first sighting; the offer is the second).
    assert sel["first_sighting(one_off+repeated): host_stored"] == 2 * PREFIX_BLOCKS
    assert sel["first_sighting: tier_stored"] <= 2
    # second sighting of the repeated prefix (after host eviction): the rest of it is kept now.
    assert sel["second_sighting: loaded_blocks"] <= 1
    assert sel["second_sighting: tier_stored"] >= PREFIX_BLOCKS - 1
    # third visit: the whole prefix comes from Mooncake, nothing more is stored.
    assert sel["third_visit: loaded_blocks"] == PREFIX_BLOCKS
    assert sel["third_visit: tier_stored"] == 0
    assert itv["third_visit: loaded_blocks"] == PREFIX_BLOCKS


def test_both_engines_load_from_mooncake_at_the_same_moment(retention_engines: dict[str, Engine]) -> None:
    """The cross-engine concurrent load (issue 14, item 5), bounded: each engine's prefix is in
    Mooncake (objects placed in either engine's segment), out of both engines' device and host
    tiers, and both engines are asked for it at the same moment. Every chunk must load: a get
    that outlives the master's lease (LEASE_EXPIRED) is read again by the tier (`lease_retries`);
    only one that fails again shows as a load failure."""
    rng = random.Random(5151)
    prefixes = {name: tokens(rng, PROMPT) for name in retention_engines}
    for _ in range(2):  # selective keeps a prefix at its second sighting, interval at its first
        for name, engine in retention_engines.items():
            complete(engine, prefixes[name], max_tokens=1)
            for _ in range(7):
                complete(engine, tokens(rng, PROMPT), max_tokens=1)
    before = {name: (settled(e), metrics(e)) for name, e in retention_engines.items()}

    def visit(name: str) -> float:
        start = time.monotonic()
        complete(retention_engines[name], prefixes[name], max_tokens=1)
        return time.monotonic() - start

    with ThreadPoolExecutor(len(retention_engines)) as pool:
        seconds = dict(zip(retention_engines, pool.map(visit, list(retention_engines)), strict=True))
    report = {}
    for name, engine in retention_engines.items():
        tier, engine_metrics = settled(engine), metrics(engine)
        report[name] = {
            "request_s": round(seconds[name], 2),
            "tier_load_s": round(tier["load_seconds"] - before[name][0]["load_seconds"], 2),
            "loaded_chunks": tier["loaded_chunks"] - before[name][0]["loaded_chunks"],
            "load_failures": tier["load_failures"] - before[name][0]["load_failures"],
            "lease_retries": tier["lease_retries"] - before[name][0]["lease_retries"],
            "loaded_blocks": delta(engine_metrics, before[name][1], "source:external_kv_transfer") / BLOCK,
        }
    print(f"concurrent cross-engine loads: {json.dumps(report)}")
    for name, row in report.items():
        assert row["load_failures"] == 0, (name, row, tier_log(retention_engines[name]))
        assert row["loaded_blocks"] == PREFIX_BLOCKS, (name, row, tier_log(retention_engines[name]))
