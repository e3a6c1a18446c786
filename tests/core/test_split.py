"""Table-driven tests of the engine cost model and the work-conserving ``cost_split`` filter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.core.policies.cost import EngineCost
from gateway.core.policies.split import CostSplit
from gateway.core.router import Router, RoutingParams
from gateway.core.types import EngineView, PoolRole, PrefixMatch, RouteRequest, SessionView, Snapshot

M = frozenset({"m"})
#: pass = 10 ms + 0.01 ms per token, chunks of 1,000 tokens, decode step 20 ms, moves 10 MB/s of
#: 1,000-byte tokens (0.1 ms per token)
COST = EngineCost(
    prefill_ms=(10.0, 0.01, 0.0),
    chunk_tokens=1000,
    decode_ms=(20.0, 0.0, 0.0),
    kv_bytes_per_token=1000,
    move_bytes_per_s=1e7,
)


#: a step of 10 ms + 20 ms per million context tokens over 1M tokens of KV
CTX = EngineCost(decode_ms=(10.0, 0.0, 0.0), decode_kv_ms_per_mtok=20.0, kv_capacity_tokens=1_000_000)
#: a step of 10 ms + 1 ms per sequence, sequences of 100K tokens over 1M tokens of KV
BATCH = EngineCost(
    decode_ms=(10.0, 0.0, 0.0), decode_seq_ms=1.0, kv_capacity_tokens=1_000_000, decode_seq_tokens=100_000
)
#: gateway/sim/calibration.py's h200-qwen3-32b-fp8-aic decode fit, 10,240 blocks of 64 tokens
H200_AIC = EngineCost(
    decode_ms=(20.78, 0.0, 0.0), decode_seq_ms=0.0846, decode_kv_ms_per_mtok=42.15, kv_capacity_tokens=655_360
)


def eng(name: str, role: PoolRole = PoolRole.WARM, **kw: object) -> EngineView:
    pool = {PoolRole.FIRST_TURN: "first", PoolRole.WARM: "warm", PoolRole.ANY: "any"}[role]
    return EngineView(name=name, pool=pool, role=role, models=M, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        (lambda: COST.pass_ms(0), 0.0),
        (lambda: COST.pass_ms(500), 15.0),
        (lambda: COST.passes(2500), 3),
        (lambda: COST.prefill_s(2500), 0.055),  # 2 x 20 ms + 15 ms
        (lambda: COST.step_s(eng("w", decoding=0)), 0.0),
        (lambda: COST.step_s(eng("w", decoding=3)), 0.02),
        (lambda: COST.wait_s(eng("w", decoding=2, prefill_backlog_tokens=1000)), 0.04),
        (lambda: COST.ttft_s(eng("w", decoding=2, prefill_backlog_tokens=1000), 500), 0.075),
        (lambda: COST.interference_s(eng("w", decoding=4), 2000), 0.16),
        (lambda: COST.move_s(5000), 0.5),
        (lambda: EngineCost(move_bytes_per_s=0).move_s(5000), 0.0),
        # the decode knee: the KV use where a step reaches 1000 / tok_s ms
        (lambda: EngineCost().decode_knee(50.0), 0.3097),  # mocker: 5.74 + 54.01u - 25.74u^2 = 20
        (lambda: EngineCost(decode_ms=(10.0, 20.0, 0.0)).decode_knee(50.0), 0.5),  # 10 + 20u = 20
        (lambda: EngineCost(decode_ms=(10.0, 20.0, 0.0)).decode_knee(20.0), 1.0),  # 30 ms <= 50 ms
        (lambda: COST.decode_knee(40.0), 1.0),  # a flat 20 ms step is always under 25 ms
        (lambda: COST.decode_knee(60.0), 0.0),  # ... and always over 16.7 ms
        (lambda: COST.decode_knee(0.0), 1.0),  # no target
        # batch and context terms (the H200 calibrations): both 0 by default (the mocker)
        (lambda: EngineCost().decode_step_ms(0.5, 64), 26.31),  # the mocker ignores the batch
        (
            lambda: EngineCost(decode_ms=(10.0, 0.0, 0.0), decode_seq_ms=1.0).step_s(eng("w", decoding=3)),
            0.013,
        ),
        (
            lambda: EngineCost(decode_ms=(10.0, 0.0, 0.0), decode_seq_ms=2.0).decode_step_ms(0.5),
            12.0,
        ),  # batch 1
        (
            lambda: EngineCost(decode_ms=(10.0, 0.0, 0.0), decode_kv_ms_per_mtok=42.0).decode_knee(50.0),
            1.0,
        ),  # K unknown
        (lambda: CTX.decode_step_ms(0.25), 15.0),  # 10 + 20 ms/Mtok x 0.25 x 1M tokens
        (lambda: CTX.decode_knee(50.0), 0.5),  # 10 + 20u = 20
        (lambda: CTX.decode_knee(40.0), 0.75),  # 10 + 20u = 25
        (lambda: BATCH.decode_knee(1000.0 / 15.5), 0.6),  # 10 + 1 ms x floor(u x 10) <= 15.5: batch 5
        (lambda: BATCH.decode_step_ms(0.0), 11.0),  # an empty engine still decodes one sequence
        (lambda: H200_AIC.decode_knee(40.0), 0.1497),  # 20.78 + 0.0846 + 42.15 x 0.65536u = 25
        (lambda: H200_AIC.decode_knee(50.0), 0.0),  # its 20.86 ms floor is over 20 ms
        (lambda: replace(H200_AIC, kv_capacity_tokens=0).decode_knee(40.0), 1.0),  # the knee as before
    ],
)
def test_engine_cost_formulas(quantity, expected) -> None:  # type: ignore[no-untyped-def]
    assert quantity() == pytest.approx(expected, abs=1e-4)


F = eng("f0", PoolRole.FIRST_TURN)
BUSY_WARM = eng("w0", decoding=8)
IDLE_WARM = eng("w1")
# a 4,096-token prompt: 4 chunks of 20 ms + one of 10.96 ms = 0.091 s of prefill; on the first-turn
# engine + 0.5 x 0.41 s of move = 0.296 s; on a warm engine decoding 8: + 5 x 20 ms of decode
# steps + 8 x 0.091 s of interference = 0.919 s
FRESH = RouteRequest(model="m", prompt_tokens=4096, block_size=128, session_id="s")


@pytest.mark.parametrize(
    ("engines", "matches", "expected", "why"),
    [
        ([eng("a", PoolRole.ANY), eng("b", PoolRole.ANY)], {}, ["a", "b"], "one pool: no split"),
        ([F, BUSY_WARM], {}, ["f0"], "interference on 8 decoders > move"),
        ([F, IDLE_WARM], {}, ["w1"], "a warm engine with spare capacity takes the first turn"),
        ([F, BUSY_WARM, IDLE_WARM], {}, ["w0", "w1"], "the cheapest warm engine prices the side"),
        ([F, BUSY_WARM], {"w0": PrefixMatch(31, 31, 31.0)}, ["w0"], "a warm turn stays warm"),
        (
            [eng("f0", PoolRole.FIRST_TURN, prefill_backlog_tokens=100_000), BUSY_WARM],
            {},
            ["w0"],
            "a backed-up first-turn pool (100 passes = 2 s) overflows to warm",
        ),
        (
            [F, eng("w0", prefill_backlog_tokens=1_000_000, decoding=1)],
            {"w0": PrefixMatch(31, 31, 31.0)},
            ["f0"],
            "an idle first-turn engine takes a warm turn whose home is backed up",
        ),
        (
            [F, eng("w0", kv_usage=0.99, capacity_blocks=100)],
            {"w0": PrefixMatch(31, 31, 31.0)},
            ["f0"],
            "a warm engine that cannot hold the prompt is not priced",
        ),
        (
            [eng("f0", PoolRole.FIRST_TURN), eng("a", PoolRole.ANY, decoding=8)],
            {},
            ["f0", "a"],
            "no warm-role engine: keep all",
        ),
    ],
)
def test_cost_split(engines, matches, expected, why) -> None:  # type: ignore[no-untyped-def]
    split = CostSplit(COST, move_weight=0.5, interference_weight=1.0)
    snap = Snapshot(engines=tuple(engines), matches=matches)
    got = [e.name for e in split.filter(FRESH, snap, engines)]
    assert got == expected, why


@pytest.mark.parametrize(
    ("interference_weight", "move_weight", "expected"),
    [(1.0, 0.5, "f0"), (0.0, 0.5, "w0"), (1.0, 5.0, "w0")],
)
def test_cost_split_weights_trade_interference_against_moves(
    interference_weight: float, move_weight: float, expected: str
) -> None:
    split = CostSplit(COST, move_weight=move_weight, interference_weight=interference_weight)
    snap = Snapshot(engines=(F, BUSY_WARM))
    assert [e.name for e in split.filter(FRESH, snap, snap.engines)] == [expected]


def params(split: str) -> RoutingParams:
    return RoutingParams(
        profile="agentic",
        split=split,
        first_turn_threshold_tokens=2048,
        cost_prefill_ms=COST.prefill_ms,
        cost_chunk_tokens=COST.chunk_tokens,
        cost_decode_ms=COST.decode_ms,
        kv_bytes_per_token=COST.kv_bytes_per_token,
        move_bytes_per_s=COST.move_bytes_per_s,
    )


@pytest.mark.parametrize(
    ("split", "engines", "expected"),
    [
        ("wall", [F, IDLE_WARM], "f0"),  # the wall sends every long fresh prompt to first-turn
        ("cost", [F, IDLE_WARM], "w1"),  # the cost split lets an idle warm engine take it
        ("cost", [F, BUSY_WARM], "f0"),
    ],
)
def test_agentic_profile_routes_first_turns_by_its_split(
    split: str, engines: list[EngineView], expected: str
) -> None:
    d = Router(params(split)).route(FRESH, Snapshot(engines=tuple(engines)))
    assert d.engine == expected


def test_a_moved_session_keeps_home_on_the_warm_side() -> None:
    session = SessionView("s", home="w0", pool="warm", turns=3, context_tokens=4096)
    snap = Snapshot(
        engines=(F, BUSY_WARM, IDLE_WARM), matches={"w0": PrefixMatch(31, 31, 31.0)}, session=session
    )
    assert Router(params("cost")).route(FRESH, snap).engine == "w0"


def test_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        Router(params("moat"))


@pytest.mark.parametrize(
    ("engines", "matches", "expected"),
    [
        # all free: alike
        ([IDLE_WARM, eng("w2")], {}, [1.0, 1.0]),
        # 0.091 s of prefill alone vs + 5 decode steps (0.1 s) + 8 x 0.091 s: (0.092 / 0.92)
        ([IDLE_WARM, BUSY_WARM], {}, [1.0, 0.092 / 0.92]),
        # the prefix on w0 leaves 128 tokens, but 11.28 ms + a 20 ms step + 8 x 11.28 ms there
        # still costs more than 90.96 ms of recompute on the idle engine (the prefix scorer and
        # the sticky picker weigh the cache; this scorer prices only time)
        (
            [IDLE_WARM, BUSY_WARM],
            {"w0": PrefixMatch(31, 31, 31.0)},
            [1.0, (0.09096 + 0.001) / (0.1215 + 0.001)],
        ),
    ],
)
def test_interference_scorer(engines, matches, expected) -> None:  # type: ignore[no-untyped-def]
    from gateway.core.policies.interference import InterferenceScorer

    snap = Snapshot(engines=tuple(engines), matches=matches)
    assert list(InterferenceScorer(COST).score(FRESH, snap, engines)) == pytest.approx(expected, rel=1e-3)


def test_a_session_homed_on_a_first_turn_engine_owes_no_new_move_there() -> None:
    # the controller made w0's home first-turn: its warm turn (128 uncached tokens) stays there
    # rather than recomputing 4,096 tokens on a warm engine; a session homed elsewhere is charged
    # the move (0.205 s) and goes warm
    home_ft = eng("f0", PoolRole.FIRST_TURN, decoding=2)
    idle = eng("w1")
    matches = {"f0": PrefixMatch(31, 31, 31.0)}
    split = CostSplit(COST, move_weight=5.0)
    for home, expected in (("f0", ["f0"]), ("w9", ["w1"])):
        session = SessionView("s", home=home, pool=None, turns=3, context_tokens=4096)
        snap = Snapshot(engines=(home_ft, idle), matches=matches, session=session)
        assert [e.name for e in split.filter(FRESH, snap, snap.engines)] == expected, home
