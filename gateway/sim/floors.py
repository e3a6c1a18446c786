"""What no router can beat: each request's TTFT and decode speed on an idle engine with an ideal cache.

    python -m gateway.sim.floors --trace-path ../shared/traces/weka

For every request of a trace and every engine model it computes two floors that depend only on
the request and the engine model, never on routing:

- **TTFT floor**: the prefill of the tokens an infinite cache would not hold (the trace's own
  reuse in recorded order, :func:`~gateway.sim.metrics.ideal_hits_by_request`), alone on an
  idle engine, chunked at the engine's ``max_batched_tokens`` with the attention term over the
  cached prefix (the same :class:`~gateway.sim.engine.PerfModel` the simulator runs);
- **decode floor**: one decode step with this request alone on the engine (batch 1, KV use and
  context = its own input + output tokens), as tokens per second.

When more than 10% of the requests miss a bound even at their floor, the p90 of that bound
cannot be met by any policy at any load: the SLO point does not exist under that engine model.
The table prints, per trace and engine model, the floors' p50 / p90 and the share of requests
past each SLO bound (TTFT 1 s; decode 50 tok/s, 40 under the H200 calibration as the issue sets).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gateway.sim.calibration import ENGINES
from gateway.sim.engine import EngineConfig
from gateway.sim.metrics import ideal_hits_by_request
from gateway.sim.traces import Play, load_weka, synth_agentx

SLO_TOK_S = {"h200-qwen3-32b-fp8-aic": 40.0}
"""The interactivity bound per engine model (50 tok/s otherwise)."""


def ttft_floor_ms(eng: EngineConfig, uncached: int, cached: int) -> float:
    """Prefill of ``uncached`` tokens after ``cached`` ones, alone on an idle engine."""
    ms, done, left = 0.0, cached, uncached
    chunk = max(1, eng.max_batched_tokens)
    while left > 0:
        c = min(chunk, left)
        ms += eng.perf.prefill_ms(c, c * done / 1e6)
        done += c
        left -= c
    return ms


def decode_floor_tok_s(eng: EngineConfig, context: int) -> float:
    """Tokens per second of one sequence decoding alone with ``context`` tokens of KV."""
    cap = eng.num_blocks * eng.block_size
    return 1000.0 / eng.perf.decode_ms(context / cap, 1, context)


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def floors(
    plays: Sequence[Play], eng: EngineConfig, slo_ttft_ms: float, slo_tok_s: float
) -> dict[str, float]:
    ideal = ideal_hits_by_request(plays)
    ttft: list[float] = []
    tok_s: list[float] = []
    for p in plays:
        for r in p.requests:
            hit = ideal[(p.play_id, r.idx)]
            ttft.append(ttft_floor_ms(eng, r.input_tokens - hit, hit))
            tok_s.append(decode_floor_tok_s(eng, r.input_tokens + r.output_tokens))
    n = max(1, len(ttft))
    return {
        "requests": float(len(ttft)),
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p90": _pct(ttft, 0.9),
        "over_ttft": sum(t > slo_ttft_ms for t in ttft) / n,
        "tok_s_p50": _pct(tok_s, 0.5),
        "tok_s_p10": _pct(tok_s, 0.1),
        "under_tok_s": sum(t < slo_tok_s for t in tok_s) / n,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace-path", default="../shared/traces/weka", help="the Weka folder")
    ap.add_argument("--n", type=int, default=48, help="AgentX-shaped plays (the synthetic generator, seed 0)")
    ap.add_argument("--engines", default="dynamo-mocker,h200-qwen3-32b-fp8-aic")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    args = ap.parse_args(argv)
    traces = {"weka": load_weka(args.trace_path), "agentx": synth_agentx(args.n, seed=0)}
    print(
        f"{'engine model':26} {'trace':7} {'requests':>8} {'TTFT floor p50':>14} {'p90 ms':>8} "
        f"{'> bound':>8} {'decode floor p50':>16} {'p10 tok/s':>9} {'< bound':>8}"
    )
    for name in [e for e in args.engines.split(",") if e]:
        eng = ENGINES[name]()
        slo_tok_s = SLO_TOK_S.get(name, 50.0)
        for trace, plays in traces.items():
            f = floors(plays, eng, args.slo_ttft_ms, slo_tok_s)
            print(
                f"{name:26} {trace:7} {int(f['requests']):8d} {f['ttft_p50']:14.0f} {f['ttft_p90']:8.0f} "
                f"{f['over_ttft']:8.1%} {f['tok_s_p50']:16.1f} {f['tok_s_p10']:9.1f} {f['under_tok_s']:8.1%}"
                f"   (bounds: {args.slo_ttft_ms:.0f} ms, {slo_tok_s:.0f} tok/s)"
            )
    print("A share past a bound over 10%: that p90 cannot be met by any routing at any load.")


if __name__ == "__main__":
    main()
