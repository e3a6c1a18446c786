"""Where decoding time goes: decode steps vs prefill chunks sharing their passes, and the KV
fraction held by decoding sequences (what sets the mocker's decode step).

    python -m benchmarks.breakdown --policy precise_prefix --lanes 24 --speedup 10
    python -m benchmarks.breakdown --policy agentic --hints --home-load 5
    python -m benchmarks.breakdown --policy agentic --hints --lanes 32 --knee-tok-s 0

Runs one simulation (Weka dev traces by default, tiers on) and prints, over every pass that had
decoding sequences: decode steps, how many of those passes also carried prefill chunks and the
prefill milliseconds they added, and the p50 / p90 / p99 of ``u`` (blocks held by decoding
sequences / device blocks) per pass; then P90 and median interactivity and the requests per
engine; then the requests under the interactivity SLO (``--slo-tok-s``, 50) by cause: a prompt
whose own KV passes the decode knee (slow on any engine), a decode-time-weighted ``u`` past the
knee (crowded by the sequences decoding beside it), more than 10% of its decode time in passes
that carried prefill chunks, or none of these; and the routing reasons. ``--knee-tok-s 0`` routes
with the decode knee off (``RoutingParams.interactivity_tok_s``). The router sees the gateway's
load view, as ``benchmarks.compare`` shows it by default. Diagnostic only: it wraps the engine
model's ``start_pass`` and ``finish_pass`` to count, nothing else.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from benchmarks._common import default_weka_traces
from gateway.core.policies.cost import EngineCost
from gateway.core.router import RoutingParams
from gateway.sim.cluster import SimConfig, simulate
from gateway.sim.engine import Engine, Seq
from gateway.sim.metrics import percentile
from gateway.sim.tiers import TiersConfig
from gateway.sim.traces import load_weka, synth_agentx


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", choices=("weka", "synth"), default="weka")
    ap.add_argument("--trace-path", default=None, help="the Weka folder (default: shared/traces/weka)")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--policy", default="precise_prefix")
    ap.add_argument("--hints", action="store_true")
    ap.add_argument("--home-load", type=float, default=0.0, help="home_load scorer weight")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--lanes", type=int, default=24)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--slo-tok-s", type=float, default=50.0)
    ap.add_argument(
        "--knee-tok-s", type=float, default=None, help="decode knee rate (default: the SLO; 0 = off)"
    )
    args = ap.parse_args(argv)

    # ints (steps, passes) and float sums (ms); every key starts at 0, as in a Counter
    stats: dict[str, float] = {"steps": 0, "decode_ms": 0, "with_prefill": 0, "prefill_ms": 0}
    us: list[float] = []
    # per sequence: [sum u*dt, sum dt, dt in passes with prefill chunks, own KV share]
    per_seq: dict[int, list[float]] = {}
    rates: dict[int, float] = {}
    start, finish = Engine.start_pass, Engine.finish_pass

    def counted(self: Engine, now: float) -> float | None:
        end = start(self, now)
        if end is not None and self._decode:
            n = self.pass_steps
            stats["steps"] += n
            stats["decode_ms"] += self.step_ms * n
            if self._prefill:
                stats["with_prefill"] += 1
                stats["prefill_ms"] += (end - now) * 1000.0 - self.step_ms * n
            u = sum(s.pinned + s.own for s in self._decode) / self.cfg.num_blocks
            us.append(u)
            dt = end - now
            for s in self._decode:
                acc = per_seq.setdefault(s.rid, [0.0, 0.0, 0.0, 0.0])
                acc[0] += u * dt
                acc[1] += dt
                acc[2] += dt if self._prefill else 0.0
                acc[3] = (s.pinned + s.own) / self.cfg.num_blocks
        return end

    def finished(self: Engine, now: float) -> list[Seq]:
        done = finish(self, now)
        for s in done:
            if s.rid > 0 and s.max_out > 1 and s.t_last > s.t_first:
                rates[s.rid] = (s.max_out - 1) / (s.t_last - s.t_first)
        return done

    Engine.start_pass = counted  # type: ignore[method-assign]
    Engine.finish_pass = finished  # type: ignore[method-assign]
    try:
        plays = (
            load_weka(args.trace_path or default_weka_traces())
            if args.trace == "weka"
            else synth_agentx(args.n, seed=0)
        )
        knee = args.slo_tok_s if args.knee_tok_s is None else args.knee_tok_s
        routing = RoutingParams(profile=args.policy, interactivity_tok_s=knee)
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
            load_view="gateway",
        )
        sim = simulate(plays, cfg)
    finally:
        Engine.start_pass = start  # type: ignore[method-assign]
        Engine.finish_pass = finish  # type: ignore[method-assign]
    u_knee = EngineCost(decode_ms=(cfg.engine.perf.d0, cfg.engine.perf.d1, cfg.engine.perf.d2)).decode_knee(
        args.slo_tok_s
    )
    causes: Counter[str] = Counter()
    for rid, rate in rates.items():
        if rate >= args.slo_tok_s:
            continue
        acc = per_seq.get(rid, [0.0, 0.0, 0.0, 0.0])
        if acc[3] > u_knee:
            causes["own KV past the knee"] += 1
        elif acc[1] > 0 and acc[0] / acc[1] > u_knee:
            causes["decode-weighted u past the knee"] += 1
        elif acc[1] > 0 and acc[2] / acc[1] > 0.1:
            causes["prefill passes > 10% of decode time"] += 1
        else:
            causes["other"] += 1
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
    print(
        f"under {args.slo_tok_s:g} tok/s: {sum(causes.values())} of {len(rates)} requests "
        f"(P90 needs <= {len(rates) // 10}; knee u = {u_knee:.3f}):",
        dict(causes.most_common()),
    )
    print("routing reasons:", dict(Counter(r.reason for r in sim.records).most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
