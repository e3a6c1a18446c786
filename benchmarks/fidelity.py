"""Fidelity check: the simulator vs real CPU vLLM engines behind the gateway, on one scaled trace.

    python -m benchmarks.fidelity                                  # defaults below (~3-5 min)
    python -m benchmarks.fidelity --plays trace_0010,trace_0274 --max-requests 40 --num-gpu-blocks 48

1. Loads Weka plays, keeps each play's first ``--max-requests`` requests and scales them down
   (``gateway.sim.scale``: 128-token blocks, ``--max-context``, the recorded gaps).
2. Starts ``--workers`` local vLLM engines on the tiny model (prefix caching, KV events,
   ``--num-gpu-blocks-override`` so that evictions happen, ``--max-num-batched-tokens``,
   ``--max-num-seqs``) and reads their real capacity from ``vllm:cache_config_info``.
3. Measures prefill and decode time on one engine (fresh prompts of several lengths, ``max_tokens``
   1; one long decode) and fits the simulator's ``PerfModel`` (``p0 + p1 T + p2 T^2``, ``d0``).
4. Serves the gateway (``agentgw serve --config``, one pool of role ``any``, the tokenizer, 128-token
   blocks, the ``agentic`` profile) and replays the trace through it (``benchmarks.live_replay``,
   hints on), reading per-request cached tokens and the engines' prefix-cache counters.
5. Runs the simulator (the real router, ``agentic`` profile, hints on) with the same workers,
   block size, capacity, batch limits, fitted times, lanes and speed-up.
6. Prints both hit rates side by side (goal: within 5 points) and writes a JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import one_pool_config
from benchmarks.live_replay import (
    FIRST_TOKEN_ID,
    LiveConfig,
    default_trace,
    format_table,
    load_trace,
    run_live,
)
from gateway.sim.cluster import SimConfig, simulate
from gateway.sim.engine import EngineConfig, PerfModel
from gateway.sim.metrics import summarize
from gateway.sim.traces import Play, trace_stats

PORTS = range(26000, 27000)
DEFAULT_PLAYS = "trace_0010,trace_0274,trace_0019,trace_0595"


def cache_config_info(url: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            body = line[line.index("{") + 1 : line.rindex("}")]
            out = {}
            for part in body.split('",'):
                k, _, v = part.partition('="')
                out[k.strip()] = v.rstrip('"')
            return out
    return {}


async def _time_request(
    client: Any, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int]:
    """(ttft s, decode s, streamed tokens) of one streamed completion."""
    t0 = time.perf_counter()
    t_first = t_last = -1.0
    n = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            t = time.perf_counter()
            if t_first < 0:
                t_first = t
            t_last = t
            n += 1
    return t_first - t0, t_last - t_first, n


def calibrate(url: str, model: str, lengths: Sequence[int], reps: int = 2, seed: int = 0) -> dict[str, Any]:
    """Fit the simulator's PerfModel on one engine: prefill from TTFT of fresh prompts (max_tokens=1),
    decode from the inter-token time of one long generation."""
    import numpy as np
    from openai import AsyncOpenAI

    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, 4096) for _ in range(n)]

    async def go() -> tuple[list[tuple[int, float]], float]:
        async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            await _time_request(client, model, fresh(64), 2)  # warm-up
            pts = []
            for n in lengths:
                best = min([(await _time_request(client, model, fresh(n), 1))[0] for _ in range(reps)])
                pts.append((n, best))
            _, dec, k = await _time_request(client, model, fresh(256), 64)
            return pts, dec / max(1, k - 1)

    pts, itl = asyncio.run(go())
    xs = np.array([p[0] for p in pts], dtype=float)
    ys = np.array([p[1] * 1000.0 for p in pts])
    p2, p1, p0 = np.polyfit(xs, ys, 2)
    if p2 < 0:  # noise: fall back to a line
        p2 = 0.0
        p1, p0 = np.polyfit(xs, ys, 1)
    perf = PerfModel(
        p0=max(0.5, float(p0)),
        p1=max(0.0, float(p1)),
        p2=float(p2),
        d0=itl * 1000.0,
        d1=0.0,
        d2=0.0,
        floor_ms=0.5,
    )
    return {
        "points_ms": [(n, round(t * 1000, 2)) for n, t in pts],
        "itl_ms": round(itl * 1000, 3),
        "perf": perf,
    }


def start_gateway(config: dict[str, Any], workdir: Path, port: int) -> subprocess.Popen[bytes]:
    import yaml

    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(workdir / "gateway.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited ({proc.returncode}); log {workdir / 'gateway.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError("gateway not ready after 60 s")


def run_sim(
    plays: Sequence[Play], workers: int, engine: EngineConfig, lanes: int | None, speedup: float, hints: bool
) -> Any:
    cfg = SimConfig(
        workers=workers,
        engine=engine,
        profile="agentic",
        hints=hints,
        lanes=lanes,
        speedup=speedup,
        label="sim agentic" + ("+hints" if hints else ""),
    )
    t = time.perf_counter()
    sim = simulate(plays, cfg)
    m = summarize(sim, plays)
    m.wall_s = time.perf_counter() - t
    return m


def replay_setup(
    args: argparse.Namespace, prefix: str, extra_args: tuple[str, ...]
) -> tuple[Any, dict[str, Any], list[Any], Path, int]:
    """The trace (its stats printed in one line) and the specs of `args.workers` tiny-llama engines
    for a live replay (shared with `benchmarks.split_live`): returns the plays, their stats, the
    specs, the engines' log folder and a free port for the gateway."""
    from gateway.local.embedded import DEFAULT_HOME
    from gateway.local.engines import EngineSpec, free_ports
    from gateway.local.tiny_model import build_tiny_model

    plays = load_trace(
        args.trace or default_trace(),
        args.plays,
        args.max_requests,
        scale=True,
        max_context=args.max_context,
        block_size=128,
        max_output=args.max_output,
    )
    st = trace_stats(plays)
    print(
        f"trace: {st['plays']} plays, {st['requests']} requests ({st['subagent_requests']} subagent), "
        f"{st['input_tokens']} input tokens, ideal reuse {st['ideal_hit_rate']:.1%}",
        flush=True,
    )
    model_dir = build_tiny_model(DEFAULT_HOME / "models" / "tiny-llama", "llama")
    work = Path(tempfile.mkdtemp(prefix=prefix))
    ports = free_ports(2 * args.workers + 1, PORTS)
    specs = [
        EngineSpec(
            name=f"e{i}",
            model_dir=model_dir,
            served_model_name="tiny-llama",
            port=ports[2 * i],
            kv_events_port=ports[2 * i + 1],
            log_path=work / f"e{i}.log",
            max_model_len=args.max_context,
            num_gpu_blocks_override=args.num_gpu_blocks,
            extra_args=extra_args,
        )
        for i in range(args.workers)
    ]
    return plays, st, specs, work, ports[-1]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--plays", default=DEFAULT_PLAYS)
    ap.add_argument("--max-requests", type=int, default=40)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--num-gpu-blocks", type=int, default=64, help="per engine (--num-gpu-blocks-override)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--no-hints", action="store_true", help="also run both sides without hints")
    ap.add_argument("--calib-lengths", default="128,512,1024,2048,3584")
    ap.add_argument("--out", default="benchmarks/out/fidelity.json")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    from gateway.local.engines import start_engines

    plays, st, specs, work, gw_port = replay_setup(
        args,
        "agentgw-fidelity-",
        (
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-num-seqs",
            str(args.max_num_seqs),
        ),
    )
    model_dir = specs[0].model_dir
    print(f"starting {args.workers} engines (logs in {work})...", flush=True)
    t = time.perf_counter()
    engines = start_engines(specs, timeout_s=400)
    gw = None
    report: dict[str, Any] = {"trace": st, "args": vars(args)}
    try:
        print(f"engines ready in {time.perf_counter() - t:.0f} s", flush=True)
        info = cache_config_info(specs[0].url)
        num_blocks = int(info.get("num_gpu_blocks") or args.num_gpu_blocks)
        block_size = int(info.get("block_size") or 128)
        print(f"engine cache: block_size {block_size}, num_gpu_blocks {num_blocks}", flush=True)
        lengths = [int(x) for x in args.calib_lengths.split(",") if x]
        cal = calibrate(specs[0].url, "tiny-llama", [n for n in lengths if n < args.max_context])
        perf: PerfModel = cal["perf"]
        print(
            f"calibration: TTFT(ms) {cal['points_ms']}, ITL {cal['itl_ms']} ms -> prefill "
            f"{perf.p0:.2f} + {perf.p1:.3e} T + {perf.p2:.3e} T^2 ms, decode {perf.d0:.2f} ms",
            flush=True,
        )
        config = one_pool_config(
            specs,
            model_dir,
            block_size,
            routing={"profile": "agentic"},
            timeouts={"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        )
        gw = start_gateway(config, work, gw_port)
        url = f"http://127.0.0.1:{gw_port}"
        urls = [s.url for s in specs]
        engine_cfg = EngineConfig(
            name="cpu-tiny-llama",
            block_size=block_size,
            num_blocks=num_blocks,
            max_batched_tokens=args.max_num_batched_tokens,
            max_seqs=args.max_num_seqs,
            perf=perf,
        )
        modes = [True, False] if args.no_hints else [True]
        live_rows, sim_rows = [], []
        salt = random.randrange(1 << 30)
        for i, hints in enumerate(modes):
            label = "live " + ("hints" if hints else "no-hints")
            cfg = LiveConfig(
                url=url,
                hints="body" if hints else "none",
                speedup=args.speedup,
                lanes=args.lanes,
                salt=salt + i,
                progress=not args.no_progress,
            )
            m, _records = run_live(plays, cfg, urls, label=label)
            live_rows.append(m)
            sim_rows.append(run_sim(plays, args.workers, engine_cfg, args.lanes, args.speedup, hints))
        print()
        print(format_table(live_rows))
        print()
        head = f"{'':<22} {'hit rate':>9} {'ideal':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'P90 tok/s':>9} {'preempt':>7}"
        print(head)
        print("-" * len(head))
        for lm, sm in zip(live_rows, sim_rows, strict=True):
            print(
                f"{sm.label:<22} {sm.hit_rate:>9.1%} {sm.ideal_hit_rate:>7.1%} {sm.ttft_p50_ms:>9.0f} "
                f"{sm.ttft_p90_ms:>7.0f} {sm.ttft_p99_ms:>7.0f} {sm.interactivity_p90:>9.1f} {sm.preemptions:>7d}"
            )
            print(
                f"{lm.label + ' (usage)':<22} {lm.hit_rate:>9.1%} {lm.ideal_hit_rate:>7.1%} {lm.ttft_p50_ms:>9.0f} "
                f"{lm.ttft_p90_ms:>7.0f} {lm.ttft_p99_ms:>7.0f} {lm.interactivity_p90:>9.1f} {lm.preemptions:>7.0f}"
            )
            print(f"{lm.label + ' (engine ctr)':<22} {lm.engine_hit_rate:>9.1%}")
            gap = 100 * abs(lm.hit_rate - sm.hit_rate)
            print(f"  -> |sim - live| = {gap:.1f} points ({'within' if gap <= 5 else 'NOT within'} 5)")
        report.update(
            {
                "engine": {"num_gpu_blocks": num_blocks, "block_size": block_size},
                "calibration": {**{k: v for k, v in cal.items() if k != "perf"}, "perf": perf.__repr__()},
                "live": [m.as_dict() for m in live_rows],
                "sim": [m.as_dict() for m in sim_rows],
            }
        )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
        print(f"\nwrote {out}")
    finally:
        if gw is not None:
            gw.terminate()
            try:
                gw.wait(15)
            except subprocess.TimeoutExpired:
                gw.kill()
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
