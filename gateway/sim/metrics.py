"""Per-run metrics from the request records.

- TTFT p50/p90/p99 (ms): first token minus arrival at the gateway.
- Prefix reuse: token-weighted engine cache hits at admission / input tokens, next to the
  trace's ideal (infinite cache, :func:`gateway.sim.traces.ideal_hit_rate`).
- Recomputed tokens: prefill beyond the ideal (``ideal hits - actual hits`` summed over requests,
  plus preemption recompute).
- Interactivity of a request: output tokens per second while decoding,
  ``(out - 1) / (t_last - t_first)``; P90 interactivity is the value 90% of requests reach or
  beat (the 10th percentile; equivalently 1 / P90 time per output token), as in AgentX.
- TPGS: total tokens (input + output) per GPU-second over the makespan (first arrival to last
  completion); ``tpgs_at_slo`` is TPGS when P90 interactivity >= 50 tok/s, else 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from gateway.sim.cluster import RequestRecord, Simulator
from gateway.sim.traces import Play

__all__ = ["RunMetrics", "ideal_hits_by_request", "percentile", "summarize"]

SLO_TOK_S = 50.0


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(slots=True)
class RunMetrics:
    label: str
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    hit_rate: float
    ideal_hit_rate: float
    recomputed_tokens: int
    interactivity_p90: float
    tpgs: float
    tpgs_at_slo: float
    makespan_s: float
    kv_bytes_moved: int
    migrations: int
    preemptions: int
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def ideal_hits_by_request(plays: Sequence[Play]) -> dict[tuple[str, int], int]:
    """Per (play, request idx): ideal hit tokens (infinite cache, recorded order)."""
    out: dict[tuple[str, int], int] = {}
    for play in plays:
        seen: set[int] = set()
        for r in sorted(play.requests, key=lambda r: (r.t, r.stream != "root", r.idx)):
            h = r.hashes
            n = 0
            if h and h[0] in seen:
                lo, hi = 1, len(h)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if h[mid] in seen:
                        lo = mid + 1
                    else:
                        hi = mid
                n = lo
            out[(play.play_id, r.idx)] = n * play.block_size
            seen.update(h)
    return out


def summarize(
    sim: Simulator, plays: Sequence[Play], ideal: dict[tuple[str, int], int] | None = None, label: str = ""
) -> RunMetrics:
    recs: list[RequestRecord] = sim.records
    ideal = ideal if ideal is not None else ideal_hits_by_request(plays)
    ttft = [(r.t_first - r.t_arrive) * 1000.0 for r in recs]
    tin = sum(r.input_tokens for r in recs)
    tout = sum(r.output_tokens for r in recs)
    hits = sum(r.cached_tokens for r in recs)
    ideal_hits = sum(ideal.get((r.play, r.idx), 0) for r in recs)
    recompute = sum(
        max(0, ideal.get((r.play, r.idx), 0) - r.cached_tokens) + r.recomputed_tokens for r in recs
    )
    inter = [
        (r.output_tokens - 1) / (r.t_last - r.t_first)
        for r in recs
        if r.output_tokens > 1 and r.t_last > r.t_first
    ]
    p90_inter = percentile(inter, 10.0)
    t0 = min((r.t_arrive for r in recs), default=0.0)
    t1 = max((r.t_last for r in recs), default=0.0)
    span = max(1e-9, t1 - t0)
    tpgs = (tin + tout) / (span * len(sim.engines))
    return RunMetrics(
        label=label or sim.cfg.label or sim.cfg.profile,
        requests=len(recs),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        hit_rate=hits / tin if tin else 0.0,
        ideal_hit_rate=ideal_hits / tin if tin else 0.0,
        recomputed_tokens=recompute,
        interactivity_p90=p90_inter,
        tpgs=tpgs,
        tpgs_at_slo=tpgs if p90_inter >= SLO_TOK_S else 0.0,
        makespan_s=span,
        kv_bytes_moved=sim.kv_bytes_moved,
        migrations=sim.migrations,
        preemptions=sum(e.preemptions for e in sim.engines),
    )
