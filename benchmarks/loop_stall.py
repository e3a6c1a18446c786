"""Event-loop stall: latency of small requests and of ``/health`` while huge first turns arrive.

For each analysis mode (``--modes``, default ``inline,thread,process``; ``inline`` is the "before":
render, tokenize and hash on the event loop) one gateway (``python -m gateway serve``) runs with a
tokenizer configured for the tiny Llama (``gateway.local.tiny_model``) in front of two stand-in
engines (``testing.fake_engine``). Phases of ``--duration`` seconds each:

- ``idle``: only the probes;
- ``32K`` / ``128K`` / ``200K`` (``--sizes``, in tokens): first turns of that size (one system
  message of words, unique from its first characters so nothing is cached) POSTed at ``--rate``
  per second, open loop, while the probes run.

Probes, back to back with a 10 ms pause each: a small chat request (one short user message,
``max_tokens`` 1, not streamed) and ``GET /health``. The table gives their p50/p99 in ms and
"+p99": p99 minus the same mode's idle p99. "big" columns: first turns completed, their p50
latency, and how many were routed on the approximate index because analysis was skipped
(``agentgw_analysis_skipped_total``, by reason). Everything (gateway, its workers, engines, this
client) shares the machine's cores.

    python -m benchmarks.loop_stall --duration 10 --rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing import Process, Queue
from pathlib import Path

import aiohttp
import orjson

from benchmarks._common import ManagedProcess, free_port, percentile, wait_http_ok

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
CHARS_PER_TOKEN_PROBE = 20_000


@dataclass
class Phase:
    mode: str
    load: str
    small: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    big: list[float] = field(default_factory=list)
    big_sent: int = 0
    big_errors: int = 0
    skipped: dict[str, float] = field(default_factory=dict)


def words_text(n_chars: int, rng: random.Random) -> str:
    words = (REPO / "gateway" / "local" / "corpus" / "prose.txt").read_text().split()
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def chars_per_token(model_dir: Path, sample: str) -> float:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(sample) / len(tok.encode(sample, add_special_tokens=False).ids)


def big_bodies(tokens: int, count: int, cpt: float, base: str) -> list[bytes]:
    n = int(tokens * cpt)
    text = (base * (n // len(base) + 1))[:n]
    return [
        orjson.dumps(
            {
                "model": MODEL,
                "max_tokens": 1,
                "messages": [
                    {"role": "system", "content": f"first turn {i} {random.random()}: {text}"},
                    {"role": "user", "content": "start"},
                ],
            }
        )
        for i in range(count)
    ]


SMALL = orjson.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
JSON = {"content-type": "application/json"}


async def probe(
    session: aiohttp.ClientSession, url: str, body: bytes | None, out: list[float], stop: float
) -> None:
    while time.monotonic() < stop:
        t = time.perf_counter()
        if body is None:
            async with session.get(url) as r:
                await r.read()
        else:
            async with session.post(url, data=body, headers=JSON) as r:
                await r.read()
        if r.status == 200:
            out.append((time.perf_counter() - t) * 1000)
        await asyncio.sleep(0.01)


async def send_big(session: aiohttp.ClientSession, url: str, body: bytes, ph: Phase) -> None:
    t = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON) as r:
            await r.read()
            if r.status == 200:
                ph.big.append((time.perf_counter() - t) * 1000)
            else:
                ph.big_errors += 1
    except aiohttp.ClientError:
        ph.big_errors += 1


async def skipped(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for m in re.finditer(r'^agentgw_analysis_skipped_total\{reason="([^"]+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def send_bigs(base: str, bodies: list[bytes], rate: float, duration: float) -> Phase:
    """The first turns, open loop at ``rate`` per second (run in a process of its own, so that
    writing megabytes does not delay the probes' clock)."""
    ph = Phase("", "")
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        bigs: list[asyncio.Task[None]] = []
        t0 = time.monotonic()
        while bodies and time.monotonic() < t0 + duration:
            bigs.append(
                asyncio.create_task(send_big(s, base + "/v1/chat/completions", bodies[ph.big_sent], ph))
            )
            ph.big_sent += 1
            if ph.big_sent >= len(bodies):
                break
            await asyncio.sleep(max(0.0, t0 + ph.big_sent / rate - time.monotonic()))
        await asyncio.gather(*bigs)
    return ph


def _big_process(base: str, bodies: list[bytes], rate: float, duration: float, out: Queue) -> None:  # type: ignore[type-arg]
    ph = asyncio.run(send_bigs(base, bodies, rate, duration))
    out.put((ph.big, ph.big_sent, ph.big_errors))


async def run_phase(base: str, ph: Phase, bodies: list[bytes], rate: float, duration: float) -> None:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        before = await skipped(s, base)
        results: Queue = Queue()  # type: ignore[type-arg]
        sender = (
            Process(target=_big_process, args=(base, bodies, rate, duration, results)) if bodies else None
        )
        if sender is not None:
            sender.start()
        stop = time.monotonic() + duration
        await asyncio.gather(
            probe(s, base + "/v1/chat/completions", SMALL, ph.small, stop),
            probe(s, base + "/health", None, ph.health, stop),
        )
        if sender is not None:
            ph.big, ph.big_sent, ph.big_errors = await asyncio.to_thread(results.get)
            sender.join()
        after = await skipped(s, base)
        ph.skipped = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def gateway_config(
    port: int, engines: list[str], model_dir: Path, mode: str, workers: int
) -> dict[str, object]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "pools": [
            {
                "name": "any",
                "role": "any",
                "engines": [{"name": f"fake{i}", "url": u, "model": MODEL} for i, u in enumerate(engines)],
            }
        ],
        "models": [{"name": MODEL, "tokenizer": str(model_dir), "block_size": 128, "hash_seed": "0"}],
        "analysis": {"mode": mode, "workers": workers},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="inline,thread,process")
    ap.add_argument("--sizes", default="32768,131072,204800", help="first-turn sizes in tokens")
    ap.add_argument("--rate", type=float, default=2.0, help="first turns per second")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--workers", type=int, default=1, help="analysis.workers (large lane)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds, modes in a rotating order; medians")
    ap.add_argument("--models-dir", default="/tmp/agentgw-test-models")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args(argv)

    from gateway.local.tiny_model import build_tiny_model

    model_dir = build_tiny_model(Path(args.models_dir) / "tiny-llama", "llama")
    rng = random.Random(0)
    base = words_text(200_000, rng)
    cpt = chars_per_token(model_dir, base[:CHARS_PER_TOKEN_PROBE])
    sizes = [int(s) for s in args.sizes.split(",") if s]
    count = int(args.rate * args.duration) + 1
    print(f"# {cpt:.2f} chars/token; {count} first turns per phase at {args.rate}/s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="loop-stall-"))
    engines = []
    for i in range(2):
        port = free_port()
        engines.append(
            ManagedProcess(
                f"fake{i}",
                [sys.executable, "-m", "testing.fake_engine", "--port", str(port), "--model", MODEL],
                workdir,
            )
        )
        wait_http_ok(f"http://127.0.0.1:{port}/health", 15, engines[-1].proc)
    urls = [f"http://127.0.0.1:{e.argv[e.argv.index('--port') + 1]}" for e in engines]
    phases: list[Phase] = []
    modes = args.modes.split(",")
    order = [m for r in range(args.repeat) for m in modes[r % len(modes) :] + modes[: r % len(modes)]]
    try:
        for mode in order:
            port = free_port()
            cfg = workdir / f"gateway-{mode}.yaml"
            cfg.write_text(json.dumps(gateway_config(port, urls, model_dir, mode, args.workers)))
            gw = ManagedProcess(
                f"gateway-{mode}", [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], workdir
            )
            base_url = f"http://127.0.0.1:{port}"
            try:
                wait_http_ok(base_url + "/ready", 60, gw.proc)
                time.sleep(2.0)  # worker processes load their tokenizers
                for load, tokens in [("idle", 0), *((f"{t // 1024}K", t) for t in sizes)]:
                    bodies = big_bodies(tokens, count, cpt, base) if tokens else []
                    ph = Phase(mode, load)
                    asyncio.run(run_phase(base_url, ph, bodies, args.rate, args.duration))
                    phases.append(ph)
                    print(f"# {mode} {load}: done", flush=True)
            finally:
                gw.stop()
    finally:
        for e in engines:
            e.stop()
    print_table(phases)
    if args.json:
        Path(args.json).write_text(json.dumps([ph.__dict__ for ph in phases]))
    return 0


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def print_table(phases: list[Phase]) -> None:
    """One row per (mode, load): medians over the rounds of each round's p50/p99; "+p99" is the
    median over rounds of (p99 under load - that round's idle p99); counts are summed."""
    rows: dict[tuple[str, str], list[tuple[Phase, Phase | None]]] = {}
    idle: Phase | None = None
    for ph in phases:
        if ph.load == "idle":
            idle = ph
        rows.setdefault((ph.mode, ph.load), []).append((ph, idle))
    head = (
        "| mode | first turns | small p50 | small p99 | small +p99 | /health p50 | /health p99 | "
        "/health +p99 | big done/sent | big p50 | skipped (approx.) |"
    )
    print(head)
    print("|" + "|".join("---" for _ in range(11)) + "|")
    for (mode, load), runs in rows.items():

        def stat(attr: str, q: float, runs: list[tuple[Phase, Phase | None]] = runs) -> float:
            return median([percentile(sorted(getattr(ph, attr)), q) for ph, _ in runs])

        def added(attr: str, runs: list[tuple[Phase, Phase | None]] = runs) -> float:
            return median(
                [
                    percentile(sorted(getattr(ph, attr)), 99) - percentile(sorted(getattr(i, attr)), 99)
                    for ph, i in runs
                    if i is not None and i is not ph
                ]
            )

        sent = sum(ph.big_sent for ph, _ in runs)
        done = sum(len(ph.big) for ph, _ in runs)
        big = f"{done}/{sent}" if sent else "-"
        bp50 = f"{stat('big', 50):.0f}" if done else "-"
        skipped: dict[str, float] = {}
        for ph, _ in runs:
            for k, v in ph.skipped.items():
                skipped[k] = skipped.get(k, 0.0) + v
        sk = ", ".join(f"{k} {v:.0f}" for k, v in sorted(skipped.items())) or "0"
        ds = f"{added('small'):+.1f}" if load != "idle" else "-"
        dh = f"{added('health'):+.1f}" if load != "idle" else "-"
        print(
            f"| {mode} | {load} | {stat('small', 50):.1f} | {stat('small', 99):.1f} | {ds} | "
            f"{stat('health', 50):.1f} | {stat('health', 99):.1f} | {dh} | {big} | {bp50} | {sk} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
