"""Compare routing policies on one trace and one engine model, in one run.

    python -m benchmarks.compare                       # the ANCHORS configurations, Weka dev traces
    python -m benchmarks.compare --configs 8x64x10 --policies agentic+hints,precise_prefix
    python -m benchmarks.compare --engine h200-qwen3-32b-fp8 --no-sweep
    python -m benchmarks.compare --with-dynamo         # + Dynamo 1.6.1's own replay, same run
    python -m benchmarks.compare --trace synth --n 96 --seed 1   # AgentX-shaped plays, seed 1
    python -m benchmarks.compare --configs 8x64x10 --no-sweep --pools 2+6 \
        --policies agentic+hints+recompute,agentic+hints,agentic+hints+planner   # inter-turn migration

Every policy runs through the real ``gateway.core.router.Router`` in the discrete-event simulator
(:mod:`gateway.sim`), against the same modeled engines (default: Dynamo 1.6.1's mocker model).
Prints one table per configuration (workers x lanes x arrival speed-up) next to the ANCHORS
figures for Dynamo, and writes ``ttft_cdf.png``, ``tpgs_vs_concurrency.png`` and
``results.json`` to ``--out`` (default ``benchmarks/out``).

``default`` and ``default-stock`` are what ``agentgw serve`` runs (``gateway.sim.runs.SERVED``):
its configuration's router parameters (``GatewayConfig.router_params()`` with the engine model's
cost fit in ``routing.cost_*``) for engines with engine_ext's control API (host tier, store,
planner) and for stock vLLM engines (vLLM's CPU offload as a host tier; ``+nooffload``: none).
Policies: ``round_robin``, ``least_loaded``, ``session_hash``, ``cache_aware`` (SGLang router
style, approximate index fed by routing decisions), ``precise_prefix`` (llm-d style, index fed
by KV events), ``agentic`` (ours, no hints) and ``agentic+hints`` (session id, parent id for
subagents, expected tool latency from the trace's recorded gap). Suffixes: ``+ctl`` drives the
real role controller (``gateway.core.roles``) in virtual time (roles start as laid out by
``--pools``, or all warm); ``+wall`` routes ``agentic`` with the fixed first-turn threshold
instead of the work-conserving cost split (the split as first built); ``+noknee`` turns off the
sticky picker's decode knee (``RoutingParams.interactivity_tok_s = 0``; every other ``agentic``
policy routes with the knee at ``--slo-tok-s``); ``+bal`` keeps the
``home_load`` scorer at weight 5 (the router's default since issue 12: new sessions and
subagents land where the fewest live sessions' context is homed, balancing the KV decoding
sequences hold) and every other ``agentic`` policy runs it at 0, as first built; ``+intf`` adds
the ``interference`` scorer (``--interference-weight``: new sessions land where their prefill
costs least, counting the decoders it slows); ``+exact`` shows the router the engine model's exact
decoding count and prefill backlog (``--load-view engine`` for every policy) where the default is
what the live gateway's load ledger knows (``--load-view gateway``: prefilling from dispatch to
first token with the decision's uncached tokens, then decoding); ``+planner`` runs the
real ``gateway.core.planner`` after each turn with its executor modeled
(:mod:`gateway.sim.migrations`: prefetch, re-home, pins, and the ``knee_ahead`` moves during
the tool gap); ``+recompute`` runs without KV tiers (what is not on the device is recomputed).
Mechanisms off one at a time: ``+noahead`` (no ``knee_ahead`` moves), ``+kneefree`` (the
arrival-time knee move not priced: ``knee_output_tokens`` 0), ``+ovffree`` (the ``kv_overflow``
move not priced), ``+nopins`` (no device soft pins), ``+nodemote`` (no demotion on long gaps),
``+noaff`` (a cold home keeps its affinity bonus), ``+sloN[xC][rR]`` (the arrival-time knee move
judged by the SLO, ``RoutingParams.slo_moves``: a move predicted within the 1 s TTFT bound is
made, one past it only as a deliberate miss within a budget of ``N`` per mille of the last 1,000
turns, none predicted past ``C`` times the bound, and none while more than ``R`` % of the last
1,000 finished turns decoded under the tok/s bound), ``+nospread`` (a new session follows the
shared prefix whatever the queue); ``+nolat`` withholds the tool-latency hint (the gateway
predicts each gap from the session's observed gaps). ``--seeds 1,2,3`` (synthetic plays) runs
every configuration and policy on each seed's plays and prints the median of each column, with
the moves executed and the TTFT of the turns that followed them; ``--jobs`` runs them in
parallel. ``--tiers auto`` (default) gives every other policy a
host tier per engine and a shared store (:mod:`gateway.sim.tiers`) when a ``+planner`` policy
is in the run, else none; ``--pools F+W`` splits the workers into a first-turn and a warm pool.
With a ``+planner`` policy, a second table compares the *moved sessions' next turns* (the turns
whose session a completed move re-homed) across the policies: TTFT and recomputed tokens.

Engine flags (vLLM's): ``--long-prefill-token-threshold`` and ``--max-num-batched-tokens`` override
the engine model's, for every policy; the cost split prices with the resulting chunk size.

Capacity at the SLO: after the lanes sweep, a table gives each policy's largest swept lane
count at which p90 TTFT <= ``--slo-ttft-ms`` (1,000) and P90 interactivity >= ``--slo-tok-s``
(50; 40 under ``h200-qwen3-32b-fp8-aic``, whose 20.8 ms decode floor caps it at 48).

Dynamo rows: measured ones with ``--with-dynamo``; otherwise the ANCHORS figures are printed only
under the trace and engine model they were measured on (the default Weka dev folder, the mocker
model), labelled as copied, never under another trace or engine.

``--with-dynamo`` also runs NVIDIA Dynamo 1.6.1's offline replay (:mod:`benchmarks.dynamo_replay`,
in its own Python 3.10 environment) on the same Weka files, for the same configurations (and the
KV router at each sweep point), and prints its measured rows under ours instead of the ANCHORS
figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.sim.calibration import ENGINES
from gateway.sim.cluster import RequestRecord, Simulator
from gateway.sim.metrics import RunMetrics, ideal_hits_by_request, percentile
from gateway.sim.migrations import SimMigrations
from gateway.sim.runs import LAST_SIMS, load_trace, meets_slo, run_one, shared_path
from gateway.sim.tiers import TiersConfig
from gateway.sim.traces import Play, synth_agentx

POLICIES = (
    "round_robin",
    "least_loaded",
    "session_hash",
    "cache_aware",
    "precise_prefix",
    "agentic",
    "agentic+hints",
)
ANCHOR_CONFIGS = ("4x16x1", "8x16x1", "8x64x10")

#: Dynamo 1.6.1's replay on the same traces and engine model (shared/ANCHORS.md):
#: config -> policy -> (prefix reuse, TTFT p50 ms or None, TTFT p90 ms).
DYNAMO: dict[str, dict[str, tuple[float, float | None, float]]] = {
    "4x16x1": {
        "round-robin": (0.752, 94, 2164),
        "Dynamo KV router": (0.924, 34, 341),
        "load-only": (0.761, 87, 2047),
    },
    "8x16x1": {"round-robin": (0.655, 231, 2424), "Dynamo KV router": (0.945, 31, 196)},
    "8x64x10": {
        "round-robin": (0.493, None, 8686),
        "Dynamo KV router": (0.879, None, 1402),
        "load-only": (0.564, None, 2968),
    },
}


def parse_config(text: str) -> tuple[int, int, float]:
    w, lanes, sp = text.split("x")
    return int(w), int(lanes), float(sp)


def moved_report(
    sims: dict[str, Simulator], ideal: dict[tuple[str, int], int]
) -> tuple[str, dict[str, dict[str, float]]]:
    """The next turns of sessions a ``+planner`` run moved, compared across every policy's run."""
    planners = [(k, s) for k, s in sims.items() if isinstance(s.planner, SimMigrations)]
    if not planners:
        return "", {}
    label, psim = planners[0]
    mig = psim.planner
    assert isinstance(mig, SimMigrations)
    keys = set(mig.moved_next)
    out: dict[str, dict[str, float]] = {}
    head = (
        f"{'policy':<24} {'turns':>5} {'TTFT p50':>9} {'p90':>8} {'mean':>8} "
        f"{'recomputed ktok':>15} {'loaded ktok':>11}"
    )
    lines = [
        f"moved sessions' next turns ({label}: {len(keys)} turns re-homed by a completed move; "
        f"prefetch slack p50 {percentile(mig.slack_s, 50):.1f} s)",
        head,
        "-" * len(head),
    ]
    for name, sim in sims.items():
        recs: list[RequestRecord] = [r for r in sim.records if (r.play, r.idx) in keys]
        if not recs:
            continue
        ttft = [(r.t_first - r.t_arrive) * 1000.0 for r in recs]
        recompute = sum(
            max(0, ideal.get((r.play, r.idx), 0) - r.cached_tokens) + r.recomputed_tokens for r in recs
        )
        loaded = sum(r.loaded_tokens for r in recs)
        row = {
            "turns": len(recs),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p90_ms": percentile(ttft, 90),
            "ttft_mean_ms": sum(ttft) / len(ttft),
            "recomputed_tokens": recompute,
            "loaded_tokens": loaded,
        }
        out[name] = row
        lines.append(
            f"{name:<24} {len(recs):>5} {row['ttft_p50_ms']:>9.0f} {row['ttft_p90_ms']:>8.0f} "
            f"{row['ttft_mean_ms']:>8.0f} {recompute / 1e3:>15.1f} {loaded / 1e3:>11.1f}"
        )
    lines.append(f"planner actions: {dict(sorted(mig.actions.items()))}")
    lines.append(f"executor: {dict(sorted(mig.stats.items()))}")
    return "\n".join(lines), out


def format_table(
    rows: Sequence[RunMetrics],
    config: str,
    dynamo_rows: Sequence[dict[str, Any]] | None = None,
    anchors: bool = False,
) -> str:
    """Our rows, then Dynamo's: measured in this run (``dynamo_rows``), or, with ``anchors`` (the
    caller's check that trace and engine model are the ones ANCHORS measured), ANCHORS' figures
    labelled as copied; else none."""
    head = (
        f"{'policy':<24} {'reuse':>7} {'ideal':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
        f"{'recompute Mtok':>14} {'P90 tok/s':>9} {'TPGS':>7} {'TPGS@SLO':>8} {'preempt':>7} "
        f"{'moved GB':>8} {'migr':>5} {'wall s':>6}"
    )
    lines = [head, "-" * len(head)]
    for m in rows:
        lines.append(
            f"{m.label:<24} {m.hit_rate:>7.1%} {m.ideal_hit_rate:>7.1%} {m.ttft_p50_ms:>9.0f} "
            f"{m.ttft_p90_ms:>8.0f} {m.ttft_p99_ms:>8.0f} {m.recomputed_tokens / 1e6:>14.1f} "
            f"{m.interactivity_p90:>9.1f} {m.tpgs:>7.0f} {m.tpgs_at_slo:>8.0f} {m.preemptions:>7d} "
            f"{m.kv_bytes_moved / 1e9:>8.1f} {m.migrations:>5d} {m.wall_s:>6.1f}"
        )
    if dynamo_rows is not None:
        for d in dynamo_rows:
            lines.append(
                f"{d['label']:<16.16} {d['hit_rate']:>7.1%} {'':>7} {d['ttft_p50_ms']:>9.0f} "
                f"{d['ttft_p90_ms']:>8.0f} {d['ttft_p99_ms']:>8.0f} {'':>14} "
                f"{d['interactivity_p90']:>9.1f} {d['tpgs']:>7.0f} {d['tpgs_at_slo']:>8.0f} {'':>7} "
                f"{d['wall_s']:>6.1f}  (Dynamo 1.6.1 replay)"
            )
        return "\n".join(lines)
    if not anchors:
        return "\n".join(lines)
    for name, (reuse, p50, p90) in DYNAMO.get(config, {}).items():
        p50s = f"{p50:>9.0f}" if p50 is not None else f"{'-':>9}"
        label = name if name.startswith("Dynamo") else "Dynamo " + name
        lines.append(
            f"{label:<16.16} {reuse:>7.1%} {'':>7} {p50s} {p90:>8.0f}   "
            "(copied from shared/ANCHORS.md, not run: Weka dev, mocker model)"
        )
    return "\n".join(lines)


def anchors_apply(trace: str, trace_path: str | None, engine: str, engine_flags: dict[str, int]) -> bool:
    """Whether ANCHORS' Dynamo figures describe this run's trace and engine model."""
    default_weka = trace_path is None or Path(trace_path).resolve() == shared_path("traces/weka").resolve()
    return trace == "weka" and default_weka and engine == "dynamo-mocker" and not engine_flags


def capacity_table(
    sweep: dict[str, list[tuple[int, float, float, float]]],
    slo_ttft_ms: float,
    slo_tok_s: float,
    baseline: str = "precise_prefix",
) -> tuple[str, dict[str, dict[str, float]]]:
    """Per policy: the largest swept lane count meeting the SLO (and its TPGS), vs ``baseline``."""
    out: dict[str, dict[str, float]] = {}
    for policy, pts in sweep.items():
        ok = [p for p in sorted(pts) if meets_slo(p[3], p[2], slo_ttft_ms, slo_tok_s)]
        best = ok[-1] if ok else None
        out[policy] = {"lanes": float(best[0]) if best else 0.0, "tpgs": best[1] if best else 0.0}
    base = out.get(baseline, {}).get("lanes", 0.0)
    head = f"{'policy':<28} {'lanes at SLO':>12} {'TPGS there':>10} {'vs ' + baseline:>20}"
    lines = [head, "-" * len(head)]
    for policy, row in out.items():
        ratio = f"{row['lanes'] / base:.2f}x" if base else "-"
        row["ratio"] = row["lanes"] / base if base else float("nan")
        lines.append(f"{policy:<28} {row['lanes']:>12.0f} {row['tpgs']:>10.0f} {ratio:>20}")
    lines.append(
        f"SLO: p90 TTFT <= {slo_ttft_ms:.0f} ms and P90 interactivity >= {slo_tok_s:g} tok/s; "
        "lanes = the largest swept lane count that meets it"
    )
    return "\n".join(lines), out


def plot(
    out: Path,
    cdfs: dict[str, dict[str, list[float]]],
    sweep: dict[str, list[tuple[int, float, float, float]]],
    sweep_title: str,
    slo_tok_s: float = 50.0,
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if cdfs:
        fig, axes = plt.subplots(1, len(cdfs), figsize=(6 * len(cdfs), 4.5), squeeze=False)
        for ax, (config, per_policy) in zip(axes[0], cdfs.items(), strict=True):
            for policy, xs in per_policy.items():
                n = len(xs)
                ax.plot([max(x, 1.0) for x in xs], [(i + 1) / n for i in range(n)], label=policy)
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (ms)")
            ax.set_ylabel("fraction of requests")
            w, lanes, sp = parse_config(config)
            ax.set_title(f"{w} workers, {lanes} lanes, speed-up {sp:g}")
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        p = out / "ttft_cdf.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, pts in sweep.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
            for lanes, tpgs, inter, _ in pts:
                if inter < slo_tok_s:
                    ax.plot([lanes], [tpgs], marker="x", color="red", markersize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (agentic lanes)")
        ax.set_ylabel("total tokens per GPU-second")
        ax.set_title(sweep_title + f" (red x: P90 interactivity < {slo_tok_s:g} tok/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "tpgs_vs_concurrency.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, pts in sweep.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[3] for p in pts], marker="o", label=policy)
        ax.axhline(1000.0, color="red", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (agentic lanes)")
        ax.set_ylabel("p90 TTFT (ms)")
        ax.set_title(sweep_title + " (dashed: the 1 s SLO)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "ttft_p90_vs_lanes.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, pts in sweep.items():
            pts = sorted(pts)
            ax.plot([p[2] for p in pts], [p[1] for p in pts], marker="o", label=policy)
            for lanes, tpgs, inter, _ in pts:
                ax.annotate(str(lanes), (inter, tpgs), fontsize=6, alpha=0.6)
        ax.axvline(slo_tok_s, color="red", linestyle="--", linewidth=1)
        ax.set_xlabel("P90 interactivity (tok/s)")
        ax.set_ylabel("total tokens per GPU-second")
        ax.set_title(sweep_title + " (labels: lanes; dashed: the SLO)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "tpgs_vs_interactivity.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


#: The plays of each seed, per process (a seed grid's workers load each seed once).
_SEED_PLAYS: dict[tuple[int, int], tuple[list[Play], dict[tuple[str, int], int]]] = {}


def _seed_run(task: tuple[int, int, str, int, int, float, str, dict[str, Any]]) -> dict[str, Any]:
    """One (seed, policy, config) of a seed grid: its metrics and its moved sessions' next turns."""
    seed, n, policy, workers, lanes, speedup, engine, extra = task
    if (seed, n) not in _SEED_PLAYS:
        plays = synth_agentx(n, seed=seed)
        _SEED_PLAYS[(seed, n)] = (plays, ideal_hits_by_request(plays))
    plays, ideal = _SEED_PLAYS[(seed, n)]
    m, _ = run_one(plays, ideal, policy, workers, lanes, speedup, engine, **extra)
    sim = LAST_SIMS.pop(policy)
    row: dict[str, Any] = {"seed": seed, **m.as_dict()}
    mig = sim.planner
    if isinstance(mig, SimMigrations):
        keys = set(mig.moved_next)
        ttft = [(r.t_first - r.t_arrive) * 1000.0 for r in sim.records if (r.play, r.idx) in keys]
        row["moves"] = {k: v for k, v in mig.actions.items() if k.startswith("move")}
        row["executor"] = dict(sorted(mig.stats.items()))
        row["moved_next_turns"] = len(ttft)
        row["moved_next_ttft_p50_ms"] = percentile(ttft, 50) if ttft else float("nan")
        row["moved_next_ttft_p90_ms"] = percentile(ttft, 90) if ttft else float("nan")
    return row


def _progress(row: dict[str, Any], i: int, total: int) -> dict[str, Any]:
    """One finished run of a seed grid, on stderr as it ends (a long grid shows its rows early)."""
    print(
        f"[{i + 1}/{total}] seed {row['seed']} {row['label']}: p90 {row['ttft_p90_ms']:.0f} "
        f"p99 {row['ttft_p99_ms']:.0f} P90 {row['interactivity_p90']:.1f} moves {row['migrations']}",
        file=sys.stderr,
        flush=True,
    )
    return row


def _median(xs: Sequence[float]) -> float:
    ys = sorted(x for x in xs if x == x)
    if not ys:
        return float("nan")
    k = len(ys) // 2
    return ys[k] if len(ys) % 2 else (ys[k - 1] + ys[k]) / 2


def seed_grid(
    seeds: Sequence[int],
    n: int,
    policies: Sequence[str],
    configs: Sequence[str],
    engine: str,
    extra: dict[str, Any],
    jobs: int,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Every (config, policy) on the synthetic plays of each seed; prints, per config, the median
    over the seeds of each column (every policy sees the same plays of a seed in the same run)."""
    tasks = [
        (seed, n, policy, *parse_config(config), engine, extra)
        for config in configs
        for policy in policies
        for seed in seeds
    ]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows = [_progress(r, i, len(tasks)) for i, r in enumerate(pool.imap(_seed_run, tasks))]
    else:
        rows = [_progress(_seed_run(t), i, len(tasks)) for i, t in enumerate(tasks)]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    it = iter(rows)
    cols = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "interactivity_p90", "tpgs", "migrations")
    moved = ("moved_next_turns", "moved_next_ttft_p50_ms", "moved_next_ttft_p90_ms")
    for config in configs:
        w, lanes, sp = parse_config(config)
        head = (
            f"{'policy':<32} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'P90 tok/s':>9} {'TPGS':>6} "
            f"{'moves':>5} {'moved next':>10} {'its p50':>7} {'its p90':>7}"
        )
        print(f"\n== {config}: {w} workers, {lanes} lanes, speed-up {sp:g}; median of seeds {list(seeds)} ==")
        print(head)
        print("-" * len(head))
        out[config] = {}
        for policy in policies:
            per_seed = [next(it) for _ in seeds]
            med = {c: _median([float(r[c]) for r in per_seed]) for c in cols}
            med.update({c: _median([float(r.get(c, float("nan"))) for r in per_seed]) for c in moved})
            out[config][policy] = {"median": med, "seeds": per_seed}
            mv = (
                ""
                if med["moved_next_turns"] != med["moved_next_turns"]
                else f"{med['moved_next_turns']:>10.0f}"
            )
            print(
                f"{policy:<32} {med['ttft_p50_ms']:>9.0f} {med['ttft_p90_ms']:>7.0f} {med['ttft_p99_ms']:>7.0f} "
                f"{med['interactivity_p90']:>9.1f} {med['tpgs']:>6.0f} {med['migrations']:>5.0f} {mv:>10} "
                f"{med['moved_next_ttft_p50_ms']:>7.0f} {med['moved_next_ttft_p90_ms']:>7.0f}",
                flush=True,
            )
            if any("executor" in r for r in per_seed):
                print(f"{'':<4}{move_fates(per_seed)}", flush=True)
    return out


def move_fates(per_seed: Sequence[dict[str, Any]]) -> str:
    """What became of the planned moves, median of the seeds of each count: planned (by reason),
    the executor's ``move_started`` / ``move_done`` / ``move_cancelled``, ``cancelled:<why>`` and
    ``rehome_skipped`` (copied, but a newer placement or a turn in flight kept the home)."""
    keys: set[str] = set()
    for r in per_seed:
        keys |= {f"planned {k.removeprefix('move:')}" for k in r.get("moves", {})}
        keys |= {k for k in r.get("executor", {}) if k.startswith(("move_", "cancelled:", "rehome_"))}

    def value(r: dict[str, Any], k: str) -> float:
        if k.startswith("planned "):
            return float(r.get("moves", {}).get("move:" + k.removeprefix("planned "), 0))
        return float(r.get("executor", {}).get(k, 0))

    parts = [f"{k} {_median([value(r, k) for r in per_seed]):.0f}" for k in sorted(keys)]
    return "moves (median of seeds): " + ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", choices=("weka", "mooncake", "synth"), default="weka")
    ap.add_argument("--trace-path", default=None, help="default: shared/traces/<kind>")
    ap.add_argument("--n", type=int, default=0, help="synth: plays; mooncake: first N requests")
    ap.add_argument("--seed", type=int, default=0, help="synth: the generator's seed")
    ap.add_argument(
        "--seeds", default="", help="synth: run every config and policy on each seed, print the medians"
    )
    ap.add_argument("--jobs", type=int, default=1, help="--seeds: simulations run in parallel")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="dynamo-mocker")
    ap.add_argument("--configs", default=",".join(ANCHOR_CONFIGS), help="WORKERSxLANESxSPEEDUP,...")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--sweep-lanes", default="8,12,16,20,24,32,48,64", help="TPGS vs concurrency lanes ('' = off)"
    )
    ap.add_argument("--sweep-config", default="8x0x10", help="workers and speed-up of the sweep")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--pools", default="", help="FIRST+WARM workers, e.g. 2+6 ('' = one pool)")
    ap.add_argument(
        "--first-turn-threshold",
        type=int,
        default=None,
        help="estimated uncached tokens (router default 4096)",
    )
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None, help="engine flag (vLLM's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine flag (vLLM's)")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--interference-weight", type=float, default=2.0, help="+intf policies")
    ap.add_argument("--weights", default="", help="scorer weights of agentic, e.g. kv_usage=2,queue=1")
    ap.add_argument("--routing", default="", help="RoutingParams numbers, e.g. sticky_max_queue=4")
    ap.add_argument("--planner", default="", help="PlannerParams numbers of +planner runs, e.g. turn_s=20")
    ap.add_argument("--slo-tok-s", type=float, default=None, help="default 50 (40 for the AIC H200)")
    ap.add_argument("--tiers", choices=("auto", "on", "off"), default="auto", help="host tier + store")
    ap.add_argument("--host-blocks", type=int, default=TiersConfig().host_blocks, help="host tier per engine")
    ap.add_argument("--host-gbps", type=float, default=TiersConfig().host_gbps)
    ap.add_argument("--store-gbps", type=float, default=TiersConfig().store_gbps)
    ap.add_argument(
        "--with-dynamo",
        action="store_true",
        help="also run Dynamo 1.6.1's replay (.dynamo-venv or $DYNAMO_PYTHON) on the same Weka traces",
    )
    ap.add_argument(
        "--load-view",
        choices=("gateway", "engine"),
        default="gateway",
        help="what the router sees as decoding / prefill backlog: the live gateway's ledger "
        "(default) or the engine model's exact state (+exact policies: always exact)",
    )
    ap.add_argument("--dynamo-python", default=None, help="the Dynamo interpreter (default: .dynamo-venv)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    plays = load_trace(args.trace, args.trace_path, args.n, args.seed) if not args.seeds else []
    ideal = ideal_hits_by_request(plays)
    if plays:
        print(
            f"trace {args.trace}: {len(plays)} plays, {sum(len(p.requests) for p in plays)} requests; "
            f"engine {args.engine}; loaded in {time.perf_counter() - t_start:.1f}s",
            flush=True,
        )
    policies = [p for p in args.policies.split(",") if p]
    configs = [c for c in args.configs.split(",") if c]
    tiers_on = args.tiers == "on" or (args.tiers == "auto" and any("+planner" in p for p in policies))
    tiers = (
        TiersConfig(host_blocks=args.host_blocks, host_gbps=args.host_gbps, store_gbps=args.store_gbps)
        if tiers_on
        else None
    )
    first_turn = int(args.pools.split("+")[0]) if args.pools else 0
    engine_flags: dict[str, int] = {}
    if args.long_prefill_token_threshold is not None:
        engine_flags["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    if args.max_num_batched_tokens is not None:
        engine_flags["max_batched_tokens"] = args.max_num_batched_tokens
    slo_tok_s = args.slo_tok_s or (40.0 if args.engine == "h200-qwen3-32b-fp8-aic" else 50.0)
    anchors = anchors_apply(args.trace, args.trace_path, args.engine, engine_flags)
    extra = {
        "first_turn_workers": first_turn,
        "first_turn_threshold": args.first_turn_threshold,
        "tiers": tiers,
        "engine_flags": engine_flags,
        "interference_weight": args.interference_weight,
        "weights": {k: float(v) for k, v in (kv.split("=") for kv in args.weights.split(",") if kv)},
        "load_view": args.load_view,
        "planner_overrides": {
            k: float(v) if "." in v else int(v)
            for k, v in (kv.split("=") for kv in args.planner.split(",") if kv)
        },
        "routing_overrides": {
            "interactivity_tok_s": slo_tok_s,
            **{
                k: float(v) if "." in v else int(v)
                for k, v in (kv.split("=") for kv in args.routing.split(",") if kv)
            },
        },
    }
    if args.seeds:
        if args.trace != "synth":
            ap.error("--seeds needs --trace synth")
        seeds = [int(x) for x in args.seeds.split(",") if x]
        grid = seed_grid(seeds, args.n or 48, policies, configs, args.engine, extra, args.jobs)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "seeds.json").write_text(
            json.dumps({"engine": args.engine, "seeds": seeds, "runs": grid}, indent=1)
        )
        print(f"\nwrote {out / 'seeds.json'}; total wall time {time.perf_counter() - t_start:.1f}s")
        return 0
    lanes_open = args.trace == "mooncake"
    sweep_lanes = [int(x) for x in args.sweep_lanes.split(",") if x] if not args.no_sweep else []
    sw, _, ssp = parse_config(args.sweep_config)
    dyn: dict[str, list[dict[str, Any]]] | None = None
    dyn_sweep: list[tuple[int, float, float, float]] = []
    dyn_error = ""
    if args.with_dynamo:
        if args.trace != "weka":
            dyn_error = "--with-dynamo needs --trace weka"
        else:
            from benchmarks import dynamo_replay as dr

            runs = dr.anchor_runs(configs)
            sweep_cfgs = [f"{sw}x{x}x{ssp:g}" for x in sweep_lanes] if not lanes_open else []
            runs += [(c, "kv_router") for c in sweep_cfgs if (c, "kv_router") not in runs]
            t0 = time.perf_counter()
            try:
                rows_d = dr.run_dynamo(
                    runs, Path(args.trace_path) if args.trace_path else None, args.dynamo_python
                )
            except (dr.DynamoUnavailable, OSError) as exc:
                dyn_error = str(exc)
            else:
                dyn = {}
                for d in rows_d:
                    dyn.setdefault(str(d["config"]), []).append(d)
                for c in sweep_cfgs:
                    for d in dyn.get(c, []):
                        if d["policy"] == "kv_router":
                            dyn_sweep.append(
                                (
                                    parse_config(c)[1],
                                    float(d["tpgs"]),
                                    float(d["interactivity_p90"]),
                                    float(d["ttft_p90_ms"]),
                                )
                            )
                print(f"Dynamo replay: {len(rows_d)} runs in {time.perf_counter() - t0:.1f}s", flush=True)
        if dyn_error:
            shown = "showing the ANCHORS figures (copied)" if anchors else "no Dynamo rows"
            print(f"Dynamo replay not run: {dyn_error}; {shown}", flush=True)
    results: dict[str, dict[str, dict[str, object]]] = {}
    cdfs: dict[str, dict[str, list[float]]] = {}
    done: dict[tuple[str, int, int, float], RunMetrics] = {}
    for config in configs:
        w, lanes, sp = parse_config(config)
        rows = []
        cdfs[config] = {}
        for policy in policies:
            m, ttft = run_one(
                plays, ideal, policy, w, None if lanes_open else lanes, sp, args.engine, **extra
            )
            done[(policy, w, lanes, sp)] = m
            rows.append(m)
            cdfs[config][policy] = ttft
        print(f"\n== {config}: {w} workers, {lanes} lanes, arrival speed-up {sp:g} ==")
        dyn_rows = dyn.get(config, []) if dyn is not None else None
        print(format_table(rows, config, dyn_rows, anchors), flush=True)
        results[config] = {m.label: m.as_dict() for m in rows}
        report, moved = moved_report({p: LAST_SIMS[p] for p in policies if p in LAST_SIMS}, ideal)
        if report:
            print("\n" + report, flush=True)
            results[config]["moved_next_turns"] = moved  # type: ignore[assignment]
        if dyn is not None:
            results[config].update({str(d["label"]): d for d in dyn.get(config, [])})

    sweep: dict[str, list[tuple[int, float, float, float]]] = {}
    capacity: dict[str, dict[str, float]] = {}
    if sweep_lanes and not lanes_open:
        for policy in policies:
            for lanes in sweep_lanes:
                m = done.get((policy, sw, lanes, ssp))
                if m is None:
                    m, _ = run_one(plays, ideal, policy, sw, lanes, ssp, args.engine, **extra)
                sweep.setdefault(policy, []).append((lanes, m.tpgs, m.interactivity_p90, m.ttft_p90_ms))
        if dyn_sweep:
            sweep["Dynamo KV router"] = dyn_sweep
        print(f"\n== TPGS vs concurrency: {sw} workers, speed-up {ssp:g} ==")
        print(f"{'policy':<28} " + " ".join(f"{'L=' + str(x):>17}" for x in sweep_lanes))
        for policy, pts in sweep.items():
            cells = " ".join(
                f"{t:>5.0f} {i:>4.0f} {f:>5.0f}{'*' if meets_slo(f, i, args.slo_ttft_ms, slo_tok_s) else ' '}"
                for _, t, i, f in sorted(pts)
            )
            print(f"{policy:<28} {cells}")
        print(
            "cells: TPGS, P90 interactivity tok/s, p90 TTFT ms; * = meets the SLO "
            f"(p90 TTFT <= {args.slo_ttft_ms:.0f} ms, P90 >= {slo_tok_s:g} tok/s)"
        )
        table, capacity = capacity_table(sweep, args.slo_ttft_ms, slo_tok_s)
        print(f"\n== capacity at the SLO: {sw} workers, speed-up {ssp:g} ==\n{table}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {
                "engine": args.engine,
                "engine_flags": engine_flags,
                "trace": args.trace,
                "runs": results,
                "sweep": sweep,
                "capacity": capacity,
            },
            indent=1,
        )
    )
    written = plot(out, cdfs, sweep, f"{sw} workers, speed-up {ssp:g}", slo_tok_s)
    print(f"\nwrote {', '.join(str(p) for p in [out / 'results.json', *written])}")
    print(f"total wall time {time.perf_counter() - t_start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
