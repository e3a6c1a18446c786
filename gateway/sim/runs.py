"""One simulator run of a named policy, as ``benchmarks.compare`` and ``agentgw plan`` make them.

``run_one(plays, ideal, policy, workers, lanes, speedup, engine, ...)`` builds the policy's
routing parameters from the engine model (:func:`routing_for`), runs the simulator and returns its
metrics and TTFTs; ``load_trace`` reads a trace by kind; ``meets_slo`` is the SLO both report on.
Policies are ``profile+flag+...`` (see ``benchmarks/compare.py`` for the flags).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from gateway.config import load_config
from gateway.core.planner import PlannerParams
from gateway.core.roles import RoleParams
from gateway.core.router import RoutingParams, engine_cost, with_planner
from gateway.sim.calibration import ENGINES
from gateway.sim.cluster import SimConfig, Simulator, simulate
from gateway.sim.engine import EngineConfig
from gateway.sim.metrics import RunMetrics, summarize
from gateway.sim.migrations import SimMigrations
from gateway.sim.tiers import DEFAULT_KV_BYTES_PER_TOKEN, TiersConfig
from gateway.sim.traces import Play, load_mooncake, load_weka, synth_agentx

__all__ = [
    "HOME_LOAD_WEIGHT",
    "LAST_SIMS",
    "load_trace",
    "meets_slo",
    "routing_for",
    "run_one",
    "served_routing",
    "shared_path",
]


#: The ``home_load`` weight of ``+bal`` policies (8x24x10 on the Weka dev traces, agentic+hints:
#: P90 interactivity 39.3 tok/s at 0, 41.5 at 2, 46.1 at 5).
HOME_LOAD_WEIGHT = 5.0


LAST_SIMS: dict[str, Simulator] = {}
"""The last run of each policy (for the moved-session report)."""

SERVED = {"default": True, "default-stock": False}
"""What ``agentgw serve`` runs, by the engines it routes to: ``default`` on engines with
engine_ext's control API (host tier, Mooncake store, the planner's moves and pins),
``default-stock`` on stock vLLM engines (vLLM's own CPU offload: a host tier, no store, no
control API; ``+nooffload``: none, what is not on the device is recomputed). Both route with
hints (as clients send them) and :func:`served_routing`'s parameters."""

#: The routing keys a deployment fits to its engines (the rest keep the gateway's defaults).
COST_KEYS = (
    "cost_prefill_ms",
    "cost_chunk_tokens",
    "cost_decode_ms",
    "cost_decode_seq_ms",
    "cost_decode_kv_ms_per_mtok",
    "cost_kv_capacity_tokens",
    "kv_bytes_per_token",
    "move_bytes_per_s",
)


def served_routing(eng: EngineConfig, tiers: TiersConfig | None, control_api: bool) -> RoutingParams:
    """The router's parameters of ``agentgw serve`` on these engines: the gateway's own
    configuration at its defaults, with the engine model's cost fit in ``routing.cost_*`` (what a
    deployment writes there) and one pool whose engine has a ``control_url`` or not, through
    :meth:`~gateway.config.GatewayConfig.router_params`."""
    fit = routing_for(eng, "agentic", "cost", tiers)
    engine = {
        "name": "e0",
        "url": "http://127.0.0.1:1",
        "model": "m",
        "control_url": "http://127.0.0.1:2" if control_api else None,
    }
    routing = {k: getattr(fit, k) for k in COST_KEYS}
    return load_config(None, pools=[{"name": "p", "engines": [engine]}], routing=routing).router_params()


def run_one(
    plays: Sequence[Play],
    ideal: dict[tuple[str, int], int],
    policy: str,
    workers: int,
    lanes: int | None,
    speedup: float,
    engine: str,
    first_turn_workers: int = 0,
    first_turn_threshold: int | None = None,
    tiers: TiersConfig | None = None,
    engine_flags: dict[str, int] | None = None,
    interference_weight: float = 2.0,
    weights: dict[str, float] | None = None,
    routing_overrides: dict[str, float] | None = None,
    load_view: str = "gateway",
    planner_overrides: dict[str, float] | None = None,
) -> tuple[RunMetrics, list[float]]:
    profile, *flags = policy.split("+")
    served = profile in SERVED
    if served:
        control_api = SERVED[profile]
        profile = "agentic"
        flags = ["hints", *(["planner"] if control_api else []), *flags]
        if not control_api:
            tiers = None if "nooffload" in flags else replace(tiers or TiersConfig(), store=False)
    eng = ENGINES[engine]()
    if engine_flags:
        eng = eng.with_(**engine_flags)
    planner = None
    if "recompute" in flags:
        tiers = None
    if "planner" in flags:
        tiers = tiers or TiersConfig()
        kvb = eng.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN
        tiers = replace(tiers, kv_bytes_per_token=kvb)
    elif tiers is not None and eng.kv_bytes_per_token:
        tiers = replace(tiers, kv_bytes_per_token=eng.kv_bytes_per_token)
    if served:
        routing = served_routing(eng, tiers, control_api)
    else:
        routing = routing_for(eng, profile, "wall" if "wall" in flags else "cost", tiers)
    if "planner" in flags and not served:  # as the gateway routes where it runs the planner
        routing = with_planner(routing)
    home_load = HOME_LOAD_WEIGHT if "bal" in flags else 0.0
    routing = replace(routing, weights={**routing.weights, "home_load": home_load})
    if "intf" in flags:
        routing = replace(routing, weights={**routing.weights, "interference": interference_weight})
    if weights:
        routing = replace(routing, weights={**routing.weights, **weights})
    if routing_overrides:
        routing = replace(routing, **routing_overrides)  # type: ignore[arg-type]
    if "noknee" in flags:
        routing = replace(routing, interactivity_tok_s=0.0)
    if "kneefree" in flags:  # the arrival-time knee move as first built: not priced
        routing = replace(routing, knee_output_tokens=0)
    if "ovffree" in flags:  # the kv_overflow move as first built: not priced
        routing = replace(routing, overflow_wait_tokens=0)
    slo = [f for f in flags if f.startswith("slo")]
    if slo:  # judge the arrival-time knee move by the SLO; +sloN: a budget of N per mille
        spec, _, reach = slo[0][3:].partition("r")
        budget, _, cap = spec.partition("x")
        routing = replace(
            routing,
            slo_moves=True,
            slo_miss_budget=int(budget or 0) / 1000.0,
            slo_miss_max_x=float(cap or 0),
            slo_miss_reach=int(reach) / 100.0 if reach else 1.0,
        )
    if "noaff" in flags:
        routing = replace(routing, cold_home_no_affinity=False)
    if "nospread" in flags:
        routing = replace(routing, new_session_load=False)
    if "planner" in flags:
        assert tiers is not None
        knee = (
            engine_cost(routing).decode_knee(routing.interactivity_tok_s)
            if routing.interactivity_tok_s
            else 1.0
        )
        pp = PlannerParams(
            kv_bytes_per_token=tiers.kv_bytes_per_token,
            move_bytes_per_s=tiers.store_gbps * 1e9,
            knee_kv_share=1.0 if "noahead" in flags else knee,
        )
        if "nodemote" in flags:
            pp = replace(pp, demote_after_s=float("inf"))
        if planner_overrides:
            pp = replace(pp, **planner_overrides)  # type: ignore[arg-type]
        planner = SimMigrations(pp, device_pins="nopins" not in flags)
    if first_turn_threshold is not None:
        routing = replace(routing, first_turn_threshold_tokens=first_turn_threshold)
    cfg = SimConfig(
        workers=workers,
        engine=eng,
        profile=profile,
        hints="hints" in flags,
        tool_latency_hint="nolat" not in flags,
        lanes=lanes,
        speedup=speedup,
        label=policy,
        routing=routing,
        first_turn_workers=first_turn_workers,
        tiers=tiers,
        roles=RoleParams() if "ctl" in flags else None,
        load_view="engine" if "exact" in flags else load_view,
    )
    t0 = time.perf_counter()
    sim = simulate(plays, cfg, planner)
    m = summarize(sim, plays, ideal, label=policy)
    m.wall_s = time.perf_counter() - t0
    LAST_SIMS[policy] = sim
    ttft = sorted((r.t_first - r.t_arrive) * 1000.0 for r in sim.records)
    return m, ttft


def routing_for(eng: EngineConfig, profile: str, split: str, tiers: TiersConfig | None) -> RoutingParams:
    """Router parameters whose cost model is the engine model's own (what a deployment fits from
    measured step times): prefill polynomial, chunk = min(budget, long-prefill cap), decode
    polynomial over KV use plus the H200 models' batch and context terms (per sequence, per
    million context tokens over the engine's KV capacity), KV bytes per token and the store's
    bandwidth for moves."""
    perf = eng.perf
    cap = eng.long_prefill_token_threshold
    chunk = min(eng.max_batched_tokens, cap) if cap > 0 else eng.max_batched_tokens
    store_gbps = tiers.store_gbps if tiers is not None else TiersConfig().store_gbps
    return RoutingParams(
        profile=profile,
        split=split,
        cost_prefill_ms=(perf.p0, perf.p1, perf.p2),
        cost_chunk_tokens=chunk,
        cost_decode_ms=(perf.d0, perf.d1, perf.d2),
        cost_decode_seq_ms=perf.d_seq,
        cost_decode_kv_ms_per_mtok=perf.d_kv,
        cost_kv_capacity_tokens=eng.num_blocks * eng.block_size if perf.d_kv else 0,
        kv_bytes_per_token=eng.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN,
        move_bytes_per_s=store_gbps * 1e9,
    )


def meets_slo(ttft_p90_ms: float, inter_p90: float, slo_ttft_ms: float, slo_tok_s: float) -> bool:
    return ttft_p90_ms <= slo_ttft_ms and inter_p90 >= slo_tok_s


def shared_path(rel: str) -> Path:
    """``shared/<rel>`` in the checkout, else beside it (the workspace layout)."""
    repo = Path(__file__).resolve().parents[2]
    for base in (repo / "shared", repo.parent / "shared"):
        if (base / rel).exists():
            return base / rel
    return repo / "shared" / rel


def load_trace(kind: str, path: str | None, n: int, seed: int = 0) -> list[Play]:
    if kind == "weka":
        return load_weka(path or shared_path("traces/weka"))
    if kind == "mooncake":
        return load_mooncake(path or shared_path("traces/mooncake/conversation_trace.jsonl"), limit=n or None)
    return synth_agentx(n or 48, seed=seed)
