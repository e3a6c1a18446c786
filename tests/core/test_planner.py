"""Table-driven tests of the inter-turn planner."""

from __future__ import annotations

import pytest

from gateway.core.planner import ActionKind, PlannerParams, TurnOutcome, plan_after_turn
from gateway.core.types import EngineView, PoolRole, PrefixMatch

M = frozenset({"m"})
F0 = EngineView("f0", "first", PoolRole.FIRST_TURN, M)
W0 = EngineView("w0", "warm", PoolRole.WARM, M)
W1 = EngineView("w1", "warm", PoolRole.WARM, M, running=3)
W2 = EngineView("w2", "warm", PoolRole.WARM, M, running=1)
HOT = EngineView("w0", "warm", PoolRole.WARM, M, running=40)
DOWN = EngineView("w2", "warm", PoolRole.WARM, M, healthy=False)
FULL = EngineView("w0", "warm", PoolRole.WARM, M, kv_usage=0.95, capacity_blocks=100)
P = PlannerParams()


def turn(home: str = "w0", gap: float = 10.0, **kw: object) -> TurnOutcome:
    return TurnOutcome("s", home, context_tokens=kw.pop("ctx", 50_000), gap_s=gap, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("t", "engines", "matches", "kind", "targets", "reason"),
    [
        (turn(ended=True), [W0, W1], {}, ActionKind.RELEASE, (), "session_end"),
        (turn("f0"), [F0, W0, W1, W2], {}, ActionKind.MOVE, ("w0",), "first_turn_to_warm"),
        # prefer the warm engine that already holds the prefix
        (
            turn("f0"),
            [F0, W0, W1],
            {"w1": PrefixMatch(10, 10, 10.0)},
            ActionKind.MOVE,
            ("w1",),
            "first_turn_to_warm",
        ),
        (turn("f0"), [F0, DOWN], {}, ActionKind.STAY, (), "stay"),
        (turn(fan_out=3), [W0, W1, W2, F0], {}, ActionKind.REPLICATE, ("w2", "w1"), "fan_out"),
        # a subagent's own requests carry the fan-out hint too: no replication from them
        (turn(fan_out=3, is_subagent=True), [W0, W1, W2], {}, ActionKind.STAY, (), "stay"),
        # a first turn moves even when the copy may not finish within the gap (never waited on)
        (turn("f0", gap=0.05), [F0, W0, W1], {}, ActionKind.MOVE, ("w0",), "first_turn_to_warm"),
        # a target without room for the prefix is skipped
        (turn("f0"), [F0, FULL, W1], {}, ActionKind.MOVE, ("w1",), "first_turn_to_warm"),
        (turn(gap=600), [W0, W1], {}, ActionKind.DEMOTE, (), "long_gap"),
        # hot home, cold target, moving 50K tokens (0.2 s at 2 GB/s) fits in a 10 s gap
        (turn(), [HOT, W2], {}, ActionKind.MOVE, ("w2",), "rebalance"),
        # but not in a 0.1 s gap
        (turn(gap=0.1), [HOT, W2], {}, ActionKind.STAY, (), "stay"),
        (turn(), [W0, W1], {}, ActionKind.STAY, (), "stay"),
    ],
)
def test_plan(t, engines, matches, kind, targets, reason) -> None:  # type: ignore[no-untyped-def]
    a = plan_after_turn(t, engines, matches, P)
    assert (a.kind, a.targets, a.reason) == (kind, targets, reason)


def test_pin_ttl_is_gap_plus_margin_capped() -> None:
    assert plan_after_turn(turn(gap=40), [W0], {}, P).pin_ttl_s == 45
    assert plan_after_turn(turn(gap=10_000), [W0], {}, P).pin_ttl_s == P.max_pin_s


DEAD = EngineView("w0", "warm", PoolRole.WARM, M, healthy=False)
W1_DOWN = EngineView("w1", "warm", PoolRole.WARM, M, healthy=False)
W2_FULL = EngineView("w2", "warm", PoolRole.WARM, M, kv_usage=0.95, capacity_blocks=100)
W1_BUSY = EngineView("w1", "warm", PoolRole.WARM, M, running=5, waiting=20)


@pytest.mark.parametrize(
    ("engines", "matches", "target"),
    [
        # the least loaded live engine of the dead engine's pool, never another pool's
        ([DEAD, W1, W2, F0], {}, "w2"),
        # the one that already holds the session's prefix (device first)
        ([DEAD, W1, W2], {"w1": PrefixMatch(10, 10, 10.0)}, "w1"),
        # room for the context and a short queue are preferred, not required
        ([DEAD, W1, W2_FULL], {"w2": PrefixMatch(10, 10, 10.0)}, "w1"),
        ([DEAD, W1_BUSY, W2_FULL], {}, "w1"),
        ([DEAD, W2_FULL], {}, "w2"),
        # no healthy engine left in the pool: no plan (the next turn's routing decides)
        ([DEAD, W1_DOWN, F0], {}, None),
        ([F0], {}, None),  # the dead engine is not even configured
    ],
)
def test_rehome_moves_to_the_best_live_engine_of_the_same_pool(  # type: ignore[no-untyped-def]
    engines, matches, target
) -> None:
    from gateway.core.planner import plan_rehome

    a = plan_rehome("s", "w0", 8_000, 128, engines, matches, P, gap_s=20.0)
    if target is None:
        assert a is None
        return
    assert a is not None
    assert (a.kind, a.source, a.targets, a.reason) == (ActionKind.MOVE, "w0", (target,), "engine_down")
    assert a.pin_ttl_s == 20.0 + P.pin_margin_s


def test_home_ledger_lists_and_moves_an_engines_sessions() -> None:
    from gateway.core.turn import HomeLedger

    ledger = HomeLedger(live_s=30)
    ledger.placed("a", "w0", 0.0)
    ledger.settled("a", "w0", 1000, 1.0)
    ledger.placed("b", "w1", 1.0)
    ledger.settled("b", "w1", 500, 2.0)
    ledger.placed("c", "w0", 2.0)
    assert ledger.on_engine("w0") == ["a", "c"]
    ledger.moved("a", "w1")
    assert ledger.on_engine("w0") == ["c"] and ledger.on_engine("w1") == ["a", "b"]
    assert dict(ledger.homed(3.0)) == {"w1": 1500}
    ledger.moved("unknown", "w1")  # not in the ledger: nothing to move
    assert dict(ledger.homed(3.0)) == {"w1": 1500}


# -- knee_ahead: move a session during its tool gap when its next turn would pass the knee -------

from dataclasses import replace  # noqa: E402

from gateway.core.planner import MoveState, plan_turn  # noqa: E402

#: engines of 100 blocks of 128 tokens (12,800 tokens); the knee at 0.31 of the KV (3,968 tokens);
#: moving at 2 GB/s with 8 KiB per token: 244K tokens per second
K = PlannerParams(knee_kv_share=0.31, max_moves_per_engine=1, max_moves_per_s=0.1, rate_window_s=10.0)


def kw(name: str, **extra: object) -> EngineView:
    return EngineView(name, "warm", PoolRole.WARM, M, capacity_blocks=100, **extra)  # type: ignore[arg-type]


A, B, C = kw("a"), kw("b"), kw("c")


def ahead(
    engines: list[EngineView],
    expected: dict[str, int],
    ctx: int = 2_000,
    gap: float = 10.0,
    matches: dict[str, PrefixMatch] | None = None,
    moves: MoveState | None = None,
    params: PlannerParams = K,
    now: float = 100.0,
) -> tuple[str, tuple[str, ...], MoveState]:
    t = TurnOutcome("s", "a", context_tokens=ctx, gap_s=gap, next_tokens=ctx + 200)
    a, state = plan_turn(t, engines, matches or {}, params, moves or MoveState(), now, expected)
    return a.reason, a.targets, state


@pytest.mark.parametrize(
    ("engines", "expected", "ctx", "gap", "matches", "want", "why"),
    [
        ([A, B], {"a": 1_000}, 2_000, 10.0, {}, ("stay", ()), "3,200 of 12,800 at home: under the knee"),
        (
            [A, B],
            {"a": 2_000},
            2_000,
            10.0,
            {},
            ("knee_ahead", ("b",)),
            "4,200 at home past 3,968: move to b",
        ),
        (
            [A, B, C],
            {"a": 2_000, "b": 1_500, "c": 500},
            2_000,
            10.0,
            {},
            ("knee_ahead", ("c",)),
            "the target with the lowest projected share",
        ),
        (
            [A, B, C],
            {"a": 2_000, "b": 500, "c": 500},
            2_000,
            10.0,
            {"c": PrefixMatch(10, 10, 10.0)},
            ("knee_ahead", ("c",)),
            "equal shares: the one that already holds part of the context copies less",
        ),
        (
            [A, B],
            {"a": 2_000, "b": 2_000},
            2_000,
            10.0,
            {},
            ("stay", ()),
            "past the knee everywhere: stay",
        ),
        ([A, B], {}, 5_000, 10.0, {}, ("stay", ()), "a session past the knee on its own is slow anywhere"),
        (
            [A, B],
            {"a": 2_000},
            2_000,
            1.0,
            {},
            ("stay", ()),
            "imminent: the copy (9 ms) + 1 s margin does not fit a 1 s gap",
        ),
        (
            [A, kw("b", running=20)],
            {"a": 2_000},
            2_000,
            10.0,
            {},
            ("stay", ()),
            "the only target's queue is past max_target_queue",
        ),
        (
            [A, EngineView("b", "first", PoolRole.FIRST_TURN, M, capacity_blocks=100)],
            {"a": 2_000},
            2_000,
            10.0,
            {},
            ("stay", ()),
            "never to a first-turn engine",
        ),
        (
            [A, B],
            {"a": 2_000},
            2_000,
            600.0,
            {},
            ("knee_ahead", ("b",)),
            "a long gap would demote; the knee move comes first",
        ),
    ],
)
def test_knee_ahead(engines, expected, ctx, gap, matches, want, why) -> None:  # type: ignore[no-untyped-def]
    reason, targets, _ = ahead(engines, expected, ctx, gap, matches)
    assert (reason, targets) == want, why


def test_knee_ahead_is_off_without_a_knee() -> None:
    assert ahead([A, B], {"a": 2_000}, params=PlannerParams())[:2] == ("stay", ())


def test_knee_ahead_bounds_moves_per_engine_rate_and_dwell() -> None:
    hot = {"a": 2_000}
    reason, _, state = ahead([A, B, C], hot)
    assert reason == "knee_ahead" and state.inflight == {"s": ("a", "b", 2_200)}
    assert dict(state.active) == {"a": 1, "b": 1}
    # another session of the same home while that move is in flight: one move per engine at a time
    t = TurnOutcome("t", "a", context_tokens=2_000, gap_s=10.0)
    a, _ = plan_turn(t, [A, B, C], {}, K, state, 101.0, hot)
    assert a.reason == "stay"
    # a third engine's session, projected to b's share like s: b now counts s's 2,200 tokens
    t2 = TurnOutcome("u", "c", context_tokens=2_000, gap_s=10.0)
    many = replace(K, max_moves_per_s=1.0)
    a, _ = plan_turn(t2, [A, B, kw("c"), kw("d")], {}, many, state, 101.0, {"c": 2_000, "d": 100})
    assert (a.reason, a.targets) == ("knee_ahead", ("d",))
    # the move completed: engines free again, but the rate (1 per 10 s) still holds within 10 s
    done = state.finished("s")
    assert dict(done.active) == {} and done.inflight == {}
    a, _ = plan_turn(t, [A, B, C], {}, K, done, 105.0, hot)
    assert a.reason == "stay"
    a, later = plan_turn(t, [A, B, C], {}, K, done, 111.0, hot)
    assert (a.reason, a.targets) == ("knee_ahead", ("b",))
    # the moved session within its dwell (60 s) is not moved again, after it is
    assert ahead([A, B, C], hot, moves=later.finished("t"), now=150.0)[0] == "stay"
    assert ahead([A, B, C], hot, moves=later.finished("t"), now=200.0)[0] == "knee_ahead"
    # finishing a session with no move in flight changes nothing
    assert done.finished("nobody") is done


def test_move_state_is_bounded() -> None:
    p = PlannerParams(max_tracked_sessions=3, rate_window_s=1.0)
    state = MoveState()
    for i in range(10):
        state = state.started(f"s{i}", "a", "b", float(i), p).finished(f"s{i}")
    assert list(state.moved_at) == ["s7", "s8", "s9"] and state.starts == (9.0,)


def test_home_ledger_projects_the_kv_of_turns_expected_to_overlap() -> None:
    from gateway.core.turn import HomeLedger

    ledger = HomeLedger(live_s=300)
    for sid, engine, ctx in (("a", "w0", 1000), ("b", "w0", 500), ("c", "w1", 700), ("d", "w0", 300)):
        ledger.placed(sid, engine, 0.0)
        ledger.settled(sid, engine, ctx, 1.0)
    ledger.expect("a", 20.0)  # back at 20 s
    ledger.expect("b", 50.0)  # back at 50 s: outside [20, 30]
    ledger.expect("c", 25.0)
    ledger.placed("d", "w0", 18.0)  # d's next turn is in flight since 18 s: counts until 48 s
    assert ledger.expected_at(20.0, 10.0) == {"w0": 1300, "w1": 700}
    assert ledger.expected_at(20.0, 10.0, exclude="a") == {"w0": 300, "w1": 700}
    assert ledger.expected_at(45.0, 10.0) == {"w0": 800}
    assert ledger.expected_at(55.0, 10.0) == {"w0": 500}


@pytest.mark.parametrize(
    ("gap", "margin", "cap", "ttl"),
    [(10.0, 5.0, 600.0, 15.0), (0.0, 5.0, 600.0, 5.0), (598.0, 5.0, 600.0, 600.0), (3.0, 0.0, 2.0, 2.0)],
)
def test_a_pin_lasts_the_expected_gap_plus_the_margin_up_to_the_cap(
    gap: float, margin: float, cap: float, ttl: float
) -> None:
    params = PlannerParams(pin_margin_s=margin, max_pin_s=cap)
    assert params.pin_ttl_s(gap) == ttl
    # every action the planner returns carries that pin
    assert plan_after_turn(turn(gap=gap), [W0, W1], {}, params).pin_ttl_s == ttl


@pytest.mark.parametrize(
    ("hinted", "learned", "gap"),
    [(4.0, 30.0, 4.0), (None, 30.0, 30.0), (None, None, P.default_gap_s), (0.0, None, 0.0)],
)
def test_the_expected_gap_is_the_hint_then_the_sessions_own_then_the_default(
    hinted: float | None, learned: float | None, gap: float
) -> None:
    assert P.gap_s(hinted, learned) == gap
