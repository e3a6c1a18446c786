"""The two pieces of a repeated large body's analysis, measured alone (CPU per request).

1. ``hit``: ``ChatTokenizer.prompt_info`` on the ~647 KB body of ``benchmarks.overhead`` sent again
   (a content-keyed cache hit), in this checkout and, with ``--base-src DIR``, in another one (a
   subprocess each, interleaved): what the analysis worker spends once the body is cached.
2. ``round trip``: ``PromptAnalyzer.analyze`` of that body (raw bytes, no token ids back, its
   default ``analysis.mode: process``), in this checkout and in the ``--base-src`` one (a
   subprocess each, interleaved, pinned to one core with its workers): CPU per request of the
   gateway-side process (the event loop and any thread it has) and of its worker processes, and
   wall time: the hop to a worker and back, as the gateway pays it, plus the cache hit.
3. ``agent turns``: ``PromptAnalyzer.analyze`` (mode process) of ``benchmarks.overhead``'s
   agentic mix at the seeds' median of 43 turns (``--turn-sessions`` sessions, 8K to 150K tokens,
   ~3.4K new tokens a turn), each body once, in order, in a fresh gateway-side process: every turn
   is new, so each one renders, encodes its new text and hashes its new blocks, as a live agent
   session does. In this checkout and in the ``--base-src`` one, interleaved.
4. ``hop``: handing the raw body to a worker process of a ``ProcessPoolExecutor`` that parses it,
   through the pool's pipe, through a ``SharedMemory`` block made per request, and through one
   shared-memory arena made once: CPU of this process and of the worker, and wall time, per
   request.

    python -m benchmarks.analysis_hop --base-src . --repeat 3
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent


def _hit(n: int, tokenizer_dir: str) -> None:
    """In a subprocess whose PYTHONPATH picks the checkout: median CPU ms of a cache hit."""
    from benchmarks.overhead import large_body

    if _has_analysis_package():
        from gateway.analysis.tokenize import ChatTokenizer
    else:
        from gateway.service.tokenize import ChatTokenizer  # type: ignore[no-redef]

    body = orjson.loads(large_body())
    tok = ChatTokenizer(tokenizer_dir, 128, None)
    tok.prompt_info("chat", body)
    ts = []
    for _ in range(n):
        t0 = time.process_time()
        tok.prompt_info("chat", body)
        ts.append(time.process_time() - t0)
    print(f"{statistics.median(ts) * 1e3:.3f}")


def _children_cpu() -> float:
    """CPU seconds of this process's live children (its analysis workers)."""
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += _cpu_pid(int(pid))
    return total


def _round_trip(n: int, tokenizer_dir: str) -> None:
    """In a subprocess whose PYTHONPATH picks the checkout: CPU ms per request of this process
    and of its workers, and wall ms, for ``PromptAnalyzer.analyze`` of the repeated body."""
    import asyncio

    from benchmarks.overhead import large_body
    from gateway.config import AnalysisConfig, ModelConfig

    raw = large_body()
    body = orjson.loads(raw)

    async def go() -> tuple[float, float, float]:
        model = ModelConfig.model_validate({"name": "m", "tokenizer": tokenizer_dir})
        # no budget: this measures CPU, and a loaded machine must not turn it into skips
        an = _analyzer([model], AnalysisConfig.model_validate({"budget_ms": 600_000}))
        try:
            await an.wait_ready()
            for _ in range(5):  # the first fills the worker's cache
                await _analyze(an, body, raw)
            c0, w0, t0 = _cpu_self(), _children_cpu(), time.perf_counter()
            for _ in range(n):
                await _analyze(an, body, raw)
            return _cpu_self() - c0, _children_cpu() - w0, time.perf_counter() - t0
        finally:
            await an.aclose()

    parent, workers, wall = asyncio.run(go())
    print(f"{parent / n * 1e3:.3f} {workers / n * 1e3:.3f} {wall / n * 1e3:.3f}")


def _turns(sessions: int, tokenizer_dir: str) -> None:
    """In a subprocess whose PYTHONPATH picks the checkout: CPU ms per request of this process
    and of its workers, and wall ms, for ``PromptAnalyzer.analyze`` of cold agent turns."""
    import asyncio

    from benchmarks.overhead import agentic_bodies
    from gateway.config import AnalysisConfig, ModelConfig

    raws = [raw for _, raw in agentic_bodies(sessions, 43)]
    bodies = [orjson.loads(r) for r in raws]

    async def go() -> tuple[float, float, float]:
        model = ModelConfig.model_validate({"name": "m", "tokenizer": tokenizer_dir})
        # no budget: this measures CPU, and a loaded machine must not turn it into skips
        an = _analyzer([model], AnalysisConfig.model_validate({"budget_ms": 600_000}))
        try:
            await an.wait_ready()
            c0, w0, t0 = _cpu_self(), _children_cpu(), time.perf_counter()
            for raw, body in zip(raws, bodies, strict=True):
                await _analyze(an, body, raw)
            return _cpu_self() - c0, _children_cpu() - w0, time.perf_counter() - t0
        finally:
            await an.aclose()

    parent, workers, wall = asyncio.run(go())
    n = len(raws)
    print(f"{parent / n * 1e3:.3f} {workers / n * 1e3:.3f} {wall / n * 1e3:.3f}")


def _has_analysis_package() -> bool:
    """Whether the checkout on the path has gateway/analysis/ (else it is older: the analysis
    lived in gateway/service/). Asked of the directory, not by trying the import: an editable
    install's finder would find the package in the installed tree and mix the two."""
    import gateway

    return (Path(gateway.__file__).parent / "analysis").is_dir()


def _analyzer(models: list[Any], config: Any) -> Any:
    if _has_analysis_package():
        from gateway.analysis import PromptAnalyzer
    else:
        from gateway.service.analysis import PromptAnalyzer  # type: ignore[no-redef]
    return PromptAnalyzer(models, config)


async def _analyze(an: Any, body: dict[str, Any], raw: bytes) -> Any:
    """One analysis, no token ids back, through either checkout's interface."""
    if not _has_analysis_package():
        return await an.analyze("m", "chat", body, raw=raw, tokens=False)
    from gateway.analysis import AnalysisRequest

    return await an.analyze(AnalysisRequest("m", "chat", body, raw))


def phases(tokenizer_dir: str, passes: int) -> list[tuple[str, float]]:
    """CPU ms per cold agent turn of each phase of ``ChatTokenizer.prompt_info`` (this checkout,
    in this process): ``benchmarks.overhead``'s turns bodies (8 sessions x 43 turns, a new pass
    number in each session's first message per pass, so every turn is new and extends the
    previous turn of its session), after one pass that warms the start-up checks."""
    from benchmarks.overhead import PASS_MARK, agentic_bodies
    from gateway.analysis import tokenize

    bodies = [raw for _, raw in agentic_bodies(8, 43, mark=PASS_MARK)]
    tok = tokenize.ChatTokenizer(tokenizer_dir, 128, None)
    spent: dict[str, float] = {}
    stack: list[str] = []  # a phase inside another counts for the outer one only

    def timed(obj: Any, name: str, label: str) -> None:
        f = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            if stack:
                return f(*a, **kw)
            stack.append(label)
            t0 = time.process_time()
            try:
                return f(*a, **kw)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - t0
                stack.pop()

        setattr(obj, name, wrapper)

    for obj, name, label in (
        (tok.renderer, "normalize", "normalise (vLLM's message rules)"),
        (tok, "_stitch", "render the new messages (with its sampled whole-render check)"),
        (tok.renderer, "render_conversation", "render whole (a session's first turn)"),
        (tok, "_encode", "encode the new text"),
        (tok, "_hash", "hash the new blocks"),
        (tok, "_store", "cache store"),
    ):
        timed(obj, name, label)
    total = 0.0
    for p in range(passes + 1):
        if p == 1:
            spent.clear()
            total = 0.0
        for raw in bodies:
            raw = raw.replace(PASS_MARK.encode(), f"#PASS={p:08d}#".encode())
            t0 = time.process_time()
            body = orjson.loads(raw)
            t1 = time.process_time()
            tok.prompt_info("chat", body)
            total += time.process_time() - t0
            spent["parse the body (orjson)"] = spent.get("parse the body (orjson)", 0.0) + t1 - t0
    n = len(bodies) * passes
    rows = sorted(((k, v / n * 1e3) for k, v in spent.items()), key=lambda r: -r[1])
    rest = total / n * 1e3 - sum(ms for _, ms in rows)
    return [("all", total / n * 1e3), *rows, ("the rest (keys, text and token bookkeeping)", rest)]


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


def _cpu_rows(table: dict[str, list[list[float]]]) -> None:
    for label, runs in table.items():
        med = [statistics.median(r[k] for r in runs) for k in range(3)]
        tot = ", ".join(f"{r[0] + r[1]:.2f}" for r in runs)
        print(f"| {label} | {med[0]:.2f} | {med[1]:.2f} | {med[0] + med[1]:.2f} | {med[2]:.2f} | {tot} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.analysis_hop", description=__doc__.split("\n")[0])
    ap.add_argument("--base-src", default="", help="another checkout for the hit path, same run")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("-n", type=int, default=30, help="requests per measurement")
    ap.add_argument("--tokenizer-dir", default="/tmp/agentgw-bench-tiny-llama")
    ap.add_argument("--core", type=int, default=1, help="pin this process (and its worker) here")
    ap.add_argument("--hit-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trip-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--turns-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--turn-sessions", type=int, default=2, help="sessions of 43 turns in the agent-turn table"
    )
    ap.add_argument("--skip-hop", action="store_true", help="leave out the last table")
    ap.add_argument(
        "--phases", type=int, default=0, metavar="PASSES", help="only the per-phase table of cold turns"
    )
    args = ap.parse_args(argv)
    if args.hit_child:
        _hit(args.n, args.tokenizer_dir)
        return
    if args.trip_child:
        _round_trip(args.n, args.tokenizer_dir)
        return
    if args.turns_child:
        _turns(args.n, args.tokenizer_dir)
        return
    from gateway.local.tiny_model import build_tiny_model

    tok_dir = str(build_tiny_model(args.tokenizer_dir, "llama"))  # built once, as overhead.py does
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    if args.phases:
        print(f"| a cold agent turn's analysis, by phase ({args.phases} passes x 344 turns) | CPU ms |")
        print("|---|---|")
        for label, ms in phases(tok_dir, args.phases):
            print(f"| {label} | {ms:.3f} |")
        return
    srcs = [("this checkout", str(REPO))] + ([("base", args.base_src)] if args.base_src else [])
    print(f"| cache hit on the 647 KB body | CPU ms per request (median of {args.n}), runs |")
    print("|---|---|")
    got: dict[str, list[str]] = {label: [] for label, _ in srcs}
    trips: dict[str, list[list[float]]] = {label: [] for label, _ in srcs}
    turns: dict[str, list[list[float]]] = {label: [] for label, _ in srcs}
    for _ in range(args.repeat):  # interleaved
        for label, src in srcs:
            # as a script: the checkout's own gateway and benchmarks come first on the path
            env = dict(os.environ, PYTHONPATH=f"{Path(src).resolve()}{os.pathsep}{REPO}")
            runs = (
                ("--hit-child", args.n),
                ("--trip-child", args.n * 5),
                ("--turns-child", args.turn_sessions),
            )
            for flag, n in runs:
                argv2 = [sys.executable, str(Path(__file__).resolve()), flag, "-n", str(n)]
                argv2 += ["--tokenizer-dir", tok_dir]
                out = subprocess.run(argv2, env=env, capture_output=True, text=True, check=True, cwd=src)
                if flag == "--hit-child":
                    got[label].append(out.stdout.strip())
                else:
                    dest = trips if flag == "--trip-child" else turns
                    dest[label].append([float(x) for x in out.stdout.split()])
    for label, vals in got.items():
        print(f"| {label} | {', '.join(vals)} |")
    print()
    print(
        f"| PromptAnalyzer.analyze round trip, 647 KB body ({args.n * 5} requests a run) "
        "| gateway-side CPU ms | worker CPU ms | total CPU ms | wall ms | runs (total CPU) |"
    )
    print("|---|---|---|---|---|---|")
    _cpu_rows(trips)
    print()
    print(
        f"| PromptAnalyzer.analyze of cold agent turns ({args.turn_sessions} sessions x 43 turns, "
        "each body once) | gateway-side CPU ms | worker CPU ms | total CPU ms | wall ms | runs (total CPU) |"
    )
    print("|---|---|---|---|---|---|")
    _cpu_rows(turns)
    if args.skip_hop:
        return
    print()
    print("| hop of the 647 KB body to a worker | this process CPU ms | worker CPU ms | wall ms |")
    print("|---|---|---|---|")
    for mode, parent, worker, wall in hop(args.n * 5, args.repeat):
        print(f"| {mode} | {parent:.2f} | {worker:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
