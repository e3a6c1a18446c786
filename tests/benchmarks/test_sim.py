"""The simulator's trace loaders, ideal reuse, determinism and a policy sanity check."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sim.cluster import SimConfig, simulate
from gateway.sim.engine import DYNAMO_MOCKER, Engine, Seq
from gateway.sim.metrics import summarize
from gateway.sim.scale import scale_plays
from gateway.sim.traces import ideal_hit_rate, load_weka, synth_agentx, trace_stats

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
    from gateway.sim.traces import Dep, Play, TraceRequest

    h1 = list(range(1000, 1000 + first_tokens // 64))
    h2 = h1 + [5000, 5001]
    r0 = TraceRequest(0, "root", 0.0, first_tokens, 8, h1, api_time=1.0)
    r1 = TraceRequest(
        1, "root", 0.0, first_tokens + 64 * 2, 8, h2, deps=[Dep(0, "completion", gap_s)], gap_s=gap_s
    )
    return [Play("p0", 64, [r0, r1])]


def _planner_sim(plays, planner, **kw):
    from gateway.core.router import RoutingParams
    from gateway.sim.tiers import TiersConfig

    cfg = SimConfig(
        workers=3,
        lanes=1,
        profile="agentic",
        hints=True,
        first_turn_workers=1,
        tiers=TiersConfig(host_blocks=4096, **kw),
        routing=RoutingParams(profile="agentic", split="wall", first_turn_threshold_tokens=1024),
    )
    return simulate(plays, cfg, planner)


def test_planner_moves_a_first_turn_session_to_the_warm_pool_before_its_next_turn():
    from gateway.sim.migrations import SimMigrations

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


def test_without_planner_the_next_turn_stays_where_its_prefix_is():
    # no warm engine holds the prefix (nothing moved it): going warm would load or recompute it,
    # so the turn stays on its first-turn home and finds it on the device
    plays = _two_turn_play()
    sim = _planner_sim(plays, None)
    second = max(sim.records, key=lambda r: r.idx)
    assert second.engine == "w0" and second.reason == "sticky"
    assert second.loaded_tokens == 0 and second.cached_tokens == 64 * 40
    assert sim.migrations == 0 and sim.kv_bytes_moved == 0


def test_a_next_turn_arriving_first_cancels_the_move():
    from gateway.core.planner import PlannerParams
    from gateway.sim.migrations import SimMigrations

    # the planner expects the copy to fit in the 10 ms gap (it assumes a fast link); the store is
    # slow, so the next turn arrives before the prefetch completes
    plays = _two_turn_play(gap_s=0.01)
    mig = SimMigrations(params=PlannerParams(move_bytes_per_s=1e15))
    sim = _planner_sim(plays, mig, store_gbps=0.5)
    assert mig.actions["move:first_turn_to_warm"] == 1
    assert mig.stats["move_cancelled"] == 1 and mig.stats["cancelled:next_turn_arrived"] == 1
    assert mig.stats["move_done"] == 0 and sim.migrations == 0 and mig.moved_next == []


def test_planner_runs_are_deterministic_and_engines_load_from_tiers():
    from gateway.sim.migrations import SimMigrations

    plays = _small(4, seed=2)

    def run():
        sim = _planner_sim(plays, SimMigrations())
        return summarize(sim, plays).as_dict(), sim.tiers.loaded_store_blocks

    a, b = run(), run()
    assert a == b
    assert a[0]["kv_bytes_moved"] > 0 and a[0]["migrations"] > 0
    assert a[0]["requests"] == sum(len(p.requests) for p in plays)  # nothing stalls


def _chunks(cfg, prompts):
    """Run ``prompts`` (fresh, no shared prefix) on one engine; the prefill chunk of every pass."""
    eng = Engine("e", cfg)
    for i, n in enumerate(prompts):
        eng.add(Seq(i, n, 2, list(range(10_000 * (i + 1), 10_000 * (i + 1) + n // 64)), 0.0))
    t, chunks = 0.0, []
    while eng.has_work():
        t = eng.start_pass(t) or t
        chunks.append(eng.prefill_tokens)
        eng.finish_pass(t)
    return [b - a for a, b in zip([0, *chunks], chunks, strict=False) if b > a]


@pytest.mark.parametrize(
    ("threshold", "batched", "prompts", "expected"),
    [
        (0, 8192, [3000], [3000]),
        (0, 1024, [3000], [1024, 1024, 952]),
        # alone on the engine, vLLM lifts the long-prefill cap (nobody to starve)
        (512, 8192, [3000], [3000]),
        # two requests: each chunk capped at 512 in the same pass; once the short one is done the
        # long one is alone and takes the rest at once
        (512, 8192, [3000, 1000], [1024, 1000, 512, 1464]),
        # and the budget: the second request gets what the first leaves (256), a decode takes 1
        (512, 768, [3000, 1000], [768, 768, 768, 744, 512, 440]),
    ],
)
def test_engine_applies_vllm_long_prefill_threshold_and_batched_token_budget(
    threshold, batched, prompts, expected
):
    cfg = DYNAMO_MOCKER.with_(long_prefill_token_threshold=threshold, max_batched_tokens=batched)
    assert _chunks(cfg, prompts) == expected


def test_engine_reports_decoders_and_prefill_backlog():
    eng = Engine("e", DYNAMO_MOCKER.with_(max_batched_tokens=1024))
    eng.add(Seq(1, 3000, 4, list(range(100, 146)), 0.0))
    eng.add(Seq(2, 500, 4, list(range(200, 207)), 0.0))
    assert (eng.decoding, eng.prefill_backlog_tokens()) == (0, 3500)
    t = eng.start_pass(0.0)
    eng.finish_pass(t)
    assert (eng.decoding, eng.prefill_backlog_tokens()) == (0, 3500 - 1024)
    while eng.decoding == 0:
        t = eng.start_pass(t)
        eng.finish_pass(t)
    assert eng.prefill_backlog_tokens() <= 500


def test_simulator_drives_the_role_controller_in_virtual_time():
    from gateway.core.roles import RoleParams
    from gateway.core.types import PoolRole

    plays = _small(6)
    roles = RoleParams(backlog_tokens_per_engine=8192, min_dwell_s=2.0, interval_s=0.5)
    cfg = SimConfig(workers=4, lanes=6, speedup=5.0, profile="agentic", hints=True, roles=roles)
    sim = simulate(plays, cfg)
    assert sim.controller is not None and sim.role_changes > 0
    assert len(sim.records) == sum(len(p.requests) for p in plays)
    first = {e.name for e in sim.views() if e.role == PoolRole.FIRST_TURN}
    assert first == {n for n, r in sim.controller.roles.items() if r == PoolRole.FIRST_TURN}
    again = simulate(plays, cfg)
    assert (again.role_changes, [r.engine for r in again.records]) == (
        sim.role_changes,
        [r.engine for r in sim.records],
    )


def test_cost_split_lets_idle_warm_engines_take_first_turns_the_wall_does_not():
    from gateway.core.router import RoutingParams

    plays = _small(4)

    def first_turn_engines(split):
        cfg = SimConfig(
            workers=4,
            lanes=4,
            speedup=5.0,
            profile="agentic",
            hints=True,
            first_turn_workers=1,
            routing=RoutingParams(profile="agentic", split=split, first_turn_threshold_tokens=4096),
        )
        sim = simulate(plays, cfg)
        return {r.engine for r in sim.records if r.idx == 0 and r.stream == "root"}

    assert first_turn_engines("wall") == {"w0"}
    assert first_turn_engines("cost") - {"w0"}


def test_compare_prints_copied_dynamo_figures_only_under_their_trace_and_engine():
    from benchmarks import compare
    from gateway.sim.metrics import RunMetrics

    row = RunMetrics("p", 1, 1.0, 2.0, 3.0, 0.9, 0.95, 0, 60.0, 100.0, 100.0, 1.0, 0, 0, 0)
    copied = compare.format_table([row], "8x16x1", None, anchors=True)
    assert "Dynamo KV router" in copied and "copied from shared/ANCHORS.md, not run" in copied
    assert "Dynamo" not in compare.format_table([row], "8x16x1", None, anchors=False)
    weka = str(compare.shared_path("traces/weka"))
    assert compare.anchors_apply("weka", None, "dynamo-mocker", {})
    assert compare.anchors_apply("weka", weka, "dynamo-mocker", {})
    assert not compare.anchors_apply("synth", None, "dynamo-mocker", {})
    assert not compare.anchors_apply("weka", None, "h200-qwen3-32b-fp8-aic", {})
    assert not compare.anchors_apply("weka", "/elsewhere", "dynamo-mocker", {})
    assert not compare.anchors_apply("weka", None, "dynamo-mocker", {"long_prefill_token_threshold": 512})


def test_capacity_at_the_slo_is_the_largest_lane_count_meeting_both_bounds():
    from benchmarks import compare

    sweep = {
        "precise_prefix": [(8, 1.0, 60.0, 300.0), (16, 2.0, 49.0, 300.0), (24, 3.0, 55.0, 2000.0)],
        "ours": [(8, 1.0, 60.0, 300.0), (16, 2.5, 52.0, 900.0), (24, 3.0, 40.0, 900.0)],
    }
    _, cap = compare.capacity_table(sweep, 1000.0, 50.0)
    assert (cap["precise_prefix"]["lanes"], cap["ours"]["lanes"], cap["ours"]["tpgs"]) == (8, 16, 2.5)
    assert cap["ours"]["ratio"] == 2.0


def test_synthetic_plays_are_seeded_and_round_trip_through_weka_json(tmp_path):
    from gateway.sim.synth import main as synth_main

    a, again, other = synth_agentx(4, seed=1), synth_agentx(4, seed=1), synth_agentx(4, seed=2)
    assert [len(p.requests) for p in a] == [len(p.requests) for p in again]
    assert [r.input_tokens for p in a for r in p.requests] == [
        r.input_tokens for p in again for r in p.requests
    ]
    assert [r.input_tokens for p in a for r in p.requests] != [
        r.input_tokens for p in other for r in p.requests
    ]
    assert synth_main(["--n", "4", "--seed", "1", "--out", str(tmp_path)]) == 0
    b = load_weka(tmp_path)
    # the shared system prompt survives (one hash namespace for global-scope files)
    assert ideal_hit_rate(b) == ideal_hit_rate(a)
    assert b[0].requests[0].hashes[:10] == b[1].requests[0].hashes[:10]
    for p, q in zip(a, b, strict=True):
        assert (p.play_id, p.subagents) == (q.play_id, q.subagents)
        for r, s in zip(p.requests, q.requests, strict=True):
            assert (r.stream, r.input_tokens, r.output_tokens, len(r.hashes)) == (
                s.stream,
                s.input_tokens,
                s.output_tokens,
                len(s.hashes),
            )
            assert r.gap_s == pytest.approx(s.gap_s)
            key = lambda d: (d.on, d.trigger)  # noqa: E731
            assert [(d.on, d.trigger) for d in sorted(r.deps, key=key)] == [
                (d.on, d.trigger) for d in sorted(s.deps, key=key)
            ]
            assert [d.delay_s for d in sorted(r.deps, key=key)] == pytest.approx(
                [d.delay_s for d in sorted(s.deps, key=key)]
            )


def test_a_seed_grid_reports_the_median_of_each_column_over_the_seeds(tmp_path):
    import json

    from benchmarks.compare import main as compare_main

    argv = ["--trace", "synth", "--n", "3", "--seeds", "1,2,3", "--configs", "2x2x1", "--no-sweep"]
    assert (
        compare_main([*argv, "--policies", "precise_prefix,agentic+hints+planner", "--out", str(tmp_path)])
        == 0
    )
    runs = json.loads((tmp_path / "seeds.json").read_text())["runs"]["2x2x1"]
    for policy in ("precise_prefix", "agentic+hints+planner"):
        per_seed = runs[policy]["seeds"]
        assert [r["seed"] for r in per_seed] == [1, 2, 3]
        p90 = sorted(r["ttft_p90_ms"] for r in per_seed)
        assert runs[policy]["median"]["ttft_p90_ms"] == p90[1]
    # the seeds are different plays
    assert len({r["requests"] for r in runs["precise_prefix"]["seeds"]}) > 1
    assert all("executor" in r for r in runs["agentic+hints+planner"]["seeds"])
    assert not any("executor" in r for r in runs["precise_prefix"]["seeds"])


def test_move_fates_are_the_median_of_the_seeds_by_outcome():
    from benchmarks.compare import move_fates

    seeds = [
        {"moves": {"move:knee_ahead": 10}, "executor": {"move_started": 8, "cancelled:new_plan": 2}},
        {"moves": {"move:knee_ahead": 20}, "executor": {"move_started": 12, "move_done": 9}},
        {"moves": {"move:knee_ahead": 30}, "executor": {"move_started": 30, "move_done": 25, "pin_x": 1}},
    ]
    assert move_fates(seeds) == (
        "moves (median of seeds): cancelled:new_plan 0, move_done 9, move_started 12, planned knee_ahead 20"
    )


def test_planner_policies_route_as_the_gateway_does_where_it_runs_the_planner():
    from gateway.core.router import PLANNED_KNEE_OUTPUT_TOKENS, PLANNED_OVERFLOW_WAIT_TOKENS
    from gateway.sim.metrics import ideal_hits_by_request
    from gateway.sim.runs import LAST_SIMS, run_one

    plays = synth_agentx(2, seed=1)
    ideal = ideal_hits_by_request(plays)
    priced = (PLANNED_KNEE_OUTPUT_TOKENS, PLANNED_OVERFLOW_WAIT_TOKENS)
    for policy, want in (
        ("agentic+hints", (0, 0)),
        ("agentic+hints+planner", priced),
        ("agentic+hints+planner+kneefree+ovffree", (0, 0)),
    ):
        run_one(plays, ideal, policy, 2, 2, 1.0, "dynamo-mocker")
        r = LAST_SIMS.pop(policy).cfg.routing
        assert (r.knee_output_tokens, r.overflow_wait_tokens) == want, policy


@pytest.mark.parametrize("engine", ["dynamo-mocker", "h200-qwen3-32b-fp8-aic"])
def test_the_default_policies_route_with_what_agentgw_serve_runs(engine):
    """``default`` and ``default-stock`` route with exactly the parameters ``agentgw serve``
    computes from its configuration for a pool with and without a ``control_url``, the engine
    model's cost fit written in ``routing.cost_*`` as a deployment writes it; and each runs with
    the tiers its engines have (a host tier and the store; vLLM's CPU offload alone; none)."""
    from gateway.config import GatewayConfig
    from gateway.sim.calibration import ENGINES
    from gateway.sim.metrics import ideal_hits_by_request
    from gateway.sim.runs import LAST_SIMS, run_one

    perf = ENGINES[engine]().perf
    eng = ENGINES[engine]()
    cap = eng.long_prefill_token_threshold
    fit = {
        "cost_prefill_ms": (perf.p0, perf.p1, perf.p2),
        "cost_chunk_tokens": min(eng.max_batched_tokens, cap) if cap > 0 else eng.max_batched_tokens,
        "cost_decode_ms": (perf.d0, perf.d1, perf.d2),
        "cost_decode_seq_ms": perf.d_seq,
        "cost_decode_kv_ms_per_mtok": perf.d_kv,
        "cost_kv_capacity_tokens": eng.num_blocks * eng.block_size if perf.d_kv else 0,
        "kv_bytes_per_token": eng.kv_bytes_per_token or 131_072,
    }

    def served(control_url: str | None) -> object:
        pool = {
            "name": "p",
            "engines": [{"name": "e", "url": "http://e:1", "model": "m", "control_url": control_url}],
        }
        return GatewayConfig.model_validate({"pools": [pool], "routing": fit}).router_params()

    plays = synth_agentx(2, seed=1)
    ideal = ideal_hits_by_request(plays)
    for policy, want, store, host in (
        ("default", served("http://e:2"), True, True),
        ("default-stock", served(None), False, True),
        ("default-stock+nooffload", served(None), False, False),
    ):
        run_one(plays, ideal, policy, 2, 2, 1.0, engine)
        sim = LAST_SIMS.pop(policy)
        assert sim.cfg.routing == want, policy
        tiers = sim.cfg.tiers
        assert (tiers is not None and tiers.store, tiers is not None and tiers.host_blocks > 0) == (
            store,
            host,
        )
        assert sim.cfg.hints and (sim.planner is not None) == (policy == "default"), policy
