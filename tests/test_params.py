"""One source for every parameter: the config's routing and migration sections are the core's
parameters, with the core's defaults (a default changed in the core changes the config's)."""

from __future__ import annotations

import dataclasses

from gateway.config import GatewayConfig, MigrationConfig, RoutingConfig, load_config
from gateway.core.planner import PlannerParams
from gateway.core.router import (
    DEFAULT_WEIGHTS,
    PLANNED_KNEE_OUTPUT_TOKENS,
    PLANNED_OVERFLOW_WAIT_TOKENS,
    Router,
    RoutingParams,
    with_planner,
)

#: Router parameters the routing section does not set: the TTFT bound comes from the ``slo``
#: section (``slo.ttft_ms``, as the decode-speed bound from ``slo.tok_s``); the SLO-judged
#: arrival moves are off and reached only from the simulator (``+slo`` policies) while they do
#: not win every workload.
NOT_IN_ROUTING = {
    "slo_ttft_ms",
    "slo_moves",
    "slo_miss_budget",
    "slo_miss_window",
    "slo_miss_max_x",
    "slo_miss_reach",
}


def test_the_routing_section_is_the_routers_params_with_its_defaults() -> None:
    names = {f.name for f in dataclasses.fields(RoutingParams)} - NOT_IN_ROUTING
    assert names <= set(RoutingConfig.model_fields), names - set(RoutingConfig.model_fields)
    assert RoutingConfig().params() == RoutingParams()
    slo = GatewayConfig().slo
    assert (slo.ttft_ms, slo.tok_s) == (RoutingParams().slo_ttft_ms, RoutingParams().interactivity_tok_s)


#: Planner parameters the config does not set: the decode knee comes from the routing section's
#: interactivity target (gateway/service/placement.py), the move-state bounds are internal.
NOT_CONFIGURED = {"knee_kv_share", "rate_window_s", "max_tracked_sessions"}


def test_the_migration_section_is_the_planners_params_with_its_defaults() -> None:
    names = {f.name for f in dataclasses.fields(PlannerParams)} - NOT_CONFIGURED
    assert names <= set(MigrationConfig.model_fields), names - set(MigrationConfig.model_fields)
    assert MigrationConfig().params() == PlannerParams()


def test_a_weight_left_out_takes_its_one_default() -> None:
    full = Router(RoutingParams(weights=dict(DEFAULT_WEIGHTS))).profile
    partial = Router(RoutingParams(weights={"queue": 1.0})).profile
    assert [w.weight for w in full.scorers] == [w.weight for w in partial.scorers]
    assert RoutingConfig(weights={"kv_usage": 0.0}).params().weights == {"kv_usage": 0.0}


def _config(control_url: str | None, **sections: object) -> GatewayConfig:
    engine = {"name": "a", "url": "http://a:1", "model": "m", "control_url": control_url}
    return load_config(None, pools=[{"name": "p", "engines": [engine]}], **sections)


def test_the_router_prices_arrival_moves_where_the_planner_moves_sessions_ahead() -> None:
    planned = (PLANNED_KNEE_OUTPUT_TOKENS, PLANNED_OVERFLOW_WAIT_TOKENS)
    priced = _config("http://a:2").router_params()
    assert (priced.knee_output_tokens, priced.overflow_wait_tokens) == planned
    assert priced == with_planner(RoutingConfig().params())
    # no engine the planner can move sessions on, or the planner off: the routing section as set
    assert _config(None).router_params() == RoutingConfig().params()
    off = _config("http://a:2", migration={"enabled": False}).router_params()
    assert off == RoutingConfig().params()
    # a value the configuration sets is kept, 0 included
    own = _config("http://a:2", routing={"knee_output_tokens": 0, "overflow_wait_tokens": 50})
    assert (own.router_params().knee_output_tokens, own.router_params().overflow_wait_tokens) == (0, 50)
    half = _config("http://a:2", routing={"knee_output_tokens": 7}).router_params()
    assert (half.knee_output_tokens, half.overflow_wait_tokens) == (7, PLANNED_OVERFLOW_WAIT_TOKENS)
