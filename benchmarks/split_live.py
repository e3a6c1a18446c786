"""Real engines: the first-turn / warm split as first built (``wall``) vs work-conserving
(``cost``, with the role controller or not) vs one pool, on one scaled trace, in one run.

    flock /tmp/agentgw-engines.lock python -m benchmarks.split_live          # 3 engines, ~10 min

Starts ``--workers`` (3) local vLLM CPU engines on the tiny model once (prefix caching, KV events,
``--num-gpu-blocks-override`` so that evictions happen), fits the cost model's prefill and decode
times on one of them (``benchmarks.fidelity.calibrate``), then for each layout serves a gateway
over the same engines (``agentgw serve --config``: the tokenizer, exact hashes, ``agentic``
profile, hints on) and replays the same scaled Weka plays through it
(``benchmarks.live_replay``), each layout with a fresh prompt salt so that no run hits another's
cache. Layouts: ``wall`` and ``cost`` and ``cost+ctl`` with 1 first-turn + 2 warm engines (what
``agentgw serve`` lays out), ``one pool`` (role ``any``). Prints live_replay's table (hit rate
from usage and from the engines' counters, TTFT, P90 interactivity, recomputed tokens) and writes
a JSON report.

``--long-prefill-token-thresholds 0,256`` repeats the whole run once per value of vLLM's
``--long-prefill-token-threshold`` (0: the flag not passed), restarting the engines with it (the
issue's engine-side head-of-line control, confirmed on real engines: the simulator's sweep is in
docs/benchmarks_sim.md, "Engine flags"); the cost model's chunk is the smaller of it and
``--max-num-batched-tokens``. Rows are labelled ``LAYOUT, cap N``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.fidelity import DEFAULT_PLAYS, cache_config_info, calibrate, replay_setup, start_gateway
from benchmarks.live_replay import LiveConfig, format_table, run_live

LAYOUTS = ("wall", "cost", "cost+ctl", "one pool")


def gateway_config(
    layout: str, specs: list[Any], model_dir: Path, block_size: int, cost: dict[str, Any]
) -> dict[str, Any]:
    from gateway.local.engines import HASH_SEED

    def entry(s: Any) -> dict[str, Any]:
        return {"name": s.name, "url": s.url, "model": "tiny-llama", "kv_events": s.kv_events_endpoint}

    routing: dict[str, Any] = {"profile": "agentic"}
    if layout == "one pool":
        pools = [{"name": "default", "role": "any", "engines": [entry(s) for s in specs]}]
    else:
        pools = [
            {"name": "first_turn", "role": "first_turn", "engines": [entry(specs[0])]},
            {"name": "warm", "role": "warm", "engines": [entry(s) for s in specs[1:]]},
        ]
        routing["split"] = "wall" if layout == "wall" else "cost"
        if layout != "wall":
            routing |= cost
        if layout == "cost+ctl":
            routing |= {
                "role_controller": True,
                "role_min_dwell_s": 5.0,
                "role_backlog_tokens_per_engine": 4096,
            }
    return {
        "pools": pools,
        "models": [
            {
                "name": "tiny-llama",
                "tokenizer": str(model_dir),
                "block_size": block_size,
                "hash_seed": HASH_SEED,
            }
        ],
        "routing": routing,
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.split_live", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--plays", default=DEFAULT_PLAYS)
    ap.add_argument("--max-requests", type=int, default=30)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--num-gpu-blocks", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default="benchmarks/out/split_live.json")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--long-prefill-token-thresholds",
        default="0",
        help="comma-separated values of vLLM's --long-prefill-token-threshold, one run each (0: not passed)",
    )
    args = ap.parse_args(argv)
    caps = [int(x) for x in args.long_prefill_token_thresholds.split(",") if x.strip()]
    report: dict[str, Any] = {"args": vars(args), "runs": {}}
    rows: list[Any] = []
    for cap in caps:
        run_caps(args, cap, report, rows, label_cap=len(caps) > 1 or cap > 0)
    print()
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    return 0


def run_caps(
    args: argparse.Namespace, cap: int, report: dict[str, Any], rows: list[Any], label_cap: bool
) -> None:
    """Start the engines (with ``--long-prefill-token-threshold cap`` when > 0), calibrate, and
    replay every layout through a gateway over them."""

    from gateway.local.engines import start_engines

    flags: tuple[str, ...] = ("--max-num-batched-tokens", str(args.max_num_batched_tokens))
    if cap > 0:
        flags += ("--long-prefill-token-threshold", str(cap))
    plays, st, specs, work, gw_port = replay_setup(args, "agentgw-split-live-", flags)
    model_dir = specs[0].model_dir
    t = time.perf_counter()
    engines = start_engines(specs, timeout_s=400)
    report["trace"] = st
    try:
        print(f"{args.workers} engines ready in {time.perf_counter() - t:.0f} s", flush=True)
        block_size = int(cache_config_info(specs[0].url).get("block_size") or 128)
        cal = calibrate(specs[0].url, "tiny-llama", [128, 512, 1024, 2048, 3584])
        perf = cal["perf"]
        cost = {
            "cost_prefill_ms": [perf.p0, perf.p1, perf.p2],
            "cost_decode_ms": [perf.d0, 0.0, 0.0],
            "cost_chunk_tokens": min(args.max_num_batched_tokens, cap)
            if cap > 0
            else args.max_num_batched_tokens,
        }
        print(f"calibration: TTFT(ms) {cal['points_ms']}, ITL {cal['itl_ms']} ms", flush=True)
        report.setdefault("cost", {})[str(cap)] = cost
        salt = random.randrange(1 << 30)
        for i, layout in enumerate(x for x in args.layouts.split(",") if x):
            cfg = gateway_config(layout, specs, model_dir, block_size, cost)
            gw = start_gateway(cfg, work, gw_port)
            try:
                live = LiveConfig(
                    url=f"http://127.0.0.1:{gw_port}",
                    speedup=args.speedup,
                    lanes=args.lanes,
                    salt=salt + i,
                    progress=not args.no_progress,
                )
                label = f"{layout}, cap {cap}" if label_cap else layout
                m, _ = run_live(plays, live, [s.url for s in specs], label=label)
            finally:
                gw.terminate()
                gw.wait(30)
            rows.append(m)
            report["runs"][label] = m.as_dict()
            print(format_table([m]), flush=True)
    finally:
        for e in engines:
            e.stop()


if __name__ == "__main__":
    sys.exit(main())
