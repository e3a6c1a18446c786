"""Admission order on and off: interactive turns vs a burst of background subagents, one run.

    python -m benchmarks.priority

The hint being measured is the one the admission queue reads
(:attr:`~gateway.core.hints.AgentHints.interactive`): a request that names a parent session
(``x-agent-parent-session-id``) is a background subagent, and while the gateway is at
``admission.max_inflight`` it waits behind every interactive turn (FIFO within each class).
One gateway (``admission.max_inflight`` 4, no tokenizer) in front of one stand-in engine
(``testing.fake_engine``, ``--ttft-ms`` / ``--itl-ms``: ~100 ms a request). Each round sends
a fan-out of ``--subagents`` subagent requests at once, then, while they queue, ``--turns``
main-agent turns of other sessions, and measures every request's time to its first byte:

- ``hints on``: the subagents carry ``x-agent-parent-session-id``, as a harness that sends
  hints does;
- ``hints off``: the same requests with no parent header, so every request is interactive and
  the queue is FIFO.

The two modes alternate over ``--repeat`` rounds against the same gateway; the table gives the
medians over rounds of each class's p50 / p90 TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks._common import ManagedProcess, free_port, percentile, wait_http_ok

MODEL = "bench-model"


async def one(session: aiohttp.ClientSession, url: str, headers: dict[str, str], i: int) -> float:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"request {i}"}]}
    t0 = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        first = None
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        return 1000.0 * (first if first is not None else time.perf_counter() - t0)


async def round_(base: str, hints: bool, subagents: int, turns: int, tag: str) -> dict[str, list[float]]:
    url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        sub = []
        for i in range(subagents):
            h = {"x-agent-session-id": f"{tag}-sub{i}"}
            if hints:
                h["x-agent-parent-session-id"] = f"{tag}-main"
            sub.append(asyncio.create_task(one(s, url, h, i)))
        await asyncio.sleep(0.05)  # the fan-out is queued before the main turns arrive
        main = [
            asyncio.create_task(one(s, url, {"x-agent-session-id": f"{tag}-main{j}"}, 1000 + j))
            for j in range(turns)
        ]
        return {
            "interactive": list(await asyncio.gather(*main)),
            "background": list(await asyncio.gather(*sub)),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subagents", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-inflight", type=int, default=4)
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="priority-"))
    eport, gport = free_port(), free_port()
    engine = ManagedProcess(
        "fake",
        [
            sys.executable,
            "-m",
            "testing.fake_engine",
            "--port",
            str(eport),
            "--model",
            MODEL,
            "--tokens",
            str(args.tokens),
            "--ttft-ms",
            str(args.ttft_ms),
            "--itl-ms",
            str(args.itl_ms),
        ],
        work,
    )
    cfg = {
        "listen": {"host": "127.0.0.1", "port": gport},
        "pools": [
            {
                "name": "any",
                "role": "any",
                "engines": [{"name": "e0", "url": f"http://127.0.0.1:{eport}", "model": MODEL}],
            }
        ],
        "admission": {"max_inflight": args.max_inflight, "max_queue": 4 * (args.subagents + args.turns)},
    }
    (work / "gateway.yaml").write_text(json.dumps(cfg))
    results: dict[str, dict[str, list[float]]] = {"hints on": {}, "hints off": {}}
    try:
        wait_http_ok(f"http://127.0.0.1:{eport}/health", 15, engine.proc)
        gw = ManagedProcess(
            "gateway",
            [sys.executable, "-m", "gateway", "serve", "--config", str(work / "gateway.yaml")],
            work,
        )
        try:
            base = f"http://127.0.0.1:{gport}"
            wait_http_ok(base + "/ready", 60, gw.proc)
            asyncio.run(round_(base, False, 4, 1, "warmup"))
            for r in range(args.repeat):
                for mode in ("hints on", "hints off") if r % 2 == 0 else ("hints off", "hints on"):
                    got = asyncio.run(
                        round_(base, mode == "hints on", args.subagents, args.turns, f"r{r}{mode[-2:]}")
                    )
                    for cls, xs in got.items():
                        xs.sort()
                        results[mode].setdefault(f"{cls} p50", []).append(percentile(xs, 50))
                        results[mode].setdefault(f"{cls} p90", []).append(percentile(xs, 90))
        finally:
            gw.stop()
    finally:
        engine.stop()
    print(
        f"# {args.subagents} subagents at once, then {args.turns} main turns; admission.max_inflight "
        f"{args.max_inflight}; engine ~{args.ttft_ms + args.itl_ms * args.tokens:.0f} ms a request; "
        f"medians over {args.repeat} rounds, TTFT ms"
    )
    print("| mode | interactive p50 | interactive p90 | background p50 | background p90 |")
    print("|---|---|---|---|---|")
    for mode, cells in results.items():
        row = [
            statistics.median(cells[k])
            for k in ("interactive p50", "interactive p90", "background p50", "background p90")
        ]
        print(f"| {mode} | " + " | ".join(f"{v:.0f}" for v in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
