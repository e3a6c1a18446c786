"""Table-driven tests of the role controller: demand, hysteresis, dwell, decode-load guard."""

from __future__ import annotations

import pytest

from gateway.core.roles import EngineLoad, RoleController, RoleParams
from gateway.core.types import PoolRole

FT, W = PoolRole.FIRST_TURN, PoolRole.WARM
#: demand = total backlog / 1,000 tokens, no smoothing, 10 s dwell
P = RoleParams(backlog_tokens_per_engine=1000, hysteresis=0.25, alpha=1.0, min_dwell_s=10.0)


def loads(
    backlog: dict[str, int], decoding: dict[str, int] | None = None, kv: float = 0.1
) -> list[EngineLoad]:
    decoding = decoding or {}
    return [EngineLoad(n, b, decoding.get(n, 0), kv) for n, b in backlog.items()]


ALL_WARM = {"a": W, "b": W, "c": W, "d": W}
ONE_FT = {"a": FT, "b": W, "c": W, "d": W}


@pytest.mark.parametrize(
    ("roles", "steps", "expected", "why"),
    [
        # (now, backlog per engine, decoding per engine) -> changes (engine, role) of that step
        (ALL_WARM, [(100, {"a": 0, "b": 0, "c": 0, "d": 700}, {})], [[]], "0.7 < 0.75: stay at 0"),
        (
            ALL_WARM,
            [(100, {"a": 0, "b": 0, "c": 0, "d": 800}, {"a": 3, "b": 1, "c": 2, "d": 4})],
            [[("b", FT)]],
            "0.8 >= 0.75: the warm engine with the fewest decoders becomes first-turn",
        ),
        (ONE_FT, [(100, {"a": 1700, "b": 0, "c": 0, "d": 0}, {})], [[]], "1.7 < 1.75: stay at 1"),
        (ONE_FT, [(100, {"a": 300, "b": 0, "c": 0, "d": 0}, {})], [[]], "0.3 > 0.25: stay at 1"),
        (
            ONE_FT,
            [(100, {"a": 200, "b": 0, "c": 0, "d": 0}, {})],
            [[("a", W)]],
            "0.2 <= 0.25: back to warm",
        ),
        (
            ALL_WARM,
            [
                (100, {"a": 0, "b": 0, "c": 0, "d": 5000}, {"d": 1}),
                (101, {"a": 0, "b": 0, "c": 0, "d": 5000}, {"d": 1}),
                (101, {"a": 0, "b": 0, "c": 0, "d": 5000}, {"d": 1}),
                (102, {"a": 0, "b": 0, "c": 0, "d": 5000}, {"d": 1}),
            ],
            [[("a", FT)], [("b", FT)], [("c", FT)], []],
            "one change per step, and at least one engine stays warm",
        ),
        (
            ALL_WARM,
            [
                (100, {"a": 0, "b": 0, "c": 0, "d": 900}, {}),
                (105, {"a": 0, "b": 0, "c": 0, "d": 0}, {}),
                (110, {"a": 0, "b": 0, "c": 0, "d": 0}, {}),
            ],
            [[("a", FT)], [], [("a", W)]],
            "minimum dwell: the new first-turn engine stays 10 s",
        ),
    ],
)
def test_role_controller(roles, steps, expected, why) -> None:  # type: ignore[no-untyped-def]
    ctl = RoleController(P, roles, now=0.0)
    got = []
    for now, backlog, decoding in steps:
        got.append([(c.engine, c.role) for c in ctl.step(float(now), loads(backlog, decoding))])
    assert got == expected, why


@pytest.mark.parametrize(
    ("kv", "expected"),
    [(0.5, [("a", FT)]), (0.7, []), (0.9, [])],
)
def test_no_warm_engine_converts_when_the_rest_could_not_hold_the_decoders(
    kv: float, expected: list[tuple[str, PoolRole]]
) -> None:
    # 4 warm engines at kv: the 3 left would average 4/3 x kv; the guard is 0.8
    ctl = RoleController(P, ALL_WARM, now=0.0)
    changes = ctl.step(100.0, loads({"a": 0, "b": 0, "c": 0, "d": 5000}, kv=kv))
    assert [(c.engine, c.role) for c in changes] == expected


def test_smoothing_delays_the_reaction() -> None:
    ctl = RoleController(
        RoleParams(backlog_tokens_per_engine=1000, alpha=0.5, min_dwell_s=0.0), ALL_WARM, 0.0
    )
    burst = loads({"a": 0, "b": 0, "c": 0, "d": 1000})
    assert ctl.step(1.0, burst) == ()  # demand 0.5
    assert [c.engine for c in ctl.step(2.0, burst)] == ["a"]  # 0.75
    assert ctl.first_turn == 1 and ctl.demand == pytest.approx(0.75)


def test_bounds_and_unknown_engines() -> None:
    ctl = RoleController(
        RoleParams(backlog_tokens_per_engine=1000, min_first_turn=1, max_first_turn=1, min_dwell_s=0.0),
        {"a": PoolRole.ANY, "b": W},
        0.0,
    )
    assert ctl.roles == {"a": W, "b": W}  # ANY is laid out as warm
    assert [c.engine for c in ctl.step(1.0, loads({"a": 0, "b": 0}))] == ["a"]  # min 1
    assert ctl.step(2.0, loads({"a": 0, "b": 9000})) == ()  # max 1
    assert ctl.step(3.0, [EngineLoad("zz", 10**6)]) == ()  # unknown engines are ignored
    with pytest.raises(ValueError, match="backlog_tokens_per_engine"):
        RoleController(RoleParams(backlog_tokens_per_engine=0), {}, 0.0)
