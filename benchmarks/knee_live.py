"""Real engines: a session whose next turn would pass the decode knee at home, moved during its
tool gap (the planner's ``knee_ahead``) against moved when the turn arrives (the router's
``kv_balance``), on the same engines and plays, in one run.

    flock /tmp/agentgw-heavy.lock python -m benchmarks.knee_live      # 3 engines, ~15 min

Starts the embedded default's stack once (``gateway.local.embedded``: 3 tiny-llama vLLM CPU
engines with engine_ext's offload connector, control API and a Mooncake tier, KV events), with
a small device KV cache (``--num-gpu-blocks``, vLLM's ``--num-gpu-blocks-override``) so that a
home passes the router's decode knee (the cost model's knee for 50 tok/s: 31% of an engine's KV)
with two or three sessions' contexts. Replays seeded AgentX-shaped plays
(:func:`gateway.sim.traces.synth_agentx`, each play's context scaled into ``--max-context``,
its first ``--max-requests`` requests) through an ``agentgw serve`` over those engines, once
per mode, each with a fresh prompt salt so that no mode hits another's cache:

- ``arrival``: ``migration.enabled: false``: no planner; a turn whose home would pass the knee
  moves when it arrives (``kv_balance``, unpriced: the ``agentic+hints`` router) and its new
  engine loads what it lacks from Mooncake (or recomputes it) while the client waits.
- ``ahead``: the default on engines with the control API: after each turn the planner projects
  the home's decoding KV at the session's expected return (the tool-latency hint) and, past the
  knee, prefetches the session's KV onto another engine during the gap (``knee_ahead``); the
  session is re-homed when the copy is done; the arrival-time moves that remain are priced.

Per mode: live_replay's table (TTFT, P90 interactivity, hit rates, recomputed tokens), the
planner's moves by reason and outcome (the dashboard's migration list), and the *next turns*:
each turn of a session after its first, split into those served on the engine of the session's
previous turn (a local hit) and those served elsewhere (moved), with their TTFT and cached share.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fidelity import cache_config_info, start_gateway
from benchmarks.live_replay import LiveConfig, LiveRecord, format_table, run_live, truncate_play
from gateway.local.engines import free_ports
from gateway.sim.metrics import percentile
from gateway.sim.scale import scale_plays
from gateway.sim.traces import Play, synth_agentx, trace_stats

MODES = ("arrival", "ahead")
ARRIVAL_MOVES = {"kv_balance", "kv_overflow"}
"""Routing reasons of a turn moved at arrival because its home had no room under the knee."""


def plays_for(args: argparse.Namespace) -> list[Play]:
    """The seeded AgentX-shaped plays, scaled into the engines' window and cut."""
    plays = scale_plays(synth_agentx(args.plays, seed=args.seed), args.max_context, 128, args.max_output)
    return [truncate_play(p, args.max_requests) for p in plays]


def mode_config(base: dict[str, Any], mode: str) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg["timeouts"] = {"health_interval_s": 0.5, "metrics_interval_s": 0.5}
    if mode == "arrival":
        cfg.setdefault("migration", {})["enabled"] = False
    elif mode != "ahead":
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    return cfg


@dataclass
class NextTurns:
    """Each session's turns after its first, by where they ran relative to the turn before."""

    local: list[LiveRecord]
    """Served on the previous turn's engine."""
    moved: list[LiveRecord]
    """Served on another engine."""
    moved_at_arrival: list[LiveRecord]
    """Of ``moved``, those the router moved at arrival (``kv_balance`` / ``kv_overflow``)."""


def next_turns(records: Sequence[LiveRecord]) -> NextTurns:
    by_session: dict[str, list[LiveRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    local: list[LiveRecord] = []
    moved: list[LiveRecord] = []
    for turns in by_session.values():
        turns.sort(key=lambda r: (r.t_arrive, r.idx))
        for prev, cur in itertools.pairwise(turns):
            if prev.error or cur.error or cur.t_first < 0 or not prev.engine or not cur.engine:
                continue
            (local if cur.engine == prev.engine else moved).append(cur)
    return NextTurns(local, moved, [r for r in moved if r.reason in ARRIVAL_MOVES])


def ttft_ms(recs: Sequence[LiveRecord]) -> list[float]:
    return [(r.t_first - r.t_arrive) * 1000.0 for r in recs]


def cached_share(recs: Sequence[LiveRecord]) -> float:
    tin = sum(r.input_tokens for r in recs)
    return sum(max(0, r.cached_tokens) for r in recs) / tin if tin else float("nan")


def cell(recs: Sequence[LiveRecord]) -> str:
    if not recs:
        return "-"
    t = ttft_ms(recs)
    return f"{len(recs)}: {statistics.median(t):.0f} / {percentile(t, 90):.0f} ms, {cached_share(recs):.0%} cached"


_MOVES = re.compile(r'^agentgw_moves_total\{reason="([^"]*)",outcome="([^"]*)"\} ([0-9.e+]+)$', re.M)


def planner_moves(url: str) -> dict[str, int]:
    """The gateway's planner moves, ``"<reason> <outcome>" -> count`` (``agentgw_moves_total``)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f"{r} {o}": int(float(v)) for r, o, v in sorted(_MOVES.findall(text)) if float(v)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.knee_live", description=__doc__.splitlines()[0])
    ap.add_argument("--plays", type=int, default=9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-requests", type=int, default=24, help="per play")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--num-gpu-blocks", type=int, default=96, help="per engine (128-token blocks)")
    ap.add_argument("--lanes", type=int, default=6)
    ap.add_argument("--speedup", type=float, default=4.0, help="the plays' tool gaps divided by this")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", type=Path, default=Path("benchmarks/out/knee_live.json"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        mode_config({}, m)  # an unknown mode fails before the engines start

    from gateway.local.embedded import start_local_stack
    from gateway.local.layout import DEFAULT

    plays = plays_for(args)
    st = trace_stats(plays)
    print(
        f"plays: {st['plays']} AgentX-shaped (seed {args.seed}), {st['requests']} requests "
        f"({st['subagent_requests']} subagent), {st['input_tokens']} input tokens, "
        f"ideal reuse {st['ideal_hit_rate']:.1%}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="agentgw-knee-live-"))
    t0 = time.perf_counter()
    stack = start_local_stack(
        DEFAULT,
        store="mooncake",
        home=work,
        max_model_len=args.max_context,
        extra_args=("--num-gpu-blocks-override", str(args.num_gpu_blocks)),
        timeout_s=400,
    )
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "trace": st, "modes": {}}
    rows = []
    try:
        urls = [s.url for s in stack.specs]
        info = cache_config_info(urls[0])
        print(
            f"{len(urls)} engines up in {time.perf_counter() - t0:.0f} s: block_size {info.get('block_size')}, "
            f"num_gpu_blocks {info.get('num_gpu_blocks')} (logs in {work / 'logs'})",
            flush=True,
        )
        port = free_ports(1)[0]
        gw_url = f"http://127.0.0.1:{port}"
        salt = random.randrange(1 << 30)
        for i, mode in enumerate(modes):
            mdir = work / mode
            mdir.mkdir()
            gw = start_gateway(mode_config(stack.config, mode), mdir, port)
            try:
                live = LiveConfig(
                    url=gw_url,
                    speedup=args.speedup,
                    lanes=args.lanes,
                    salt=salt + i,
                    progress=not args.no_progress,
                )
                m, records = run_live(plays, live, urls, label=mode)
                time.sleep(1.0)  # the last turns' plans
                moves = planner_moves(gw_url)
            finally:
                gw.terminate()
                gw.wait(30)
            nt = next_turns(records)
            rows.append(m)
            reasons = Counter(r.reason for r in records if not r.error)
            report["modes"][mode] = {
                "live": m.as_dict(),
                "planner_moves": moves,
                "reasons": dict(reasons),
                "next_turns": {
                    "local": {
                        "n": len(nt.local),
                        "ttft_ms": ttft_ms(nt.local),
                        "cached": cached_share(nt.local),
                    },
                    "moved": {
                        "n": len(nt.moved),
                        "ttft_ms": ttft_ms(nt.moved),
                        "cached": cached_share(nt.moved),
                    },
                    "moved_at_arrival": {
                        "n": len(nt.moved_at_arrival),
                        "ttft_ms": ttft_ms(nt.moved_at_arrival),
                        "cached": cached_share(nt.moved_at_arrival),
                    },
                },
            }
            print(format_table([m]), flush=True)
            print(f"{mode}: routing reasons {dict(reasons.most_common())}; planner moves {moves}", flush=True)
    finally:
        stack.stop()

    print()
    print(format_table(rows))
    print()
    head = (
        f"{'mode':<8} | {'next turns, local (n: TTFT p50 / p90, cached)':<44} | "
        f"{'moved (all)':<36} | {'of them moved at arrival':<36} | planner moves"
    )
    print(head)
    print("-" * len(head))
    for mode, d in report["modes"].items():
        nt = d["next_turns"]

        def c(k: str, nt: dict[str, Any] = nt) -> str:
            v = nt[k]
            if not v["n"]:
                return "-"
            t = v["ttft_ms"]
            return f"{v['n']}: {statistics.median(t):.0f} / {percentile(t, 90):.0f} ms, {v['cached']:.0%}"

        moves = sum(n for k, n in d["planner_moves"].items() if k.endswith(" completed"))
        print(f"{mode:<8} | {c('local'):<44} | {c('moved'):<36} | {c('moved_at_arrival'):<36} | {moves}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
