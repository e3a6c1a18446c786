"""A Mooncake master killed and restarted under real clients: the object tier degrades to
recompute without waiting out the client's retries, and offload resumes after the restart.

Each test starts its own `mooncake_master` (it is killed), never the session's shared one. What
is asserted is events and counters (the breaker's trips, short circuits, recoveries; the tier's
unavailable/stored chunks; vLLM's prompt-token sources), never durations.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_ext import config
from engine_ext.tiers.breaker import GuardedStore
from engine_ext.tiers.store import MooncakeObjectStore, StoreUnavailable
from gateway.local.engines import EngineSpec, free_ports
from gateway.local.mooncake import MooncakeMaster
from tests.engine_ext.offload_support import (
    BLOCK_BYTES,
    CONTROL_TOKEN,
    HOST_CHUNKS,
    Engine,
    complete,
    delta,
    metrics,
    running_engines,
    tier_stats,
    tokens,
    until,
)

pytestmark = pytest.mark.store

PORTS = range(23000, 23200)


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    m = MooncakeMaster(tmp_path / "master.log").start()
    try:
        yield m
    finally:
        m.stop()


def test_breaker_stops_calling_a_dead_master_and_closes_when_it_is_back(
    master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in MooncakeMaster.client_env.items():
        monkeypatch.setenv(k, v)
    clock = ManualClock()
    inner = MooncakeObjectStore(master.master_address, master.metadata_server, global_segment_size=16 << 20)
    store = GuardedStore(inner, cooldown_s=5.0, clock=clock)
    buf = np.full(8 * BLOCK_BYTES, 7, dtype=np.uint8)
    base = int(buf.ctypes.data)
    store.register_buffer(base, buf.nbytes)
    keys = [f"faults/k{i}" for i in range(4)]
    ptrs = [base + i * BLOCK_BYTES for i in range(4)]
    try:
        assert store.batch_put_from(keys, ptrs, [BLOCK_BYTES] * 4) == [0] * 4
        assert store.batch_exists(keys) == [True] * 4

        master.kill()
        with pytest.raises(StoreUnavailable):  # the master does not answer: RPC_FAIL
            store.batch_exists(keys)
        assert (store.counters.trips, store.epoch, store.is_open) == (1, 1, True)
        # Open: a put (which would retry for seconds against a dead master) never reaches it.
        for _ in range(3):
            with pytest.raises(StoreUnavailable, match="breaker open"):
                store.batch_put_from(["faults/new"], ptrs[:1], [BLOCK_BYTES])
        with pytest.raises(StoreUnavailable, match="breaker open"):
            store.batch_get_bytes(keys)
        assert store.counters.short_circuits == 4

        # The cooldown passes with the master still down: the probe fails, the breaker reopens.
        clock.now += 5.0
        with pytest.raises(StoreUnavailable):
            store.batch_exists(keys[:1])
        assert (store.counters.probes, store.counters.trips, store.is_open) == (1, 1, True)
        with pytest.raises(StoreUnavailable, match="breaker open"):
            store.batch_exists(keys[:1])

        master.start()  # same ports, no keys
        clock.now += 5.0
        assert store.batch_exists(keys) == [False] * 4  # the probe: answered, the restart lost them
        assert (store.counters.recoveries, store.is_open) == (1, False)
        # The client mounts its segment again on its own; puts then succeed.
        until(lambda: store.batch_put_from(keys[:1], ptrs[:1], [BLOCK_BYTES]) == [0])
        assert store.batch_exists(keys[:1]) == [True]
        assert store.counters.trips == 1
    finally:
        store.close()


@pytest.fixture(scope="module")
def engine_and_master(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Any]]:
    """One tiny-Llama engine with the host and Mooncake tiers, on a master of its own."""
    logs = tmp_path_factory.mktemp("mooncake-faults")
    m = MooncakeMaster(logs / "master.log").start()
    port, control_port = free_ports(2, PORTS)
    cfg = config.kv_transfer_config(
        HOST_CHUNKS * BLOCK_BYTES,
        control_port=control_port,
        engine_url=f"http://127.0.0.1:{port}",
        mooncake_master=m.master_address,
        mooncake_metadata=m.metadata_server,
    )
    spec = EngineSpec(
        name="engine-mc",
        model_dir=tiny_llama,
        served_model_name="tiny-llama",
        port=port,
        log_path=logs / "engine-mc.log",
        max_model_len=6144,
        num_gpu_blocks_override=64,
        extra_args=("--kv-transfer-config", json.dumps(cfg)),
        extra_env={**MooncakeMaster.client_env, **config.control_env(CONTROL_TOKEN)},
    )
    try:
        with running_engines([spec], [control_port]) as engines:
            yield engines["engine-mc"], m
    finally:
        m.stop()


@pytest.mark.engine
def test_master_restart_degrades_to_recompute_then_offload_resumes(
    engine_and_master: tuple[Engine, MooncakeMaster],
) -> None:
    engine, master = engine_and_master
    rng = random.Random(1111)
    complete(engine, tokens(rng, 1400), max_tokens=8)
    up = until(lambda: (s := tier_stats(engine))["stored_chunks"] >= 10 and s)
    assert up["breaker"]["trips"] == 0

    master.kill()
    for _ in range(2):  # fresh prompts: their lookups and stores meet the dead master
        before = metrics(engine)
        out, _ = complete(engine, tokens(rng, 1400), max_tokens=8)
        assert len(out) == 8
        after = metrics(engine)
        assert delta(after, before, "source:local_compute") == 1400  # recomputed, nothing loaded
        assert delta(after, before, "source:external_kv_transfer") == 0
    down = until(lambda: (s := tier_stats(engine))["unavailable_stores"] > 0 and s)
    assert down["breaker"]["trips"] >= 1
    assert down["unavailable_lookups"] + down["unavailable_stores"] > 0
    assert down["breaker"]["short_circuits"] > 0  # calls answered without touching the store
    assert down["stored_chunks"] == up["stored_chunks"]
    assert metrics(engine).get("vllm:agentgw_tier_unavailable_total", 0) > 0

    master.start()  # same ports, no keys

    def resumed() -> dict[str, Any] | None:
        complete(engine, tokens(rng, 300), max_tokens=1)  # one new block per turn to offload
        time.sleep(0.5)
        s = tier_stats(engine)
        return s if s["stored_chunks"] > down["stored_chunks"] else None

    back = until(resumed, timeout_s=90, every_s=0.0)
    assert back["breaker"]["recoveries"] >= 1 and not back["breaker"]["open"]
