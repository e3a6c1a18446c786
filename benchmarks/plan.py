"""``agentgw plan``: recommend a pool layout for a fleet by replaying a trace in the simulator.

    agentgw plan --trace-path tests/data/traces/weka --engines 3 --lanes 1,2,3
    python -m benchmarks.plan --trace weka --engines 8 --lanes 8,12,16,24 --speedup 10 --write plan.yaml

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
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.compare import load_trace, meets_slo, run_one
from benchmarks.sim.calibration import ENGINES
from benchmarks.sim.metrics import RunMetrics, ideal_hits_by_request
from benchmarks.sim.tiers import TiersConfig
from gateway.core.router import RoutingParams

__all__ = ["Layout", "layouts", "main", "recommend"]

VENDORED = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "weka"


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
    names = [f"engine{i}" for i in range(engines)]

    def pool(name: str, role: str, members: list[str]) -> list[str]:
        lines = [f"  - name: {name}", f"    role: {role}", "    engines:"]
        for n in members:
            port = 8100 + names.index(n)
            lines += [
                f"      - name: {n}",
                f"        url: http://127.0.0.1:{port}",
                f"        model: {model}",
            ]
        return lines

    out = [f"# {line}" for line in header.splitlines()]
    out += ["# engine URLs are placeholders: point them at your engines", "routing:", "  profile: agentic"]
    if interactivity_tok_s != RoutingParams().interactivity_tok_s:
        out += [f"  interactivity_tok_s: {interactivity_tok_s:g}"]
    if layout.first_turn == 0:
        out += ["pools:", *pool("default", "any", names)]
    else:
        out += [f"  split: {layout.split}"]
        if layout.controller:
            out += ["  role_controller: true"]
        f = layout.first_turn
        out += ["pools:", *pool("first_turn", "first_turn", names[:f]), *pool("warm", "warm", names[f:])]
    return "\n".join(out) + "\n"


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


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.engines < 1:
        print("agentgw plan: --engines must be >= 1", file=sys.stderr)
        return 2
    path = args.trace_path or (str(VENDORED) if args.trace == "weka" else None)
    plays = load_trace(args.trace, path, args.n)
    ideal = ideal_hits_by_request(plays)
    if args.lanes:
        lanes = sorted({int(x) for x in args.lanes.split(",") if x})
    else:
        n = len(plays)
        lanes = sorted({max(1, round(n * k / 4)) for k in (1, 2, 3, 4)})
    if not lanes or lanes[0] < 1:
        print("agentgw plan: --lanes must be positive integers", file=sys.stderr)
        return 2
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
    print(what)
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
    serve = f"agentgw serve --first-turn {best.first_turn} --warm {w}" if best.first_turn else ""
    print(
        f"recommended: {best.label.replace('W', str(w))} "
        f"(lanes at SLO {cap}, TPGS there {tpgs:.0f}; at L={max(lanes)}: p90 TTFT "
        f"{top.ttft_p90_ms:.0f} ms, P90 {top.interactivity_p90:.1f} tok/s, TPGS {top.tpgs:.0f})"
        + (f"; locally: {serve}" if serve else "")
    )
    if args.write:
        Path(args.write).write_text(
            config_text(
                best, args.engines, args.model, f"agentgw plan: {what}\nrecommended: {best.label}", slo_tok_s
            )
        )
        print(f"wrote {args.write}")
    if args.plot:
        plot(Path(args.plot), results, f"{args.engines} engines, L={max(lanes)}, speed-up {args.speedup:g}")
        print(f"wrote {args.plot}")
    print(f"wall {time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentgw plan", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
