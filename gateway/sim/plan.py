"""``agentgw plan``: recommend a pool layout for a fleet by replaying a trace in the simulator.

    agentgw plan --trace-path tests/data/traces/weka --engines 3 --lanes 1,2,3
    python -m gateway.sim.plan --trace weka --engines 8 --lanes 8,12,16,24 --speedup 10 --write plan.yaml

For a fleet of ``--engines`` engines it runs, on the same trace, engine model and KV tiers, every
layout of the ``agentic`` profile (with the agent hints unless ``--no-hints``):

- ``one pool``: every engine serves every turn (role ``any``);
- ``F+W cost``: ``F`` first-turn and ``W`` warm engines, the work-conserving cost split;
- ``F+W cost+ctl``: the same, with the role controller re-assigning roles from the load;
- ``F+W wall``: the fixed first-turn threshold (the split as first built);

for ``F`` from 1 to ``--max-first-turn`` (default ``engines // 2``), each at every lane count of
``--lanes`` (Dynamo's agentic lanes: that many plays at a time) and ``--speedup``. The router
sees what the live gateway sees (``load_view="gateway"``). A point meets the SLO when p90 TTFT <=
``--slo-ttft-ms`` and P90 interactivity >= ``--slo-tok-s``; a layout's capacity is its largest
lane count that meets it. The recommendation is the layout with the most capacity, then the
highest TPGS there, then the lowest p90 TTFT at the largest lane count (when no layout meets the
SLO anywhere: the lowest p90 TTFT at the largest lane count); ties go to the simpler layout (one
pool, then fewer first-turn engines, then without the controller).

Prints one table (cells: TPGS / P90 tok/s / p90 TTFT ms, ``*`` = meets the SLO) and the
recommendation; ``--write`` saves it as a gateway config (``routing`` and a ``pools`` layout
whose engine URLs are placeholders to edit); ``--plot`` saves TPGS and p90 TTFT against the
layout at the largest lane count.

``agentgw serve``'s default layout (``gateway.local.layout.DEFAULT``) is this recommendation for 3
engines on the Weka dev trace, recorded with ``--record`` (:data:`RECORD_ARGV`)::

    python -m gateway.sim.plan --trace-path ../shared/traces/weka --engines 3 --lanes 2,4,6,8 \
        --record benchmarks/plans/default_3engines.json

The record holds every point of that sweep, its recommendation, and a small sweep on the
synthetic plays (:data:`FINGERPRINT_ARGV`, ~20 s) run by the same code;
tests/benchmarks/test_default_layout.py re-runs the fingerprint and fails when any figure
differs (routing or simulator changed: re-record) or when the record recommends another layout
than ``DEFAULT``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.core.router import RoutingParams
from gateway.local.layout import DEFAULT, LocalLayout
from gateway.sim.calibration import ENGINES
from gateway.sim.metrics import RunMetrics, ideal_hits_by_request
from gateway.sim.runs import load_trace, meets_slo, run_one
from gateway.sim.tiers import TiersConfig

__all__ = ["FINGERPRINT_ARGV", "RECORD_ARGV", "Layout", "layouts", "main", "recommend", "sweep"]

VENDORED = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces" / "weka"
RECORD_ARGV = ("--trace-path", "../shared/traces/weka", "--engines", "3", "--lanes", "2,4,6,8")
"""The sweep ``gateway.local.layout.DEFAULT`` was measured with (the 48-play Weka dev trace, ~10 min)."""
FINGERPRINT_ARGV = ("--trace", "synth", "--n", "6", "--engines", "3", "--lanes", "6", "--speedup", "1")
"""A small sweep recorded with it: when its figures change, the routing or the simulator did."""


@dataclass(frozen=True, slots=True)
class Layout:
    first_turn: int
    split: str
    """``cost`` or ``wall`` (unused for one pool)."""
    controller: bool = False

    @property
    def label(self) -> str:
        if self.first_turn == 0:
            return "one pool"
        return f"{self.first_turn}+W {self.split}" + ("+ctl" if self.controller else "")

    def policy(self, hints: bool) -> str:
        flags = ["agentic"] + (["hints"] if hints else [])
        if self.first_turn and self.split == "wall":
            flags.append("wall")
        if self.controller:
            flags.append("ctl")
        return "+".join(flags)

    def complexity(self) -> tuple[int, int, int]:
        return (self.first_turn > 0, self.first_turn, self.controller)

    def local(self, engines: int) -> LocalLayout:
        """The layout as ``agentgw serve`` / the gateway config holds it."""
        if not self.first_turn:
            return LocalLayout(engines, 0)
        return LocalLayout(
            engines, self.first_turn, "wall" if self.split == "wall" else "cost", self.controller
        )


def layouts(engines: int, max_first_turn: int | None = None) -> list[Layout]:
    top = max(0, min(engines - 1, max_first_turn if max_first_turn is not None else engines // 2))
    out = [Layout(0, "cost")]
    for f in range(1, top + 1):
        out += [Layout(f, "cost"), Layout(f, "cost", True), Layout(f, "wall")]
    return out


Point = tuple[int, RunMetrics]


def capacity(points: list[Point], slo_ttft_ms: float, slo_tok_s: float) -> tuple[int, float]:
    """The largest lane count meeting the SLO and the TPGS there (0, 0 if none)."""
    ok = [
        (lanes, m)
        for lanes, m in points
        if meets_slo(m.ttft_p90_ms, m.interactivity_p90, slo_ttft_ms, slo_tok_s)
    ]
    if not ok:
        return 0, 0.0
    lanes, m = max(ok, key=lambda p: p[0])
    return lanes, m.tpgs


def recommend(results: dict[Layout, list[Point]], slo_ttft_ms: float, slo_tok_s: float) -> Layout:
    def key(item: tuple[Layout, list[Point]]) -> tuple[Any, ...]:
        layout, points = item
        lanes, tpgs = capacity(points, slo_ttft_ms, slo_tok_s)
        last = max(points, key=lambda p: p[0])[1]
        # best first: more capacity, more TPGS there, lower p90 TTFT at the top, simpler
        return (-lanes, -round(tpgs), round(last.ttft_p90_ms), layout.complexity())

    return min(results.items(), key=key)[0]


def config_text(
    layout: Layout, engines: int, model: str, header: str, interactivity_tok_s: float = 50.0
) -> str:
    """A gateway config (YAML) with the recommended routing and pools; URLs are placeholders.
    ``interactivity_tok_s``: the SLO the run used, which the picker's decode knee protects."""
    import yaml

    local = layout.local(engines)
    members = [
        {"name": n, "url": f"http://127.0.0.1:{8100 + i}", "model": model} for i, n in enumerate(local.names)
    ]
    routing: dict[str, object] = {"profile": "agentic", **local.routing()}
    if interactivity_tok_s != RoutingParams().interactivity_tok_s:
        routing["interactivity_tok_s"] = interactivity_tok_s
    data = {"routing": routing, "pools": local.pools(members)}
    out = [f"# {line}" for line in header.splitlines()]
    out += ["# engine URLs are placeholders: point them at your engines"]
    return "\n".join(out) + "\n" + yaml.safe_dump(data, sort_keys=False)


def plot(path: Path, results: dict[Layout, list[Point]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [lo.label for lo in results]
    last = [max(pts, key=lambda p: p[0])[1] for pts in results.values()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.bar(labels, [m.tpgs for m in last])
    a.set_ylabel("TPGS")
    b.bar(labels, [m.ttft_p90_ms for m in last], color="tab:orange")
    b.set_ylabel("p90 TTFT (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", choices=("weka", "mooncake", "synth"), default="weka")
    ap.add_argument("--trace-path", default=None, help="default: the vendored tests/data/traces/weka")
    ap.add_argument("--n", type=int, default=0, help="synth: plays; mooncake: first N requests")
    ap.add_argument("--engines", type=int, default=3, help="fleet size (default 3, as `agentgw serve`)")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="dynamo-mocker", help="engine model")
    ap.add_argument("--lanes", default="", help="lane counts to sweep (default: 1 .. plays, 4 points)")
    ap.add_argument("--speedup", type=float, default=10.0, help="divides every recorded gap")
    ap.add_argument("--max-first-turn", type=int, default=None, help="default engines // 2")
    ap.add_argument("--no-hints", action="store_true", help="route without the agent hints")
    ap.add_argument("--tiers", choices=("on", "off"), default="on", help="host tier + shared store")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tok-s", type=float, default=None, help="default 50 (40 for the AIC H200)")
    ap.add_argument("--model", default="tiny-llama", help="the model name written in the config")
    ap.add_argument("--write", default=None, help="write the recommendation as a gateway config (YAML)")
    ap.add_argument("--plot", default=None, help="write a PNG of TPGS and p90 TTFT per layout")
    ap.add_argument(
        "--record",
        default=None,
        help="write the sweep, its recommendation and the fingerprint sweep as JSON "
        "(benchmarks/plans/default_3engines.json: agentgw serve's default layout)",
    )


@dataclass(frozen=True, slots=True)
class Sweep:
    what: str
    lanes: list[int]
    slo_ttft_ms: float
    slo_tok_s: float
    results: dict[Layout, list[Point]]


def sweep(args: argparse.Namespace) -> Sweep:
    """Run every layout at every lane count (raises ValueError on bad arguments)."""
    if args.engines < 1:
        raise ValueError("--engines must be >= 1")
    path = args.trace_path or (str(VENDORED) if args.trace == "weka" else None)
    plays = load_trace(args.trace, path, args.n)
    ideal = ideal_hits_by_request(plays)
    if args.lanes:
        lanes = sorted({int(x) for x in args.lanes.split(",") if x})
    else:
        n = len(plays)
        lanes = sorted({max(1, round(n * k / 4)) for k in (1, 2, 3, 4)})
    if not lanes or lanes[0] < 1:
        raise ValueError("--lanes must be positive integers")
    slo_tok_s = args.slo_tok_s or (40.0 if args.engine == "h200-qwen3-32b-fp8-aic" else 50.0)
    tiers = TiersConfig() if args.tiers == "on" else None
    hints = not args.no_hints
    results: dict[Layout, list[Point]] = {}
    for layout in layouts(args.engines, args.max_first_turn):
        for n_lanes in lanes:
            m, _ = run_one(
                plays,
                ideal,
                layout.policy(hints),
                args.engines,
                n_lanes,
                args.speedup,
                args.engine,
                first_turn_workers=layout.first_turn,
                tiers=tiers,
                routing_overrides={"interactivity_tok_s": slo_tok_s},
            )
            results.setdefault(layout, []).append((n_lanes, m))
    what = (
        f"trace {args.trace} ({len(plays)} plays, {sum(len(p.requests) for p in plays)} requests), "
        f"{args.engines} engines, engine model {args.engine}, speed-up {args.speedup:g}, "
        f"hints {'on' if hints else 'off'}, tiers {args.tiers}; SLO p90 TTFT <= {args.slo_ttft_ms:.0f} ms "
        f"and P90 interactivity >= {slo_tok_s:g} tok/s"
    )
    return Sweep(what, lanes, args.slo_ttft_ms, slo_tok_s, results)


def parse(argv: list[str] | tuple[str, ...]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="agentgw plan", description=(__doc__ or "").splitlines()[0])
    add_arguments(ap)
    return ap.parse_args(list(argv))


def figures(s: Sweep) -> dict[str, dict[str, dict[str, Any]]]:
    """Every point's metrics (less the wall time), by layout label and lane count: the record's form."""
    return {
        layout.label: {
            str(lanes): {k: v for k, v in m.as_dict().items() if k not in ("label", "wall_s")}
            for lanes, m in points
        }
        for layout, points in s.results.items()
    }


def record(s: Sweep, argv: list[str], best: Layout, engines: int) -> dict[str, Any]:
    fingerprint = sweep(parse(FINGERPRINT_ARGV))
    local = best.local(engines)
    return {
        "about": "agentgw serve's default layout (gateway/local/layout.py DEFAULT) is `recommended`; "
        "tests/benchmarks/test_default_layout.py checks it and re-runs `fingerprint`",
        "command": "python -m gateway.sim.plan " + " ".join(argv),
        "what": s.what,
        "slo": {"ttft_p90_ms": s.slo_ttft_ms, "interactivity_p90": s.slo_tok_s},
        "results": figures(s),
        "recommended": {
            "label": local.label,
            "engines": local.engines,
            "first_turn": local.first_turn,
            "split": local.split,
            "role_controller": local.role_controller,
        },
        "fingerprint": {
            "command": "python -m gateway.sim.plan " + " ".join(FINGERPRINT_ARGV),
            "what": fingerprint.what,
            "results": figures(fingerprint),
        },
    }


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    try:
        s = sweep(args)
    except ValueError as exc:
        print(f"agentgw plan: {exc}", file=sys.stderr)
        return 2
    results, lanes, slo_tok_s = s.results, s.lanes, s.slo_tok_s
    print(s.what)
    head = f"{'layout':<16} " + " ".join(f"{'L=' + str(x):>18}" for x in lanes) + f" {'lanes at SLO':>12}"
    print(head)
    print("-" * len(head))
    for layout, points in results.items():
        cells = " ".join(
            f"{m.tpgs:>6.0f} {m.interactivity_p90:>4.0f} {m.ttft_p90_ms:>5.0f}"
            f"{'*' if meets_slo(m.ttft_p90_ms, m.interactivity_p90, args.slo_ttft_ms, slo_tok_s) else ' '}"
            for _, m in sorted(points, key=lambda p: p[0])
        )
        cap, _ = capacity(points, args.slo_ttft_ms, slo_tok_s)
        print(f"{layout.label:<16} {cells} {cap:>12d}")
    print("cells: TPGS, P90 interactivity tok/s, p90 TTFT ms; * = meets the SLO")
    best = recommend(results, args.slo_ttft_ms, slo_tok_s)
    cap, tpgs = capacity(results[best], args.slo_ttft_ms, slo_tok_s)
    top = max(results[best], key=lambda p: p[0])[1]
    w = args.engines - best.first_turn
    local = best.local(args.engines)
    serve = local.serve_command() + (" (agentgw serve's default)" if local == DEFAULT else "")
    print(
        f"recommended: {best.label.replace('W', str(w))} "
        f"(lanes at SLO {cap}, TPGS there {tpgs:.0f}; at L={max(lanes)}: p90 TTFT "
        f"{top.ttft_p90_ms:.0f} ms, P90 {top.interactivity_p90:.1f} tok/s, TPGS {top.tpgs:.0f})"
        f"; locally: {serve}"
    )
    if args.write:
        Path(args.write).write_text(
            config_text(
                best,
                args.engines,
                args.model,
                f"agentgw plan: {s.what}\nrecommended: {best.label}",
                s.slo_tok_s,
            )
        )
        print(f"wrote {args.write}")
    if args.plot:
        plot(Path(args.plot), results, f"{args.engines} engines, L={max(lanes)}, speed-up {args.speedup:g}")
        print(f"wrote {args.plot}")
    if args.record:
        given = list(argv if argv is not None else sys.argv[2:])  # `agentgw plan ARGS`
        outputs = {"--record", "--write", "--plot"}  # not part of the sweep
        kept = [a for i, a in enumerate(given) if not {a.split("=")[0], given[i - 1] if i else ""} & outputs]
        Path(args.record).write_text(json.dumps(record(s, kept, best, args.engines), indent=1) + "\n")
        print(f"wrote {args.record}")
    print(f"wall {time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(parse(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
