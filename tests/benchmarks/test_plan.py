"""``agentgw plan``: the layouts it sweeps, how it ranks them, the config it writes, and one run
on the vendored Weka traces (3 plays) through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import load_config
from gateway.core.types import PoolRole
from gateway.sim.metrics import RunMetrics
from gateway.sim.plan import Layout, config_text, layouts, recommend


def metrics(ttft_p90: float, inter: float, tpgs: float) -> RunMetrics:
    return RunMetrics("x", 1, 0.0, ttft_p90, ttft_p90, 0.0, 0.0, 0, inter, tpgs, tpgs, 0.0, 0, 0, 0)


ONE, COST, CTL, WALL = Layout(0, "cost"), Layout(1, "cost"), Layout(1, "cost", True), Layout(1, "wall")


def test_layouts_for_a_fleet() -> None:
    assert [lo.label for lo in layouts(3)] == ["one pool", "1+W cost", "1+W cost+ctl", "1+W wall"]
    assert len(layouts(8)) == 1 + 3 * 4
    assert layouts(1) == [ONE]
    assert [lo.policy(True) for lo in layouts(2)] == [
        "agentic+hints",
        "agentic+hints",
        "agentic+hints+ctl",
        "agentic+hints+wall",
    ]


@pytest.mark.parametrize(
    ("points", "best"),
    [
        # more lanes at the SLO wins
        (
            {
                ONE: [(4, metrics(500, 55, 100)), (8, metrics(1500, 45, 150))],
                COST: [(4, metrics(500, 55, 100)), (8, metrics(900, 51, 140))],
            },
            COST,
        ),
        # same capacity: more TPGS there
        ({ONE: [(4, metrics(500, 55, 100))], WALL: [(4, metrics(500, 55, 120))]}, WALL),
        # equal: the simpler layout
        (
            {
                CTL: [(4, metrics(500, 55, 100))],
                COST: [(4, metrics(500, 55, 100))],
                ONE: [(4, metrics(500, 55, 100))],
            },
            ONE,
        ),
        ({CTL: [(4, metrics(500, 55, 100))], COST: [(4, metrics(500, 55, 100))]}, COST),
        # nothing meets the SLO: the lowest p90 TTFT at the largest lane count
        ({ONE: [(4, metrics(3000, 30, 100))], COST: [(4, metrics(2000, 30, 90))]}, COST),
    ],
)
def test_recommend(points: dict[Layout, list[tuple[int, RunMetrics]]], best: Layout) -> None:
    assert recommend(points, 1000.0, 50.0) == best


@pytest.mark.parametrize("layout", [ONE, COST, CTL, WALL, Layout(2, "cost", True)])
def test_written_config_loads_with_the_layout(layout: Layout, tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(config_text(layout, 4, "m", "a header\nsecond line"))
    cfg = load_config(path)
    roles = [PoolRole(p.role) for p in cfg.pools for _ in p.engines]
    if layout.first_turn == 0:
        assert roles == [PoolRole.ANY] * 4
    else:
        f = layout.first_turn
        assert roles == [PoolRole.FIRST_TURN] * f + [PoolRole.WARM] * (4 - f)
        assert cfg.routing.split == layout.split
    assert cfg.routing.role_controller == layout.controller


def test_plan_on_the_vendored_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--engines", "3", "--lanes", "1,3", "--write", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trace weka (3 plays, 81 requests), 3 engines" in text
    rows = [line for line in text.splitlines() if line.startswith(("one pool", "1+W "))]
    assert [r.split("  ")[0] for r in rows] == ["one pool", "1+W cost", "1+W cost+ctl", "1+W wall"]
    rec = next(line for line in text.splitlines() if line.startswith("recommended: "))
    cfg = load_config(out)
    assert sum(len(p.engines) for p in cfg.pools) == 3
    first = sum(len(p.engines) for p in cfg.pools if p.role == "first_turn")
    assert (first == 0) == rec.startswith("recommended: one pool"), rec
    assert out.read_text().splitlines()[1] == "# " + rec.split(" (")[0].replace(
        "recommended: ", "recommended: "
    ).replace(f"{first}+{3 - first}", f"{first}+W")
