"""The simulator's trace loaders, ideal reuse, determinism and a policy sanity check."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.sim.cluster import SimConfig, simulate
from benchmarks.sim.engine import DYNAMO_MOCKER, Engine, Seq
from benchmarks.sim.metrics import summarize
from benchmarks.sim.scale import scale_plays
from benchmarks.sim.traces import ideal_hit_rate, load_weka, synth_agentx, trace_stats

REPO = Path(__file__).resolve().parents[2]
WEKA = REPO / "tests/data/traces/weka"  # 3 of the 48 Weka sessions, vendored (README.md there)


@pytest.fixture(scope="module")
def weka():
    return load_weka(WEKA)


def test_weka_loader_counts_every_request_and_subagent(weka):
    stats = trace_stats(weka)
    assert stats["plays"] == 3
    assert stats["requests"] == 81  # 24 + 53 + 4 requests in the three files
    assert stats["subagent_requests"] == 44  # all in trace_0277
    assert stats["plays_with_subagents"] == 1


def test_weka_ideal_prefix_reuse_counts_repeated_blocks_within_each_session(weka):
    # Ideal reuse: every 64-token block whose hash id the session has already seen is a hit.
    hit, total = ideal_hit_rate(weka)
    assert (hit, total) == (2_891_584, 3_276_696)
    assert round(100 * hit / total, 2) == 88.25


def test_subagents_depend_on_their_parent_and_turns_on_the_previous_turn(weka):
    play = next(p for p in weka if p.subagents)
    for r in play.requests:
        for d in r.deps:
            assert d.on < r.idx and d.delay_s >= 0
    firsts = {}
    for r in play.requests:
        firsts.setdefault(r.stream, r)
    sub_first = next(r for s, r in firsts.items() if s != "root")
    assert any(play.requests[d.on].stream == "root" for d in sub_first.deps)


def _small(n=6, seed=3):
    return synth_agentx(n, seed=seed)


def test_simulation_is_deterministic():
    plays = _small()
    cfg = SimConfig(workers=2, lanes=3, speedup=5.0, profile="agentic", hints=True)
    a = summarize(simulate(plays, cfg), plays)
    b = summarize(simulate(plays, cfg), plays)
    assert a.as_dict() == b.as_dict()


@pytest.mark.parametrize(
    ("worse", "better"),
    [
        ("round_robin", "session_hash"),
        ("round_robin", "precise_prefix"),
        ("least_loaded", "agentic+hints"),
    ],
)
def test_cache_affine_policies_reuse_more_prefix_than_oblivious_ones(worse, better):
    plays = _small(8, seed=1)

    def hit(policy):
        profile, _, hints = policy.partition("+")
        cfg = SimConfig(workers=4, lanes=8, speedup=5.0, profile=profile, hints=bool(hints))
        return summarize(simulate(plays, cfg), plays).hit_rate

    assert hit(worse) < hit(better)


def test_engine_reuses_a_resident_prefix_and_never_the_partial_last_block():
    eng = Engine("e", DYNAMO_MOCKER.with_(num_blocks=64))
    first = Seq(1, 64 * 10 + 5, 2, list(range(100, 110)), 0.0)
    eng.add(first)
    t = 0.0
    while eng.has_work():
        t = eng.start_pass(t) or t
        eng.finish_pass(t)
    assert first.cached_tokens == 0
    again = Seq(2, 64 * 10, 2, list(range(100, 110)), t)
    eng.add(again)
    while eng.has_work():
        t = eng.start_pass(t) or t
        eng.finish_pass(t)
    assert again.cached_tokens == 64 * 9  # a fully cached prompt recomputes its last block


def test_engine_evicts_least_recently_freed_blocks_first():
    eng = Engine("e", DYNAMO_MOCKER.with_(num_blocks=24))
    t = 0.0
    for rid, base in enumerate((100, 200, 300)):
        eng.add(Seq(rid, 64 * 8, 1, list(range(base, base + 8)), t))
        while eng.has_work():
            t = eng.start_pass(t) or t
            eng.finish_pass(t)
    eng.add(Seq(9, 64 * 8, 1, list(range(400, 408)), t))
    while eng.has_work():
        t = eng.start_pass(t) or t
        eng.finish_pass(t)
    assert not eng.resident(100) and not eng.resident(107)
    assert eng.resident(200) and eng.resident(300)


def test_scaled_trace_fits_the_small_context_and_keeps_gaps():
    plays = _small(3)
    small = scale_plays(plays, max_context=4096, block_size=128)
    for p, q in zip(plays, small, strict=True):
        assert len(p.requests) == len(q.requests)
        for r, s in zip(p.requests, q.requests, strict=True):
            assert s.input_tokens + s.output_tokens <= 4096
            assert len(s.hashes) == s.input_tokens // 128
            assert [d.delay_s for d in r.deps] == [d.delay_s for d in s.deps]


def _view(name, kv_usage=0.0, queue=0, cap=100):
    from gateway.core.types import EngineView, PoolRole

    return EngineView(
        name=name,
        pool="default",
        role=PoolRole.ANY,
        models=frozenset({"m"}),
        running=queue,
        kv_usage=kv_usage,
        capacity_blocks=cap,
    )


def test_dynamo_trace_copy_lists_every_model_a_file_uses(tmp_path):
    import json

    from benchmarks.dynamo_replay import prepare_traces

    src = tmp_path / "src"
    src.mkdir()
    doc = {"models": ["a"], "requests": [{"model": "a"}, {"subagent": {"requests": [{"model": "b"}]}}]}
    (src / "t.json").write_text(json.dumps(doc))
    (src / "LICENSE").write_text("x")
    assert prepare_traces(src, tmp_path / "dst") == 1
    out = json.loads((tmp_path / "dst" / "t.json").read_text())
    assert out["models"] == ["a", "b"] and out["requests"] == doc["requests"]
    assert not (tmp_path / "dst" / "LICENSE").exists()


def test_dynamo_driver_reports_a_missing_interpreter(tmp_path):
    from benchmarks.dynamo_replay import DynamoUnavailable, run_dynamo

    with pytest.raises(DynamoUnavailable, match="no Dynamo interpreter"):
        run_dynamo([("4x16x1", "kv_router")], traces=tmp_path, python=str(tmp_path / "nope"))


# -- inter-turn planner (gateway.core.planner) in the simulator ------------------------------------


def _two_turn_play(first_tokens=64 * 40, gap_s=30.0):
    """One session: a large first turn, then a small follow-up after ``gap_s``."""
    from benchmarks.sim.traces import Dep, Play, TraceRequest

    h1 = list(range(1000, 1000 + first_tokens // 64))
    h2 = h1 + [5000, 5001]
    r0 = TraceRequest(0, "root", 0.0, first_tokens, 8, h1, api_time=1.0)
    r1 = TraceRequest(
        1, "root", 0.0, first_tokens + 64 * 2, 8, h2, deps=[Dep(0, "completion", gap_s)], gap_s=gap_s
    )
    return [Play("p0", 64, [r0, r1])]


def _planner_sim(plays, planner, **kw):
    from benchmarks.sim.tiers import TiersConfig
    from gateway.core.router import RoutingParams

    cfg = SimConfig(
        workers=3,
        lanes=1,
        profile="agentic",
        hints=True,
        first_turn_workers=1,
        tiers=TiersConfig(host_blocks=4096, **kw),
        routing=RoutingParams(profile="agentic", first_turn_threshold_tokens=1024),
    )
    return simulate(plays, cfg, planner)


def test_planner_moves_a_first_turn_session_to_the_warm_pool_before_its_next_turn():
    from benchmarks.sim.migrations import SimMigrations

    plays = _two_turn_play()
    mig = SimMigrations()
    sim = _planner_sim(plays, mig)
    first, second = sorted(sim.records, key=lambda r: r.idx)
    assert first.engine == "w0"  # the first-turn pool
    assert mig.actions["move:first_turn_to_warm"] == 1
    assert mig.stats["move_done"] == 1 and sim.migrations == 1
    assert sim.kv_bytes_moved > 0
    assert mig.moved_next == [("p0", 1)]
    assert second.engine != "w0" and second.reason == "sticky"
    # the prefix was prefetched onto the target: the next turn finds it on device, loads nothing
    assert second.loaded_tokens == 0 and second.cached_tokens == 64 * 40
    assert summarize(sim, plays).migrations == 1


def test_without_planner_the_next_turn_loads_its_prefix_on_demand():
    plays = _two_turn_play()
    sim = _planner_sim(plays, None)
    second = max(sim.records, key=lambda r: r.idx)
    assert second.engine != "w0" and second.loaded_tokens == 64 * 40
    assert sim.migrations == 0 and sim.kv_bytes_moved == 0


def test_a_next_turn_arriving_first_cancels_the_move():
    from benchmarks.sim.migrations import SimMigrations
    from gateway.core.planner import PlannerParams

    # the planner expects the copy to fit in the 10 ms gap (it assumes a fast link); the store is
    # slow, so the next turn arrives before the prefetch completes
    plays = _two_turn_play(gap_s=0.01)
    mig = SimMigrations(params=PlannerParams(move_bytes_per_s=1e15))
    sim = _planner_sim(plays, mig, store_gbps=0.5)
    assert mig.actions["move:first_turn_to_warm"] == 1
    assert mig.stats["move_cancelled"] == 1 and mig.stats["cancelled:next_turn_arrived"] == 1
    assert mig.stats["move_done"] == 0 and sim.migrations == 0 and mig.moved_next == []


def test_planner_runs_are_deterministic_and_engines_load_from_tiers():
    from benchmarks.sim.migrations import SimMigrations

    plays = _small(4, seed=2)

    def run():
        sim = _planner_sim(plays, SimMigrations())
        return summarize(sim, plays).as_dict(), sim.tiers.loaded_store_blocks

    a, b = run(), run()
    assert a == b
    assert a[0]["kv_bytes_moved"] > 0 and a[0]["migrations"] > 0
    assert a[0]["requests"] == sum(len(p.requests) for p in plays)  # nothing stalls
