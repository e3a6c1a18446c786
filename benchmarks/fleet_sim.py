"""The fleet grid, by simulation (gateway/sim/fleet.py): R gateway replicas, each with its own
prefix index fed by KV events with a delay and a loss rate, its own load view, a shared session
store with a latency, clients spread at random over the replicas.

    python -m benchmarks.fleet_sim                              # the grid below, then 1,024 engines
    python -m benchmarks.fleet_sim --engines 64 --replicas 1,4 --delays 0 --losses 0   # a corner

Grid: engines in ``--engines`` (64, 256) x replicas ``--replicas`` (1, 4, 16) x event delay
``--delays`` (0, 100, 500 ms) x event loss ``--losses`` (0, 1%) x the period at which each replica
scrapes the engines' gauges ``--scrapes`` (1 s, the gateway's ``timeouts.metrics_interval_s``) x
``--shared-load`` (0: each replica knows only its own in-flight requests, as live; 1: all); then
``--big`` engines (1,024) at one point (``--big-point``: 4 replicas, 100 ms, 0 loss) once per index variant (exact
PrefixIndex, EngineTables, BloomTables). Profile ``agentic`` with hints, Dynamo's mocker engine,
``--no-hints`` routes without session ids (no homes: the prefix indexes alone place turns),
``--lanes-per-engine`` plays at a time per engine (lanes = engines x that), each play cut to its
first ``--max-requests`` requests, speed-up ``--speedup``. The Weka plays are multiplied to give
every lane a play (``gateway.sim.fleet.replicate_plays``: copy c adds c x (max hash id + 1)
to every block hash, so copies share nothing with each other). Every row is compared with the
single-replica ideal of its engine count: 1 replica, no delay, no loss, no store latency.

Reported per run: reuse (cached / input tokens) and its gap to the ideal, p90 TTFT, P90
interactivity, mean decision time per request on its replica (the routing core's on_arrival +
decide: prefix matching, scorers, picker), index entries and estimated index memory per replica
(entries x bytes per entry of that index class, measured with tracemalloc in the same run), event
batches lost and index clears, wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import default_weka_traces
from benchmarks.live_replay import truncate_play
from gateway.sim.cluster import SimConfig
from gateway.sim.fleet import FleetConfig, FleetSimulator, bytes_per_entry, replicate_plays
from gateway.sim.metrics import ideal_hits_by_request, summarize
from gateway.sim.traces import Play, load_weka


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def plays_for(base: Sequence[Play], engines: int, lanes_per_engine: float) -> list[Play]:
    lanes = max(1, round(engines * lanes_per_engine))
    copies = -(-lanes // len(base))
    return replicate_plays(base, copies)[:lanes]


def run_one(
    plays: Sequence[Play],
    engines: int,
    fleet: FleetConfig,
    args: argparse.Namespace,
    ideal: dict[tuple[str, int], int],
    per_entry: dict[str, float],
) -> dict[str, Any]:
    cfg = SimConfig(
        workers=engines,
        profile="agentic",
        hints=not args.no_hints,
        lanes=len(plays),
        speedup=args.speedup,
        load_view="gateway",
        label=f"{engines}e R{fleet.replicas} d{fleet.event_delay_s * 1000:.0f} l{fleet.event_loss:g}",
    )
    t = time.perf_counter()
    sim = FleetSimulator(cfg, fleet)
    sim.run(plays)
    wall = time.perf_counter() - t
    m = summarize(sim, plays, ideal)
    entries = sim.index_entries()
    bpe = per_entry[fleet.index]
    return {
        "engines": engines,
        "replicas": fleet.replicas,
        "delay_ms": fleet.event_delay_s * 1000,
        "loss": fleet.event_loss,
        "scrape_s": fleet.scrape_s,
        "shared_load": fleet.shared_load,
        "on_gap": fleet.on_gap,
        "index": fleet.index,
        "requests": m.requests,
        "reuse": m.hit_rate,
        "ideal_reuse": m.ideal_hit_rate,
        "ttft_p90_ms": m.ttft_p90_ms,
        "interactivity_p90": m.interactivity_p90,
        "decision_us": sim.decision_us(),
        "index_entries_per_replica": max(entries) if entries else 0,
        "index_mb_per_replica": (max(entries) if entries else 0) * bpe / 1e6,
        "events_lost": sim.events_lost,
        "clears": sim.clears,
        "wall_s": wall,
    }


HEAD = (
    "| engines | replicas | event delay | loss | scrape | index | reuse (vs ideal) | p90 TTFT ms (vs ideal) | "
    "P90 tok/s (vs ideal) | decision us | index MB / replica | batches lost / clears |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(r: dict[str, Any], ideal: dict[str, Any] | None) -> str:
    def rel(key: str, fmt: str) -> str:
        v = r[key]
        if ideal is None or ideal is r:
            return format(v, fmt)
        d = v - ideal[key]
        return f"{format(v, fmt)} ({d:+.3f})" if key == "reuse" else f"{format(v, fmt)} ({d:+.0f})"

    return (
        f"| {r['engines']} | {r['replicas']} | {r['delay_ms']:.0f} ms | {r['loss']:.0%} | {r['scrape_s']:g} s{' shared' if r['shared_load'] else ''} | {r['index']} | "
        f"{rel('reuse', '.3f')} | {rel('ttft_p90_ms', '.0f')} | {rel('interactivity_p90', '.1f')} | "
        f"{r['decision_us']:.0f} | {r['index_mb_per_replica']:.1f} | {r['events_lost']} / {r['clears']} |"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [
        r
        for r in rows
        if r["index"] == "exact" and r["loss"] == 0 and r["engines"] <= 256 and r["scrape_s"] == 1.0
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for engines in sorted({r["engines"] for r in grid}):
        for delay in sorted({r["delay_ms"] for r in grid}):
            pts = sorted(
                ((r["replicas"], r) for r in grid if r["engines"] == engines and r["delay_ms"] == delay),
                key=lambda p: p[0],
            )
            if not pts:
                continue
            xs = [p[0] for p in pts]
            label = f"{engines} engines, {delay:.0f} ms"
            axes[0].plot(xs, [p[1]["reuse"] for p in pts], marker="o", label=label)
            axes[1].plot(xs, [p[1]["ttft_p90_ms"] for p in pts], marker="o", label=label)
    for ax, title in zip(axes, ("reuse (cached / input tokens)", "p90 TTFT (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("gateway replicas")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Fleet simulation: replicas x KV-event delay (no loss)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--engines", default="64,256")
    ap.add_argument("--replicas", default="1,4,16")
    ap.add_argument("--delays", default="0,0.1,0.5", help="event delays, seconds")
    ap.add_argument("--losses", default="0,0.01")
    ap.add_argument("--big", type=int, default=1024, help="engines of the one-point runs (0: none)")
    ap.add_argument("--big-point", default="4,0.1,0", help="replicas,delay,loss of the big runs")
    ap.add_argument("--big-indexes", default="exact,tables,bloom")
    ap.add_argument("--lanes-per-engine", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=12)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--store-latency-ms", type=float, default=1.0)
    ap.add_argument(
        "--scrapes", default="1", help="engine-gauge scrape periods, seconds (the grid's 4th axis)"
    )
    ap.add_argument("--on-gap", default="clear", help="clear | keep: a replica's index on a lost batch")
    ap.add_argument(
        "--shared-load", default="0", help="0,1: replicas see only their own in-flight ledger / all"
    )
    ap.add_argument(
        "--no-hints", action="store_true", help="no session hints: placement by the indexes alone"
    )
    ap.add_argument("--out", default="benchmarks/out/fleet_sim")
    args = ap.parse_args(argv)

    base = [truncate_play(p, args.max_requests) for p in load_weka(args.trace or default_weka_traces())]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_entry = {k: bytes_per_entry(k) for k in ("exact", "tables", "bloom")}
    print("bytes per (engine, block) entry: " + ", ".join(f"{k} {v:.0f}" for k, v in per_entry.items()))
    rows: list[dict[str, Any]] = []
    print(HEAD, flush=True)

    def run(
        engines: int, plays: list[Play], ideal: dict[tuple[str, int], int], f: FleetConfig
    ) -> dict[str, Any]:
        r = run_one(plays, engines, f, args, ideal, per_entry)
        rows.append(r)
        return r

    lat = args.store_latency_ms / 1000
    for engines in _ints(args.engines):
        plays = plays_for(base, engines, args.lanes_per_engine)
        ideal_hits = ideal_hits_by_request(plays)
        best = run(engines, plays, ideal_hits, FleetConfig(1, 0.0, 0.0, 0.0, 0.0))
        print(row(best, None) + " ideal", flush=True)
        axes = (
            _ints(args.replicas),
            _floats(args.delays),
            _floats(args.losses),
            _floats(args.scrapes),
            _ints(args.shared_load),
        )
        for rep, delay, loss, scrape, shared in itertools.product(*axes):
            f = FleetConfig(rep, delay, loss, lat, scrape, shared_load=bool(shared), on_gap=args.on_gap)
            r = run(engines, plays, ideal_hits, f)
            print(row(r, best), flush=True)
            (out / "fleet.json").write_text(json.dumps(rows, indent=1))
    if args.big:
        rep_s, delay_s, loss_s = args.big_point.split(",")
        plays = plays_for(base, args.big, args.lanes_per_engine)
        ideal_hits = ideal_hits_by_request(plays)
        big_ideal = run(args.big, plays, ideal_hits, FleetConfig(1, 0.0, 0.0, 0.0, 0.0))
        print(row(big_ideal, None) + " ideal", flush=True)
        shared = bool(_ints(args.shared_load)[0])
        for kind in args.big_indexes.split(","):
            f = FleetConfig(
                int(rep_s),
                float(delay_s),
                float(loss_s),
                lat,
                _floats(args.scrapes)[0],
                kind,
                on_gap=args.on_gap,
                shared_load=shared,
            )
            print(row(run(args.big, plays, ideal_hits, f), big_ideal), flush=True)
            (out / "fleet.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "fleet_reuse_ttft.png")
    print(f"wrote {out / 'fleet.json'} and {out / 'fleet_reuse_ttft.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
