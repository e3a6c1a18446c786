"""Where decoding time goes: decode steps vs prefill chunks sharing their passes, and the KV
fraction held by decoding sequences (what sets the mocker's decode step).

    python -m benchmarks.sim.breakdown --policy precise_prefix --lanes 24 --speedup 10
    python -m benchmarks.sim.breakdown --policy agentic --hints --home-load 5

Runs one simulation (Weka dev traces by default, tiers on) and prints, over every pass that had
decoding sequences: decode steps, how many of those passes also carried prefill chunks and the
prefill milliseconds they added, and the p50 / p90 / p99 of ``u`` (blocks held by decoding
sequences / device blocks) per pass; then P90 and median interactivity and the requests per
engine. Diagnostic only: it wraps the engine model's ``start_pass`` to count, nothing else.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from benchmarks.sim.cluster import SimConfig, simulate
from benchmarks.sim.engine import Engine
from benchmarks.sim.metrics import percentile
from benchmarks.sim.tiers import TiersConfig
from benchmarks.sim.traces import load_weka, synth_agentx
from gateway.core.router import RoutingParams


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", choices=("weka", "synth"), default="weka")
    ap.add_argument("--trace-path", default="/work/shared/traces/weka")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--policy", default="precise_prefix")
    ap.add_argument("--hints", action="store_true")
    ap.add_argument("--home-load", type=float, default=0.0, help="home_load scorer weight")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--lanes", type=int, default=24)
    ap.add_argument("--speedup", type=float, default=10.0)
    args = ap.parse_args(argv)

    stats: Counter[str] = Counter()
    us: list[float] = []
    start = Engine.start_pass

    def counted(self: Engine, now: float) -> float | None:
        end = start(self, now)
        if end is not None and self._decode:
            n = self.pass_steps
            stats["steps"] += n
            stats["decode_ms"] += self.step_ms * n
            if self._prefill:
                stats["with_prefill"] += 1
                stats["prefill_ms"] += (end - now) * 1000.0 - self.step_ms * n
            us.append(sum(s.pinned + s.own for s in self._decode) / self.cfg.num_blocks)
        return end

    Engine.start_pass = counted  # type: ignore[method-assign]
    try:
        plays = load_weka(args.trace_path) if args.trace == "weka" else synth_agentx(args.n, seed=0)
        routing = RoutingParams(profile=args.policy)
        if args.home_load:
            routing = replace(routing, weights={**routing.weights, "home_load": args.home_load})
        cfg = SimConfig(
            workers=args.workers,
            lanes=args.lanes,
            speedup=args.speedup,
            profile=args.policy,
            hints=args.hints,
            routing=routing,
            tiers=TiersConfig(),
        )
        sim = simulate(plays, cfg)
    finally:
        Engine.start_pass = start  # type: ignore[method-assign]
    inter = [
        (r.output_tokens - 1) / (r.t_last - r.t_first)
        for r in sim.records
        if r.output_tokens > 1 and r.t_last > r.t_first
    ]
    share = stats["prefill_ms"] / max(1.0, stats["decode_ms"] + stats["prefill_ms"])
    print(
        f"{args.policy}{' +hints' if args.hints else ''} home_load={args.home_load:g}: "
        f"{args.workers} workers, {args.lanes} lanes, speed-up {args.speedup:g}"
    )
    print(
        f"decode steps {stats['steps']:,}; passes with prefill chunks {stats['with_prefill']:,}; "
        f"decode {stats['decode_ms'] / 1e3:,.0f} s, prefill in those passes "
        f"{stats['prefill_ms'] / 1e3:,.0f} s ({share:.2%} of decoding time)"
    )
    print(
        f"u (decoding KV / device KV) per pass: p50 {percentile(us, 50):.3f} p90 "
        f"{percentile(us, 90):.3f} p99 {percentile(us, 99):.3f}"
    )
    print(f"interactivity: P90 {percentile(inter, 10):.1f} tok/s, median {percentile(inter, 50):.1f}")
    print("requests per engine:", dict(sorted(Counter(r.engine for r in sim.records).items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
