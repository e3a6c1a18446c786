"""Gateway overhead: the same load sent straight to a fast stand-in engine and through a router.

Two stand-in engines (``testing.fake_engine``: no model, a few microseconds per request) sit
behind each router under test. The load generator runs on one core (``--load-core``, 0), the
engines and every router on another (``--server-core``, 1), so routers compete for one core as in
docs/benchmarks.md. For each case (body size x concurrency) and target:

- ``wrk`` (``benchmarks/wrk/post.lua``) POSTs the body for ``--duration`` seconds: latency to the
  end of the stream (p50, p99) and requests per second;
- an aiohttp client, ``c`` workers back to back, measures TTFT (request sent -> first SSE data
  bytes) for cases whose concurrency is in ``--ttft-conc``;
- the target's CPU time per request (``/proc/PID/stat``) and its peak RSS (``VmHWM``).

Bodies: ``small`` ~220 B chat request with ``stream: true``; ``large`` ~647 KB, one user message
of ~140K tokens' worth of words. Every figure is the median of ``--repeat`` runs; the targets are
measured interleaved, in a rotating order, so drift in a shared machine spreads over all of them.
"+" columns are target minus ``direct`` in the same run.

Targets: ``direct`` (engine 0), ``gateway`` (``python -m gateway serve --config CONFIG``, or
``--gateway-cmd``), and with ``--peers``: ``naive`` (``benchmarks.naive_proxy``: FastAPI +
httpx + StreamingResponse) and ``vllm-router`` (the Rust vLLM router from PyPI, installed into a
separate virtual environment, round-robin and cache-aware policies).

    python -m benchmarks.overhead --duration 3 --repeat 3 --peers naive,vllm-router --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from math import nan
from pathlib import Path

import aiohttp

from benchmarks._common import (
    ManagedProcess,
    cpu_seconds,
    peak_rss_kib,
    percentile,
    pin_prefix,
    port_is_free,
    wait_http_ok,
)

__all__ = [
    "Bodies",
    "Case",
    "Target",
    "agentic_bodies",
    "large_body",
    "main",
    "run_ttft",
    "run_wrk",
    "small_body",
]

REPO = Path(__file__).resolve().parent.parent
WRK_SCRIPT = REPO / "benchmarks" / "wrk" / "post.lua"
WRK_BODIES_SCRIPT = REPO / "benchmarks" / "wrk" / "bodies.lua"
MODEL = "bench-model"
CHAT_PATH = "/v1/chat/completions"
ALL_CASES = (
    "small-c1",
    "small-c64",
    "small-c256",
    "large-c1",
    "large-c64",
    "large-c256",
    "agentic-c1",
    "agentic-c64",
    "turns-c1",
    "turns-c64",
)
PASS_MARK = "#PASS=00000000#"
"""In the ``turns`` bodies' first user message: wrk writes its pass number here."""
PEERS = {"naive": ["naive"], "vllm-router": ["vllm-router-rr", "vllm-router-ca"]}

# Port layout, relative to --port-base.
ENGINE_OFFSETS = (1, 2)
TARGET_OFFSETS = {
    "gateway": 100,
    "gateway-notok": 101,
    "gateway-base": 102,
    "vllm-router-rr": 110,
    "vllm-router-ca": 111,
    "naive": 120,
}

_TEXT = (
    "the agent reads a file then calls a tool and writes the patch while the model keeps its cache "
    "warm across turns so that each new request shares a long prefix with the last one in session "
    "context window token block engine router gateway prefill decode stream chunk latency budget "
    "function result error retry plan step test build commit review diff search query index table"
)


# ---------------------------------------------------------------------------------------------
# bodies


def small_body(model: str = MODEL) -> bytes:
    """~220 B streamed chat request."""
    req = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Write a haiku about a gateway that routes agents."},
        ],
        "max_tokens": 16,
        "temperature": 0.0,
        "stream": True,
    }
    return json.dumps(req, separators=(",", ":")).encode()


def large_body(model: str = MODEL, target_bytes: int = 647_000) -> bytes:
    """One user message of ~``target_bytes`` of words (~140K tokens for 647 KB), streamed."""
    words = _TEXT.split()
    rng = random.Random(0)
    parts: list[str] = []
    size = 0
    budget = target_bytes - 200
    while size < budget:
        w = rng.choice(words)
        parts.append(w)
        size += len(w) + 1
    req = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(parts)}],
        "max_tokens": 16,
        "temperature": 0.0,
        "stream": True,
    }
    return json.dumps(req, separators=(",", ":")).encode()


CHARS_PER_TOKEN = 3.84
"""Characters per token of ``_TEXT``'s words through the tiny llama tokenizer (the 647 KB large
body is 168K such tokens)."""


def _words(rng: random.Random, n_chars: int) -> str:
    words = _TEXT.split()
    parts: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(words)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)


def agentic_bodies(
    sessions: int = 16,
    turns: int = 8,
    first_tokens: int = 8_000,
    last_tokens: int = 150_000,
    system_tokens: int = 6_000,
    model: str = MODEL,
    mark: str = "",
) -> list[tuple[str, bytes]]:
    """Multi-turn agent sessions as ``(session_id, body)`` in sending order (turn 1 of every
    session, then turn 2, ...). Every session starts with the same ``system_tokens`` system
    prompt; turn k resends turn k-1's messages plus an assistant reply and a tool result, so the
    context grows evenly from ``first_tokens`` to ``last_tokens`` (sized at ``CHARS_PER_TOKEN``).
    ``mark`` starts each session's first user message (the ``turns`` case's pass number).
    """
    system = _words(random.Random(0), int(system_tokens * CHARS_PER_TOKEN))
    step = (last_tokens - first_tokens) / max(1, turns - 1)
    out: list[tuple[str, list[dict]]] = []
    per_session: list[list[list[dict]]] = []
    for s in range(sessions):
        rng = random.Random(1000 + s)
        msgs: list[dict] = [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": mark + _words(rng, int((first_tokens - system_tokens) * CHARS_PER_TOKEN)),
            },
        ]
        history = [list(msgs)]
        for _ in range(1, turns):
            reply = _words(rng, 400)
            msgs.append({"role": "assistant", "content": reply})
            msgs.append({"role": "user", "content": _words(rng, int(step * CHARS_PER_TOKEN) - 400)})
            history.append(list(msgs))
        per_session.append(history)
    for t in range(turns):
        for s in range(sessions):
            out.append((f"bench-s{s}", per_session[s][t]))
    return [
        (
            sid,
            json.dumps(
                {"model": model, "messages": m, "max_tokens": 16, "temperature": 0.0, "stream": True},
                separators=(",", ":"),
            ).encode(),
        )
        for sid, m in out
    ]


@dataclass
class Bodies:
    """The bodies of every case, written once before timing: wrk reads them from files."""

    dir: Path
    requests: dict[str, list[tuple[str | None, bytes]]]
    """size -> the (session id, body) list sent in order."""
    passes: int = 0
    """The last pass base handed to wrk for the ``turns`` bodies."""

    def write(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for size, reqs in self.requests.items():
            if len(reqs) == 1 and reqs[0][0] is None:
                (self.dir / f"{size}.json").write_bytes(reqs[0][1])
                continue
            lines = []
            for i, (sid, body) in enumerate(reqs):
                path = self.dir / f"{size}-{i:04d}.json"
                path.write_bytes(body)
                lines.append(f"{path} {sid or '-'}")
            (self.dir / f"{size}.index").write_text("\n".join(lines) + "\n")

    def wrk_args(self, size: str) -> tuple[Path, list[str]]:
        """(lua script, its arguments) for ``size``. Each call for ``turns`` gets passes of its own
        (wrk numbers them from a base 10,000 above the last call's)."""
        single = self.dir / f"{size}.json"
        if single.exists():
            return WRK_SCRIPT, [str(single)]
        index = str(self.dir / f"{size}.index")
        if size != "turns":
            return WRK_BODIES_SCRIPT, [index]
        self.passes += 10_000
        return WRK_BODIES_SCRIPT, [index, PASS_MARK, str(self.passes)]

    def sizes_note(self) -> dict[str, str]:
        out = {}
        for size, reqs in self.requests.items():
            lens = [len(b) for _, b in reqs]
            sess = {sid for sid, _ in reqs if sid}
            note = f"{len(reqs)} bodies, {min(lens) / 1000:,.1f}-{max(lens) / 1000:,.1f} KB"
            if sess:
                note += f", {len(sess)} sessions (x-agent-session-id)"
            if size == "turns":
                note += (
                    "; wrk writes its pass number into each session's first user message (and its"
                    " session id): every request is a turn the gateway has not seen, whose history is"
                    " the previous turn of its session"
                )
            out[size] = note
        return out


def make_bodies(dir: Path, args: argparse.Namespace) -> Bodies:
    reqs: dict[str, list[tuple[str | None, bytes]]] = {
        "small": [(None, small_body())],
        "large": [(None, large_body())],
    }
    mix = (args.agentic_sessions, args.agentic_turns, args.agentic_first, args.agentic_last)
    if any(c.size == "agentic" for c in args.case_list) or args.write_bodies:
        reqs["agentic"] = list(agentic_bodies(*mix))
    if any(c.size == "turns" for c in args.case_list):
        reqs["turns"] = list(agentic_bodies(*mix, mark=PASS_MARK))
    return Bodies(dir, reqs)


# ---------------------------------------------------------------------------------------------
# load generators


@dataclass(frozen=True)
class Case:
    size: str
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.size}-c{self.concurrency}"

    @classmethod
    def parse(cls, text: str) -> Case:
        size, _, conc = text.partition("-c")
        if size not in ("small", "large", "agentic", "turns") or not conc.isdigit() or int(conc) < 1:
            raise ValueError(f"bad case {text!r}: expected small-cN, large-cN, agentic-cN or turns-cN")
        return cls(size, int(conc))


def run_wrk(
    url: str,
    script_args: list[str],
    concurrency: int,
    duration_s: float,
    load_core: int | None,
    script: Path = WRK_SCRIPT,
) -> dict:
    """One ``wrk`` run; latencies in ms. Raises ``RuntimeError`` when wrk prints no summary."""
    argv = [
        *pin_prefix(load_core),
        "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{duration_s:g}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
        "--",
        *script_args,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            raw = json.loads(line[len("WRK_JSON ") :])
            break
    else:
        raise RuntimeError(
            f"wrk printed no summary (rc {proc.returncode}): {proc.stderr.strip()[-500:]} "
            f"{proc.stdout.strip()[-500:]}"
        )
    out = {
        "requests": raw["requests"],
        "rps": raw["requests"] / (raw["duration_us"] / 1e6),
        "errors": sum(v for k, v in raw.items() if k.startswith("err_")),
        "wrk": raw,
    }
    if raw["requests"]:  # else no latency: nothing finished within the run
        for q in ("p50", "p90", "p99", "max"):
            out[f"{q}_ms"] = raw[f"{q}_us"] / 1000
    return out


async def _ttft_load(
    url: str, reqs: list[tuple[str | None, bytes]], concurrency: int, duration_s: float, rate: float
) -> dict:
    loop = asyncio.get_running_loop()
    seq = 0
    interval = concurrency / rate if rate > 0 else 0.0  # each worker's pace when a rate is set
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    base_headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        deadline = loop.time() + duration_s

        async def worker(phase: float) -> None:
            nonlocal errors, seq
            warm = False
            next_at = loop.time() + phase
            while loop.time() < deadline:
                if interval:
                    await asyncio.sleep(max(0.0, next_at - loop.time()))
                    next_at = max(next_at + interval, loop.time())
                sid, body = reqs[seq % len(reqs)]
                seq += 1
                headers = base_headers if sid is None else {**base_headers, "x-agent-session-id": sid}
                t0 = time.perf_counter()
                t_first = None
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        if resp.status != 200:
                            await resp.read()
                            errors += 1
                            continue
                        async for chunk in resp.content.iter_any():
                            if t_first is None and b"data:" in chunk:
                                t_first = time.perf_counter()
                    t_end = time.perf_counter()
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1
                    continue
                if t_first is None:
                    errors += 1
                elif warm:
                    ttfts.append(t_first - t0)
                    totals.append(t_end - t0)
                warm = True  # each worker's first request opens its connection: not counted

        start = time.perf_counter()
        await asyncio.gather(*(worker(interval * i / concurrency) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    ttfts.sort()
    totals.sort()
    return {
        "ttft_n": len(ttfts),
        "ttft_rps": len(ttfts) / elapsed,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000,
        "ttft_p99_ms": percentile(ttfts, 99) * 1000,
        "ttft_total_p50_ms": percentile(totals, 50) * 1000,
        "ttft_errors": errors,
    }


def run_ttft(
    url: str,
    body: bytes | list[tuple[str | None, bytes]],
    concurrency: int,
    duration_s: float,
    rate: float = 0.0,
) -> dict:
    """TTFT from ``concurrency`` workers on this process's core (uvloop when present).

    ``body``: one body, or ``(session id, body)`` pairs sent in turn (the id as
    ``x-agent-session-id`` when not None).

    ``rate`` 0: closed loop, each worker sends its next request as soon as the last one ends, so at
    saturation TTFT is mostly queueing. ``rate`` > 0: the workers together offer ``rate`` req/s
    (evenly paced, never more than ``concurrency`` in flight), which measures the per-request cost
    below saturation.
    """
    reqs: list[tuple[str | None, bytes]] = [(None, body)] if isinstance(body, bytes) else body
    load = _ttft_load(url, reqs, concurrency, duration_s, rate)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(load)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(load)


# ---------------------------------------------------------------------------------------------
# targets


@dataclass
class Target:
    name: str
    base_url: str
    ready_path: str
    proc: ManagedProcess
    owned: bool = True
    """False for ``direct``: its process is an engine, stopped with the engines."""

    @property
    def url(self) -> str:
        return self.base_url + CHAT_PATH


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    engines: list[ManagedProcess] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def server_core(self) -> int | None:
        return None if self.args.no_pin else self.args.server_core

    def port(self, offset: int) -> int:
        return int(self.args.port_base) + offset

    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port(o)}" for o in ENGINE_OFFSETS]

    def spawn(self, name: str, argv: list[str], port: int, cwd: str | None = None) -> ManagedProcess:
        if not port_is_free(port):
            raise RuntimeError(f"port {port} is in use (choose another --port-base)")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return ManagedProcess(name, [*pin_prefix(self.server_core), *argv], self.workdir, env=env, cwd=cwd)

    def start_engines(self) -> None:
        for i, url in enumerate(self.engine_urls()):
            port = int(url.rsplit(":", 1)[1])
            argv = [sys.executable, "-m", "testing.fake_engine", "--port", str(port), "--model", MODEL]
            self.engines.append(self.spawn(f"fake{i}", argv, port))
        for url, proc in zip(self.engine_urls(), self.engines, strict=True):
            wait_http_ok(url + "/health", 15, proc.proc)

    def start_target(self, name: str) -> None:
        starters: dict[str, Callable[[], tuple[list[str], int, str] | str]] = {
            "gateway": lambda: self._gateway_argv("gateway", tokenizer=True),
            "gateway-notok": lambda: self._gateway_argv("gateway-notok", tokenizer=False),
            "gateway-base": lambda: self._gateway_argv("gateway-base", tokenizer=True),
            "naive": self._naive_argv,
            "vllm-router-rr": lambda: self._vllm_router_argv("vllm-router-rr", "round_robin"),
            "vllm-router-ca": lambda: self._vllm_router_argv("vllm-router-ca", "cache_aware"),
        }
        if name == "direct":
            url = self.engine_urls()[0]
            self.targets.append(Target("direct", url, "/health", self.engines[0], owned=False))
            return
        got = starters[name]()
        if isinstance(got, str):
            self.skipped[name] = got
            print(f"[overhead] skipping {name}: {got}", file=sys.stderr)
            return
        argv, port, ready_path = got
        cwd = str(Path(self.args.base_src).resolve()) if name == "gateway-base" else None
        proc = self.spawn(name, argv, port, cwd)
        target = Target(name, f"http://127.0.0.1:{port}", ready_path, proc)
        try:
            wait_http_ok(target.base_url + ready_path, self.args.ready_timeout, proc.proc)
        except RuntimeError as exc:
            tail = proc.log_tail()
            proc.stop()
            raise RuntimeError(
                f"{name} did not become ready: {exc}\n--- {proc.log_path} ---\n{tail}"
            ) from exc
        self.targets.append(target)

    def _gateway_argv(self, name: str, tokenizer: bool) -> tuple[list[str], int, str] | str:
        port = self.port(TARGET_OFFSETS[name])
        config = self.workdir / f"{name}.yaml"
        models = ""
        if tokenizer:
            models = (
                f'models:\n  - {{name: {MODEL}, tokenizer: "{self.tokenizer_dir()}"}}\n'
                f"analysis: {{mode: {self.args.analysis_mode}}}\n"
            )
        engines = "\n".join(
            f'      - {{name: fake{i}, url: "{url}", model: {MODEL}}}'
            for i, url in enumerate(self.engine_urls())
        )
        config.write_text(
            f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "pools:\n"
            "  - name: warm\n"
            "    role: any\n"
            "    engines:\n"
            f"{engines}\n" + models
        )
        if name == "gateway-base":
            src = self.args.base_src
            if not src or not (Path(src) / "gateway" / "__main__.py").exists():
                return "gateway-base needs --base-src DIR (a checkout of the baseline commit)"
            # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: run it
            # from the baseline checkout, or it imports this tree's gateway (as it did before)
            root = Path(src).resolve()
            argv = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
            probe = [sys.executable, "-c", "import gateway; print(gateway.__file__)"]
            env = dict(os.environ, PYTHONPATH=str(root))
            got = subprocess.run(probe, env=env, cwd=root, capture_output=True, text=True, check=False)
            if not got.stdout.strip().startswith(str(root)):
                return f"gateway-base would import {got.stdout.strip() or got.stderr.strip()}, not {root}"
            return ["env", f"PYTHONPATH={root}", *argv], port, "/ready"
        if self.args.gateway_cmd:
            fmt = {"config": str(config), "port": str(port), "python": sys.executable}
            return [tok.format(**fmt) for tok in shlex.split(self.args.gateway_cmd)], port, "/ready"
        if not (REPO / "gateway" / "__main__.py").exists():
            return "gateway/__main__.py does not exist yet (or pass --gateway-cmd)"
        return [sys.executable, "-m", "gateway", "serve", "--config", str(config)], port, "/ready"

    def tokenizer_dir(self) -> Path:
        """The tiny llama model (tokenizer.json + chat template), built once into a cache dir."""
        from gateway.local.tiny_model import build_tiny_model

        return build_tiny_model(self.args.tokenizer_dir, "llama")

    def _naive_argv(self) -> tuple[list[str], int, str]:
        port = self.port(TARGET_OFFSETS["naive"])
        argv = [sys.executable, "-m", "benchmarks.naive_proxy", "--port", str(port)]
        for url in self.engine_urls():
            argv += ["--backend", url]
        return argv, port, "/ready"

    def _vllm_router_argv(self, name: str, policy: str) -> tuple[list[str], int, str] | str:
        binary = self.args.vllm_router_bin
        if not binary or not Path(binary).exists():
            return (
                "no vllm-router executable (pip install vllm-router into a separate venv, "
                "e.g. .bench-venv, or pass --vllm-router-bin)"
            )
        port = self.port(TARGET_OFFSETS[name])
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 500)]
        argv += ["--log-level", "warning", "--worker-urls", *self.engine_urls()]
        return argv, port, "/health"

    def stop_all(self) -> None:
        for t in self.targets:
            if t.owned:
                t.proc.stop()
        for e in self.engines:
            e.stop()


def _default_vllm_router_bin() -> str:
    env = os.environ.get("AGENTGW_VLLM_ROUTER_BIN")
    if env:
        return env
    local = REPO / ".bench-venv" / "bin" / "vllm-router"
    if local.exists():
        return str(local)
    return shutil.which("vllm-router") or ""


# ---------------------------------------------------------------------------------------------
# measuring and reporting


def measure(bench: Bench, target: Target, case: Case, bodies: Bodies, rep: int) -> dict:
    args = bench.args
    load_core = None if args.no_pin else args.load_core
    pid = target.proc.pid
    spy = None
    if args.py_spy and target.name in args.py_spy_targets:
        spy = start_py_spy(
            pid, args.py_spy / f"{target.name}-{case.name}-r{rep}.txt", args.duration, load_core
        )
    gateway = target.name.startswith("gateway")
    skipped0 = analysis_skipped(target.base_url) if gateway else {}
    cpu0, own0 = cpu_seconds(pid), cpu_seconds(pid, descendants=False)
    row: dict = {"target": target.name, "case": case.name}
    script, arg = bodies.wrk_args(case.size)
    row.update(run_wrk(target.url, arg, case.concurrency, args.duration, load_core, script))
    if row["requests"]:
        row["cpu_us_per_req"] = (cpu_seconds(pid) - cpu0) / row["requests"] * 1e6
        row["cpu_main_us_per_req"] = (cpu_seconds(pid, descendants=False) - own0) / row["requests"] * 1e6
        if gateway:  # the analysis worker processes (every turns request is a cold turn)
            row["cpu_workers_us_per_req"] = row["cpu_us_per_req"] - row["cpu_main_us_per_req"]
        if gateway:  # routed on the approximate index (analysis skipped: backlog, budget, ...)
            skipped = analysis_skipped(target.base_url)
            row["approx_by_reason"] = {k: v - skipped0.get(k, 0.0) for k, v in skipped.items()}
            row["approx_pct"] = sum(row["approx_by_reason"].values()) / row["requests"] * 100
            if target.name == "gateway-notok":  # no tokenizer: every request, uncounted
                row["approx_pct"] = 100.0
    if spy is not None:
        spy.wait(60)
    if case.concurrency in args.ttft_conc:
        reqs = bodies.requests[case.size]
        row.update(run_ttft(target.url, reqs, case.concurrency, args.duration, args.ttft_rate))
    row["peak_rss_mib"] = peak_rss_kib(pid) / 1024
    if target.proc.proc.poll() is not None:
        raise RuntimeError(f"{target.name} exited during {case.name}:\n{target.proc.log_tail()}")
    return row


def analysis_skipped(base_url: str) -> dict[str, float]:
    """The gateway's ``agentgw_analysis_skipped_total`` by reason (empty when not exposed)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("agentgw_analysis_skipped_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else "?"
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def start_py_spy(pid: int, out: Path, duration_s: float, core: int | None) -> subprocess.Popen[bytes]:
    """Sample ``pid`` (without pausing it) for ``duration_s``; collapsed stacks go to ``out``."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [*pin_prefix(core), exe, "record", "--pid", str(pid), "--duration", str(max(1, int(duration_s)))]
    argv += ["--rate", "250", "--nonblocking", "--subprocesses", "--function", "--format", "raw"]
    argv += ["-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def hot_spots(collapsed: Path, n: int = 15) -> str:
    """Top functions of a py-spy collapsed-stack file, by own samples and by inclusive samples."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
    if not total:
        return f"{collapsed}: no samples"
    lines = [f"{collapsed.name}: {total} samples"]
    for title, table in (("own", own), ("inclusive", incl)):
        lines.append(f"  top {n} by {title} time:")
        for frame, k in sorted(table.items(), key=lambda kv: -kv[1])[:n]:
            lines.append(f"    {100 * k / total:5.1f}%  {frame}")
    return "\n".join(lines)


_METRICS = (
    "p50_ms",
    "p99_ms",
    "rps",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "cpu_us_per_req",
    "cpu_main_us_per_req",
    "cpu_workers_us_per_req",
    "peak_rss_mib",
    "errors",
    "approx_pct",
)


def summarize(runs: list[dict], targets: list[str], cases: list[Case]) -> list[dict]:
    """Median over repeats of each metric per (target, case), plus the differences to ``direct``."""
    rows = []
    for case in cases:
        for name in targets:
            group = [r for r in runs if r["target"] == name and r["case"] == case.name]
            if not group:
                continue
            row: dict = {"target": name, "case": case.name, "repeats": len(group)}
            for m in _METRICS:
                vals = [r[m] for r in group if m in r and not math.isnan(r[m])]
                if vals:
                    row[m] = statistics.median(vals) if m != "peak_rss_mib" else max(vals)
            row["errors"] = sum(r.get("errors", 0) + r.get("ttft_errors", 0) for r in group)
            rows.append(row)
    direct = {r["case"]: r for r in rows if r["target"] == "direct"}
    for row in rows:
        base = direct.get(row["case"])
        if base is None or row["target"] == "direct":
            continue
        for m in ("p50_ms", "ttft_p50_ms", "ttft_p99_ms"):
            if m in row and m in base:
                row["added_" + m] = row[m] - base[m]
    return rows


def target_setup(name: str, args: argparse.Namespace) -> str:
    """What ``name`` ran, in words (printed under the table and stored in the JSON)."""
    if name == "direct":
        return "engine 0 itself (testing.fake_engine), no router"
    if name == "gateway":
        return (
            f"agentgw, profile agentic, tokenizer ON (tiny llama, analysis.mode {args.analysis_mode} "
            "with the default thresholds: under 2,048 chars on the loop (the small body), under "
            "16,384 in a thread, else a worker process gets the raw body and answers with counts "
            "and block hashes (no token ids: no engine has a control_url); exact vLLM block "
            "hashes, block 128), hints ON for agentic and turns bodies "
            "(x-agent-session-id; small/large send none), KV events OFF: the prefix index is "
            "updated from routing decisions (as vllm-router cache_aware)"
        )
    if name == "gateway-base":
        return (
            f"the gateway row's configuration run from --base-src {args.base_src} "
            "(the baseline commit, for a same-run before/after)"
        )
    if name == "gateway-notok":
        return (
            "agentgw, profile agentic, tokenizer OFF (approximate index: 512-char text chunks, "
            "updated from routing; the small body is under one chunk), hints as the bodies send "
            "them, KV events OFF"
        )
    if name == "vllm-router-ca":
        return "vllm-router 0.1.17 --policy cache_aware (char radix tree updated on every request)"
    if name == "vllm-router-rr":
        return "vllm-router 0.1.17 --policy round_robin"
    if name == "naive":
        return "benchmarks.naive_proxy (FastAPI + httpx + StreamingResponse, round robin)"
    return name


def render_ratios(rows: list[dict]) -> str:
    """gateway against vllm-router cache_aware (and the naive proxy) per case, in the same run."""
    by = {(r["target"], r["case"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    head = "| case | ours | vs | req/s ratio | p50 ratio | p99 ratio | TTFT p50 ratio |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for ours in ("gateway", "gateway-base", "gateway-notok"):
        for peer in ("vllm-router-ca", "naive", "gateway-base"):
            if peer == ours or (peer == "gateway-base" and ours != "gateway"):
                continue
            for case in cases:
                a, b = by.get((ours, case)), by.get((peer, case))
                if a is None or b is None:
                    continue

                def ratio(m: str, a: dict = a, b: dict = b) -> str:
                    x, y = a.get(m), b.get(m)
                    return f"{x / y:.2f}" if x is not None and y else "-"

                lines.append(
                    f"| {case} | {ours} | {peer} | {ratio('rps')} | {ratio('p50_ms')} | "
                    f"{ratio('p99_ms')} | {ratio('ttft_p50_ms')} |"
                )
    return "\n".join(lines)


def _fmt(v: float | None, nd: int = 2) -> str:
    if v is None or math.isnan(v):
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def render_table(rows: list[dict]) -> str:
    head = (
        "| target | case | p50 ms | p99 ms | req/s | +p50 ms | TTFT p50 | TTFT p99 | +TTFT p50 | "
        "+TTFT p99 | CPU us/req | of it main process | of it analysis workers | approx % | peak RSS MiB | errors |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["target"],
                    r["case"],
                    _fmt(r.get("p50_ms")),
                    _fmt(r.get("p99_ms")),
                    _fmt(r.get("rps"), 0),
                    _fmt(r.get("added_p50_ms")),
                    _fmt(r.get("ttft_p50_ms")),
                    _fmt(r.get("ttft_p99_ms")),
                    _fmt(r.get("added_ttft_p50_ms")),
                    _fmt(r.get("added_ttft_p99_ms")),
                    _fmt(r.get("cpu_us_per_req"), 0),
                    _fmt(r.get("cpu_main_us_per_req"), 0),
                    _fmt(r.get("cpu_workers_us_per_req"), 0),
                    _fmt(r.get("approx_pct"), 0),
                    _fmt(r.get("peak_rss_mib"), 0),
                    str(r.get("errors", 0)),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def machine_notes() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False).stdout.split(
        "\n"
    )[0]
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "gateway"], capture_output=True, text=True, check=False
    )
    return {
        "gateway_commit": head.stdout.strip()
        + (" + uncommitted gateway/ changes" if dirty.stdout.strip() else ""),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "wrk": wrk_version.strip(),
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead",
        description="Gateway overhead: direct to a fake engine vs through the gateway (and peers).",
    )
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk / TTFT run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per (target, case); medians reported")
    ap.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma list of {ALL_CASES}")
    ap.add_argument("--ttft-conc", default="1,64", help="concurrencies that also get a TTFT run")
    ap.add_argument("--targets", default="direct,gateway", help="direct, gateway, naive, vllm-router-rr/-ca")
    ap.add_argument("--peers", default="", help="add peers: naive, vllm-router (both policies)")
    ap.add_argument("--gateway-cmd", default="", help="override; {config}, {port}, {python} are filled in")
    ap.add_argument(
        "--base-src",
        default="",
        help="target gateway-base: the gateway row's config run from this checkout (e.g. git worktree of main)",
    )
    ap.add_argument("--vllm-router-bin", default=_default_vllm_router_bin())
    ap.add_argument(
        "--port-base", type=int, default=24000, help="engines at +1, +2; routers at +100..+120 (+610, +611)"
    )
    ap.add_argument("--load-core", type=int, default=0)
    ap.add_argument("--server-core", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    ap.add_argument("--ready-timeout", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of discarded load per target")
    ap.add_argument(
        "--ttft-rate", type=float, default=0.0, help="TTFT client: offered req/s (0: closed loop)"
    )
    ap.add_argument("--py-spy", type=Path, help="profile targets during wrk runs; stacks go in this folder")
    ap.add_argument("--py-spy-targets", default="gateway", help="comma list of targets to profile")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    ap.add_argument("--write-bodies", type=Path, help="write every case's bodies here and exit")
    ap.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "agentgw-bench-tiny-llama",
        help="where the tiny llama model (the gateway target's tokenizer) is built once",
    )
    ap.add_argument(
        "--analysis-mode", default="process", help="gateway's analysis.mode (its default: process)"
    )
    ap.add_argument("--agentic-sessions", type=int, default=16, help="sessions of the agentic mix")
    ap.add_argument("--agentic-turns", type=int, default=8, help="turns per session")
    ap.add_argument("--agentic-first", type=int, default=8_000, help="first turn's tokens")
    ap.add_argument("--agentic-last", type=int, default=150_000, help="last turn's tokens")
    args = ap.parse_args(argv)
    args.case_list = [Case.parse(c) for c in args.cases.split(",") if c]
    args.ttft_conc = {int(c) for c in args.ttft_conc.split(",") if c}
    args.py_spy_targets = {t for t in args.py_spy_targets.split(",") if t}
    names = [t for t in args.targets.split(",") if t]
    for peer in (p for p in args.peers.split(",") if p):
        if peer not in PEERS:
            ap.error(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
        names += PEERS[peer]
    known = {"direct", *TARGET_OFFSETS}
    if args.write_bodies:
        args.case_list.append(Case("agentic", 1))
    for n in names:
        if n not in known:
            ap.error(f"unknown target {n!r}; known: {', '.join(sorted(known))}")
    if "direct" not in names:
        names.insert(0, "direct")
    args.target_names = list(dict.fromkeys(names))
    if (os.cpu_count() or 1) < 2 and not args.no_pin:
        print("[overhead] fewer than 2 cores: not pinning", file=sys.stderr)
        args.no_pin = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agentgw-overhead-") as tmp:
        workdir = Path(tmp)
        bodies = make_bodies(args.write_bodies or workdir / "bodies", args)
        bodies.write()
        if args.write_bodies:
            print(f"wrote {', '.join(bodies.requests)} bodies into {bodies.dir}")
            return 0
        if shutil.which("wrk") is None:
            print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
            return 2
        notes = machine_notes()
        if not args.no_pin:
            os.sched_setaffinity(0, {args.load_core})  # the TTFT client runs in this process
        bench = Bench(args, workdir)
        runs: list[dict] = []
        try:
            bench.start_engines()
            for name in args.target_names:
                bench.start_target(name)
            load_core = None if args.no_pin else args.load_core
            if args.warmup > 0:
                for t in bench.targets:
                    for size, conc in (("small", 16), ("large", 4), ("agentic", 4), ("turns", 4)):
                        if size in bodies.requests:
                            script, arg = bodies.wrk_args(size)
                            run_wrk(t.url, arg, conc, args.warmup, load_core, script)
            targets = bench.targets
            for rep in range(args.repeat):
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for case in args.case_list:
                    for t in order:
                        row = measure(bench, t, case, bodies, rep)
                        row["repeat"] = rep
                        runs.append(row)
                        print(
                            f"[overhead] rep {rep} {t.name:>15} {case.name:>10}: "
                            f"p50 {row.get('p50_ms', nan):.2f} ms p99 {row.get('p99_ms', nan):.2f} ms "
                            f"{row['rps']:,.0f} req/s"
                            + (
                                f", approx {row['approx_pct']:.0f}% {row['approx_by_reason']}"
                                if "approx_pct" in row
                                else ""
                            )
                            + (f", TTFT p50 {row['ttft_p50_ms']:.2f} ms" if "ttft_p50_ms" in row else ""),
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            bench.stop_all()
        notes["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
        rows = summarize(runs, [t.name for t in bench.targets], args.case_list)
        print(render_table(rows))
        print()
        print(render_ratios(rows))
        print()
        approx = [f"{r['target']} {r['case']} {r['approx_pct']:.0f}%" for r in rows if "approx_pct" in r]
        if approx:
            print("routed on the approximate index (analysis skipped), median share: " + ", ".join(approx))
            print()
        sizes = bodies.sizes_note()
        print("what each row ran:")
        for t in bench.targets:
            print(f"  {t.name}: {target_setup(t.name, args)}")
        for case in dict.fromkeys(c.size for c in args.case_list):
            print(f"  {case} bodies: {sizes[case]}")
        for t in bench.targets:
            peak = max((r["peak_rss_mib"] for r in runs if r["target"] == t.name), default=0.0)
            print(f"peak RSS {t.name}: {peak:.0f} MiB")
        if args.py_spy:
            for path in sorted(args.py_spy.glob("*.txt")):
                print(hot_spots(path))
        for name, why in bench.skipped.items():
            print(f"skipped {name}: {why}")
        print(f"gateway at {notes['gateway_commit']}")
        print(
            f"machine: {notes['cpu']}, {notes['cores']} cores, load avg {' '.join(notes['loadavg_start'])} "
            f"-> {' '.join(notes['loadavg_end'])}; {notes['wrk']}; duration {args.duration:g} s x "
            f"{args.repeat} repeats; pinned: {'no' if args.no_pin else f'load core {args.load_core}, servers core {args.server_core}'}"
        )
        if args.json:
            out = {
                "command": " ".join(
                    shlex.quote(a)
                    for a in [sys.executable, "-m", "benchmarks.overhead", *(argv or sys.argv[1:])]
                ),
                "machine": notes,
                "bodies": bodies.sizes_note(),
                "setup": {t.name: target_setup(t.name, args) for t in bench.targets},
                "summary": rows,
                "runs": runs,
                "skipped": bench.skipped,
            }
            args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
