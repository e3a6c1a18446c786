"""The fleet simulation (gateway/sim/fleet.py): R replicas with their own indexes, event delay
and loss, a shared store with latency, clients spread at random."""

from __future__ import annotations

from pathlib import Path

from benchmarks.live_replay import truncate_play
from gateway.sim.cluster import SimConfig
from gateway.sim.fleet import FleetConfig, FleetSimulator, bytes_per_entry, replicate_plays
from gateway.sim.metrics import summarize
from gateway.sim.traces import load_weka

WEKA = Path(__file__).resolve().parents[2] / "tests/data/traces/weka"


def _plays(copies: int = 2) -> list:  # type: ignore[type-arg]
    return replicate_plays([truncate_play(p, 10) for p in load_weka(WEKA)], copies)


def _run(fleet: FleetConfig, workers: int = 6) -> FleetSimulator:
    plays = _plays()
    cfg = SimConfig(workers=workers, profile="agentic", hints=True, lanes=len(plays), speedup=20)
    sim = FleetSimulator(cfg, fleet)
    sim.run(plays)
    assert len(sim.records) == sum(len(p.requests) for p in plays)
    return sim


def test_replicated_plays_share_nothing_across_copies() -> None:
    base = [truncate_play(p, 10) for p in load_weka(WEKA)]
    plays = replicate_plays(base, 3)
    assert len(plays) == 3 * len(base) and len({p.play_id for p in plays}) == len(plays)
    by_copy = [
        {h for p in plays if p.play_id.endswith(f"~{c}") for r in p.requests for h in r.hashes}
        for c in range(3)
    ]
    assert not by_copy[0] & by_copy[1] and not by_copy[1] & by_copy[2]
    assert len(by_copy[0]) == len({h for p in base for r in p.requests for h in r.hashes})


def test_every_replica_routes_and_keeps_its_own_index() -> None:
    sim = _run(FleetConfig(replicas=3, seed=1))
    assert all(r.core.decisions > 0 for r in sim.replicas)
    assert sum(r.core.decisions for r in sim.replicas) == len(sim.records)
    assert len({id(r.core.index) for r in sim.replicas}) == 3
    entries = sim.index_entries()
    assert entries[0] > 0 and len(set(entries)) == 1  # no delay, no loss: the same events everywhere
    assert sim.decision_us() > 0


def test_delayed_and_lost_events_leave_replicas_behind() -> None:
    sim = _run(FleetConfig(replicas=2, event_delay_s=0.5, event_loss=0.2, seed=2))
    assert sim.events_lost > 0 and sim.clears > 0
    # the lost batches differ per replica: their indexes disagree
    a, b = (r.core.index for r in sim.replicas)
    assert {e.name: a.engine_blocks(e.name) for e in sim.engines} != {
        e.name: b.engine_blocks(e.name) for e in sim.engines
    }


def test_store_latency_is_paid_in_ttft_and_writes_land_late() -> None:
    fast = summarize(_run(FleetConfig(replicas=2, store_latency_s=0.0, seed=3)), _plays())
    slow_sim = _run(FleetConfig(replicas=2, store_latency_s=0.05, seed=3))
    slow = summarize(slow_sim, _plays())
    assert slow.ttft_p50_ms >= fast.ttft_p50_ms + 2 * 50 - 1
    assert not slow_sim._pending_writes  # flushed at the end
    sid = slow_sim.records[0].session_id
    assert sid is not None and slow_sim.sessions.get(sid, slow_sim.now) is not None


def test_the_alternative_indexes_cost_less_memory() -> None:
    exact, tables, bloom = (bytes_per_entry(k, engines=8, blocks=500) for k in ("exact", "tables", "bloom"))
    assert tables < exact / 2 and bloom < exact / 2
    for kind in ("tables", "bloom"):
        sim = _run(FleetConfig(replicas=2, index=kind, seed=4))
        assert sim.index_entries()[0] > 0
