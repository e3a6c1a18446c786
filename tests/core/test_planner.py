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
