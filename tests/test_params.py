"""One source for every parameter: the config's routing and migration sections are the core's
parameters, with the core's defaults (a default changed in the core changes the config's)."""

from __future__ import annotations

import dataclasses

from gateway.config import MigrationConfig, RoutingConfig
from gateway.core.planner import PlannerParams
from gateway.core.router import DEFAULT_WEIGHTS, Router, RoutingParams


def test_the_routing_section_is_the_routers_params_with_its_defaults() -> None:
    names = {f.name for f in dataclasses.fields(RoutingParams)}
    assert names <= set(RoutingConfig.model_fields), names - set(RoutingConfig.model_fields)
    assert RoutingConfig().params() == RoutingParams()


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
