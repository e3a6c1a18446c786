"""The two pieces of a repeated large body's analysis, measured alone (CPU per request).

1. ``hit``: ``ChatTokenizer.prompt_info`` on the ~647 KB body of ``benchmarks.overhead`` sent again
   (a content-keyed cache hit), in this checkout and, with ``--base-src DIR``, in another one (a
   subprocess each, interleaved): what the analysis worker spends once the body is cached.
2. ``hop``: handing the raw body to a worker process of a ``ProcessPoolExecutor`` that parses it,
   through the pool's pipe (what the gateway does), through a ``SharedMemory`` block made per
   request, and through one shared-memory arena made once: CPU of this process and of the
   worker, and wall time, per request.

    python -m benchmarks.analysis_hop --base-src /tmp/o10-base --repeat 2
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent


def _hit(n: int, tokenizer_dir: str) -> None:
    """In a subprocess whose PYTHONPATH picks the checkout: median CPU ms of a cache hit."""
    from benchmarks.overhead import large_body
    from gateway.service.tokenize import ChatTokenizer

    body = orjson.loads(large_body())
    tok = ChatTokenizer(tokenizer_dir, 128, None)
    tok.prompt_info("chat", body)
    ts = []
    for _ in range(n):
        t0 = time.process_time()
        tok.prompt_info("chat", body)
        ts.append(time.process_time() - t0)
    print(f"{statistics.median(ts) * 1e3:.3f}")


def _buf(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None
    return buf


def _parse(raw: bytes | memoryview) -> int:
    return len(orjson.loads(raw)["messages"][0]["content"])


def _from_block(name: str, n: int) -> int:
    shm = shared_memory.SharedMemory(name)
    try:
        return _parse(_buf(shm)[:n])
    finally:
        shm.close()


_attached: dict[str, shared_memory.SharedMemory] = {}


def _from_arena(name: str, n: int) -> int:
    shm = _attached.get(name)
    if shm is None:
        shm = _attached[name] = shared_memory.SharedMemory(name)
    return _parse(_buf(shm)[:n])


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_pid(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hop(n: int, repeat: int) -> list[tuple[str, float, float, float]]:
    from benchmarks.overhead import large_body

    raw = large_body()
    pool = cf.ProcessPoolExecutor(1, mp.get_context("spawn"))
    pid = pool.submit(os.getpid).result()
    arena = shared_memory.SharedMemory(create=True, size=len(raw))
    rows = []
    try:
        for _ in range(repeat):
            for mode in ("pipe", "block per request", "arena"):
                c0, w0, t0 = _cpu_self(), _cpu_pid(pid), time.perf_counter()
                for _ in range(n):
                    if mode == "pipe":
                        pool.submit(_parse, raw).result()
                    elif mode == "arena":
                        _buf(arena)[: len(raw)] = raw
                        pool.submit(_from_arena, arena.name, len(raw)).result()
                    else:
                        shm = shared_memory.SharedMemory(create=True, size=len(raw))
                        try:
                            _buf(shm)[: len(raw)] = raw
                            pool.submit(_from_block, shm.name, len(raw)).result()
                        finally:
                            shm.close()
                            shm.unlink()
                wall = (time.perf_counter() - t0) / n * 1e3
                rows.append((mode, (_cpu_self() - c0) / n * 1e3, (_cpu_pid(pid) - w0) / n * 1e3, wall))
    finally:
        pool.shutdown()
        arena.close()
        arena.unlink()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.analysis_hop", description=__doc__.split("\n")[0])
    ap.add_argument("--base-src", default="", help="another checkout for the hit path, same run")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("-n", type=int, default=30, help="requests per measurement")
    ap.add_argument("--tokenizer-dir", default="/tmp/agentgw-bench-tiny-llama")
    ap.add_argument("--core", type=int, default=1, help="pin this process (and its worker) here")
    ap.add_argument("--hit-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hit_child:
        _hit(args.n, args.tokenizer_dir)
        return
    from gateway.local.tiny_model import build_tiny_model

    tok_dir = str(build_tiny_model(args.tokenizer_dir, "llama"))  # built once, as overhead.py does
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    srcs = [("this checkout", str(REPO))] + ([("base", args.base_src)] if args.base_src else [])
    print(f"| cache hit on the 647 KB body | CPU ms per request (median of {args.n}), runs |")
    print("|---|---|")
    got: dict[str, list[str]] = {label: [] for label, _ in srcs}
    for _ in range(args.repeat):  # interleaved
        for label, src in srcs:
            # as a script: the checkout's own gateway and benchmarks come first on the path
            argv2 = [sys.executable, str(Path(__file__).resolve()), "--hit-child", "-n", str(args.n)]
            argv2 += ["--tokenizer-dir", tok_dir]
            env = dict(os.environ, PYTHONPATH=f"{Path(src).resolve()}{os.pathsep}{REPO}")
            out = subprocess.run(argv2, env=env, capture_output=True, text=True, check=True, cwd=src)
            got[label].append(out.stdout.strip())
    for label, vals in got.items():
        print(f"| {label} | {', '.join(vals)} |")
    print()
    print("| hop of the 647 KB body to a worker | this process CPU ms | worker CPU ms | wall ms |")
    print("|---|---|---|---|")
    for mode, parent, worker, wall in hop(args.n * 5, args.repeat):
        print(f"| {mode} | {parent:.2f} | {worker:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
