"""The SLO in routing: the decision record's predicted outcome, the predicted misses, arrival
moves judged by the SLO with a budget of deliberate TTFT misses, and the ``slo`` config."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from gateway.config import GatewayConfig
from gateway.core.router import Router, RoutingParams
from gateway.core.routing import MissBudget, RoutingCore
from gateway.core.turn import decision_dict, predicted_misses
from gateway.core.types import (
    Decision,
    EngineView,
    PoolRole,
    PrefixMatch,
    RouteRequest,
    SessionView,
    Snapshot,
)
from gateway.service.metrics import GatewayMetrics


def big(name: str, kv_usage: float) -> EngineView:
    """The default cost model (Dynamo's mocker: knee at u = 0.31) on 16,384 blocks of 64 tokens."""
    return EngineView(
        name, "warm", PoolRole.WARM, frozenset({"m"}), kv_usage=kv_usage, capacity_blocks=16_384
    )


def knee_turn(held_b: int, prompt: int = 100_000) -> tuple[RouteRequest, Snapshot]:
    """A session homed on ``a`` (KV use 0.3: the turn takes it past the knee), ``b`` empty and
    holding ``held_b`` tokens of the prompt."""
    session = SessionView("s", home="a", pool="warm", turns=3, context_tokens=prompt)
    matches = {
        "a": PrefixMatch(prompt // 64, prompt // 64, prompt / 64),
        "b": PrefixMatch(held_b // 64, held_b // 64, held_b / 64),
    }
    r = RouteRequest(model="m", prompt_tokens=prompt, block_size=64, session_id="s")
    return r, Snapshot(engines=(big("a", 0.3), big("b", 0.0)), matches=matches, session=session)


SLO = RoutingParams(profile="agentic", slo_moves=True, knee_output_tokens=30)


@pytest.mark.parametrize(
    ("held_b", "miss_ok", "max_x", "expected", "why"),
    [
        (
            98_000,
            False,
            0.0,
            ("b", "kv_balance"),
            "2K tokens to recompute (~0.07 s): meets the 1 s bound, free",
        ),
        (0, True, 0.0, ("b", "kv_balance_miss"), "100K tokens recomputed (2.07 s): a deliberate miss"),
        (0, False, 0.0, ("a", "sticky"), "the same with the budget spent: stays"),
        (0, True, 2.0, ("a", "sticky"), "2.07 s is past twice the bound: not made"),
        (0, True, 3.0, ("b", "kv_balance_miss"), "within three times the bound"),
    ],
)
def test_an_arrival_move_is_judged_by_the_slo(held_b, miss_ok, max_x, expected, why) -> None:  # type: ignore[no-untyped-def]
    r, snap = knee_turn(held_b)
    d = Router(replace(SLO, slo_miss_max_x=max_x)).route(r, replace(snap, slo_miss_ok=miss_ok))
    assert (d.engine, d.reason) == expected, why


def test_without_slo_moves_the_knee_move_is_priced_as_before() -> None:
    """``knee_output_tokens`` 30: 100K tokens reloaded for 30 tokens of decode saved stays."""
    r, snap = knee_turn(0)
    d = Router(replace(SLO, slo_moves=False)).route(r, snap)
    assert (d.engine, d.reason) == ("a", "sticky")


def test_the_decision_records_its_predicted_outcome() -> None:
    r, snap = knee_turn(98_000)
    d = Router(SLO).route(r, snap)
    # 2K tokens recomputed (one pass, ~50 ms: faster than reloading them at 2.3 GB/s, 0.11 s)
    assert d.predicted_ttft_ms is not None and 40 < d.predicted_ttft_ms < 100
    assert d.predicted_tok_s is not None and d.predicted_tok_s > 50  # b stays under the knee
    rec = decision_dict(d)
    assert rec["predicted_ttft_ms"] == d.predicted_ttft_ms and rec["predicted_tok_s"] == d.predicted_tok_s
    stay = Router(replace(SLO, interactivity_tok_s=0.0)).route(r, snap)  # knee off: stays past it
    assert (stay.engine, stay.reason) == ("a", "sticky")
    assert stay.predicted_tok_s is not None and stay.predicted_tok_s < 50
    assert predicted_misses(stay, 1000.0, 50.0) == ("tok_s",)
    rr = Router(RoutingParams(profile="round_robin")).route(r, snap)
    assert rr.predicted_ttft_ms is None and predicted_misses(rr, 1000.0, 50.0) == ()


@pytest.mark.parametrize(
    ("ttft", "tok_s", "bound_tok_s", "expected"),
    [
        (900.0, 60.0, 50.0, ()),
        (1200.0, 60.0, 50.0, ("ttft",)),
        (1200.0, 40.0, 50.0, ("ttft", "tok_s")),
        (900.0, 40.0, 0.0, ()),  # no decode-speed bound
    ],
)
def test_predicted_misses(ttft: float, tok_s: float, bound_tok_s: float, expected: tuple[str, ...]) -> None:
    d = Decision("a", "warm", "sticky", "agentic", 0, 0, predicted_ttft_ms=ttft, predicted_tok_s=tok_s)
    assert predicted_misses(d, 1000.0, bound_tok_s) == expected


def test_the_miss_budget_counts_a_sliding_window() -> None:
    b = MissBudget(share=0.01, window=200)  # 2 deliberate misses per 200 turns
    assert b.ok()
    b.record(True)
    b.record(True)
    assert not b.ok() and b.misses == 2
    for _ in range(198):
        b.record(False)
    assert not b.ok()  # both misses are still in the window of 200
    b.record(False)
    assert b.ok() and b.misses == 1  # the first one left it
    b.record(False)
    assert b.misses == 0
    assert not MissBudget(share=0.0).ok()


def test_the_miss_budget_waits_while_the_speed_bound_is_out_of_reach() -> None:
    """More than ``reach`` of the last finished turns decoded under the tok/s bound: its p90 is
    lost whatever moves, so no TTFT miss is spent on it."""
    b = MissBudget(share=0.5, window=10, reach=0.2)
    for slow in (True, True, False, False, False, False, False, False, False, False):
        b.observe(slow)
    assert b.ok()  # 2 of 10 decoded slow: within reach
    b.observe(True)  # a slow one leaves, a slow one comes: still 2 of 10
    b.observe(True)
    assert b.ok()
    b.observe(True)  # a fast one leaves
    assert not b.ok()  # 3 of 10
    core = RoutingCore(Router(replace(SLO, slo_miss_budget=0.5, slo_miss_reach=0.0)), 1000)
    assert core.budget.ok()
    core.observe(60.0)  # at 50 tok/s or more: not slow
    assert core.budget.ok()
    core.observe(40.0)
    assert not core.budget.ok()


def test_slo_config_and_the_deprecated_key() -> None:
    c = GatewayConfig()
    assert (c.router_params().interactivity_tok_s, c.router_params().slo_ttft_ms) == (50.0, 1000.0)
    c = GatewayConfig.model_validate({"slo": {"ttft_ms": 2000, "tok_s": 40}})
    assert (c.router_params().interactivity_tok_s, c.router_params().slo_ttft_ms) == (40.0, 2000.0)
    with pytest.warns(DeprecationWarning, match="routing.interactivity_tok_s is deprecated"):
        old = GatewayConfig.model_validate({"routing": {"interactivity_tok_s": 30}})
    assert old.router_params().interactivity_tok_s == 30.0  # existing YAML keeps its meaning
    with pytest.warns(DeprecationWarning, match="slo.tok_s is set and wins"):
        both = GatewayConfig.model_validate({"routing": {"interactivity_tok_s": 30}, "slo": {"tok_s": 45}})
    assert both.router_params().interactivity_tok_s == 45.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GatewayConfig.model_validate({"slo": {"tok_s": 0}})  # the new key warns of nothing


def test_predicted_misses_are_counted_by_reason_and_bound() -> None:
    m = GatewayMetrics()
    m.count_decision("agentic", "warm", "sticky", ("tok_s",))
    m.count_decision("agentic", "warm", "kv_balance_miss", ("ttft",))
    m.count_decision("agentic", "warm", "sticky")
    got = {
        tuple(s.labels[k] for k in ("reason", "bound")): s.value
        for metric in m.predicted_misses.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert got == {("sticky", "tok_s"): 1.0, ("kv_balance_miss", "ttft"): 1.0}
