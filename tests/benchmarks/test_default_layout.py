"""``agentgw serve``'s default layout is what ``agentgw plan`` recommends for 3 engines.

The plan that decided it ran on the 48-play Weka dev trace (~10 min, too long for CI) and is
recorded in ``benchmarks/plans/default_3engines.json`` with every figure of its sweep and of a
small fingerprint sweep run by the same code. Here: the record's figures, ranked by the planner's
rule as it is now, recommend ``gateway.local.layout.DEFAULT``; and the fingerprint sweep re-run now
gives the recorded figures, so the record still describes the routing and simulator of this
checkout (when it fails, re-run the record's command and set ``DEFAULT`` to its recommendation).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from gateway.local.layout import DEFAULT, RECORD
from gateway.sim.metrics import RunMetrics
from gateway.sim.plan import (
    FINGERPRINT_ARGV,
    RECORD_ARGV,
    Layout,
    Point,
    figures,
    layouts,
    parse,
    recommend,
    sweep,
)

RECORD_COMMAND = (
    "python -m gateway.sim.plan " + " ".join(RECORD_ARGV) + f" --record benchmarks/plans/{RECORD.name}"
)


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORD.read_text(encoding="utf-8"))
    return data


def points(results: dict[str, dict[str, dict[str, Any]]], engines: int) -> dict[Layout, list[Point]]:
    by_label = {lo.label: lo for lo in layouts(engines)}
    assert set(results) == set(by_label), "the record sweeps every layout the planner sweeps"
    return {
        by_label[label]: [(int(lanes), RunMetrics(label=label, **m)) for lanes, m in per_lane.items()]
        for label, per_lane in results.items()
    }


def test_the_record_is_the_documented_sweep(record: dict[str, Any]) -> None:
    assert shlex.split(record["command"])[3:] == list(RECORD_ARGV)
    assert shlex.split(record["fingerprint"]["command"])[3:] == list(FINGERPRINT_ARGV)
    assert record["what"].startswith("trace weka (48 plays"), record["what"]
    assert f"{DEFAULT.engines} engines" in record["what"]


def test_the_default_layout_is_the_recorded_recommendation(record: dict[str, Any]) -> None:
    slo = record["slo"]
    best = recommend(points(record["results"], DEFAULT.engines), slo["ttft_p90_ms"], slo["interactivity_p90"])
    assert best.local(DEFAULT.engines) == DEFAULT, (
        f"the recorded plan recommends {best.local(DEFAULT.engines).label}, the default is {DEFAULT.label}: "
        "set gateway.local.layout.DEFAULT to the recommendation (and docker-compose.yml to match)"
    )
    rec = record["recommended"]
    assert (rec["engines"], rec["first_turn"], rec["label"]) == (
        DEFAULT.engines,
        DEFAULT.first_turn,
        DEFAULT.label,
    )


def test_the_fingerprint_sweep_still_gives_the_recorded_figures(record: dict[str, Any]) -> None:
    now = figures(sweep(parse(FINGERPRINT_ARGV)))
    recorded = record["fingerprint"]["results"]
    changed = [
        f"{label} L={lanes} {key}: recorded {m[key]}, now {now[label][lanes][key]}"
        for label, per_lane in recorded.items()
        for lanes, m in per_lane.items()
        for key in m
        if now.get(label, {}).get(lanes, {}).get(key) != pytest.approx(m[key], rel=1e-9)
    ]
    assert set(now) == set(recorded) and not changed, (
        "the routing or the simulator changed since the default layout was measured: re-run "
        f"`{RECORD_COMMAND}` (~10 min) and set gateway.local.layout.DEFAULT to "
        "what it recommends. Changed: " + "; ".join(changed[:8])
    )
