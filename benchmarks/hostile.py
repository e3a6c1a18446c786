"""Hostile clients against `agentgw serve`: the gateway's memory and liveness while thousands of
sockets misbehave, phase by phase, against the quiet gateway of the same run.

The gateway runs as a subprocess in front of a stand-in engine (testing/fake_engine.py) with the
server limits of ``server.*`` set short (``--header-timeout``, ``--body-timeout``, ``--keep-alive``,
``--max-connections``) and a small ``limits.max_buffered_body_bytes`` (``--body-budget-mib``). The
phases, one after the other:

- quiet: a few normal chat requests, then nothing (the baseline);
- idle: ``--idle`` sockets connect and send nothing (each must get a 408 at the header timeout);
- keepalive: ``--idle`` sockets send one ``GET /health``, read the answer, then idle (each must be
  closed by the server at the keep-alive timeout);
- slowloris: ``--slowloris`` sockets send a request line, then a header byte every 0.5 s (408);
- oversize: ``--oversize`` requests with a 1 MiB header, 32 at a time (431, cut at the limit);
- half-bodies: ``--half-bodies`` chat requests announce ``--body-mib`` MiB, send all but the last
  byte at once, then stop (408 at the body timeout; past the body budget a 503 at once);
- announced: ``--announced`` chat requests announce ``--body-mib`` MiB and send one byte (408 at
  the body timeout; they hold the bytes sent, not the ones announced: the normal chat requests of
  the phase must all be answered 200);
- slow-bodies: ``--slowloris`` requests announce 1,000 body bytes and send one a second (408);
- flood: ``--max-connections`` + ``--flood-extra`` sockets connect and idle (the extra ones get a
  503 ``too_many_connections`` but for the ``--probe-reserve`` kept for ``/health`` and ``/ready``;
  the rest their 408);
- after: every hostile socket gone, normal requests again.

Reported per phase: the sockets' outcomes (the status the server answered, or closed without an
answer, or still open at the phase's end: a violation), the gateway's RSS (``VmRSS`` of the gateway
process) at the phase's peak and end, ``/health`` probes answered (a fresh connection every 0.25 s,
and one kept-alive connection opened before the phase) and their p50 latency, and normal chat
requests answered 200 during the phase. ``--json`` writes the report; the exit status is 1 when an
invariant is violated (a socket left open past its timeout, ``/health`` unanswered on its kept
connection, normal requests failing after the attack, RSS after the attack more than
``--rss-slack-mib`` above the quiet gateway's, or, with ``--rounds`` 2 or more, the last round
ending more than 16 MiB above the first: memory must be bounded, not grow with each attack).

    python -m benchmarks.hostile --idle 3000 --slowloris 500 --half-bodies 64 --body-mib 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks._common import free_port, percentile, wait_http_ok

ROOT = Path(__file__).resolve().parents[1]
MODEL = "hostile-model"
HOST = "127.0.0.1"
CHAT = (
    b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
)


def rss_mib(pid: int) -> float:
    """The process's resident set (``VmRSS``), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# -- one hostile socket ---------------------------------------------------------------------------
Behaviour = Callable[[asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


async def hostile(port: int, behave: Behaviour, wait_s: float, opened: Callable[[], None]) -> str:
    """Connect, run ``behave`` (it writes; ``closed`` is set once the server closes), then wait
    up to ``wait_s`` for the server's answer and close. Returns the outcome: the status code the
    server answered, ``closed`` (no answer), ``open`` (still open at the end), ``connect failed``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 30)
    except (OSError, TimeoutError):
        return "connect failed"
    opened()
    closed = asyncio.Event()
    got = bytearray()

    async def read() -> None:
        try:
            while part := await reader.read(65536):
                if len(got) < 64:
                    got.extend(part[:64])
        except OSError:
            pass
        finally:
            closed.set()

    reading = asyncio.create_task(read())
    try:
        with contextlib.suppress(OSError):
            await behave(writer, closed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closed.wait(), wait_s)
    finally:
        reading.cancel()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    if not closed.is_set():
        return "open"
    if got.startswith(b"HTTP/1.1 "):
        return got[9:12].decode()
    return "closed"


async def send_nothing(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
    return None


async def one_health_then_idle(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    await w.drain()


async def slow_headers(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    while not closed.is_set():
        w.write(b"x")
        await w.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closed.wait(), 0.5)


def oversize_header(mib: float) -> Behaviour:
    value = b"a" * int(mib * 2**20)

    async def behave(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nx-big: ")
        for i in range(0, len(value), 65536):
            if closed.is_set():
                return
            w.write(value[i : i + 65536])
            await w.drain()
        w.write(b"\r\n\r\n")
        await w.drain()

    return behave


def half_body(mib: float) -> Behaviour:
    size = int(mib * 2**20)
    piece = b"x" * 65536

    async def behave(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % size
        )
        left = size - 1  # all but the last byte, then silence
        while left > 0 and not closed.is_set():
            n = min(left, len(piece))
            w.write(piece[:n])
            left -= n
            await w.drain()

    return behave


def announced_body(mib: float) -> Behaviour:
    """Announce a ``mib`` MiB body, send one byte, then nothing: costs the client no bandwidth."""
    size = int(mib * 2**20)

    async def behave(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n{" % size
        )
        await w.drain()

    return behave


async def slow_body(w: asyncio.StreamWriter, closed: asyncio.Event) -> None:
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 1000\r\n\r\n")
    while not closed.is_set():
        w.write(b"x")
        await w.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closed.wait(), 1.0)


# -- the gateway's liveness -----------------------------------------------------------------------
PROBE_WAIT_S = 15.0
"""How long a probe waits for its connection or answer before it counts as unanswered (a bound
on a loaded machine, not a latency target: the latency is reported)."""


async def _health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, close: bool) -> bool:
    conn = b"connection: close\r\n" if close else b""
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n" + conn + b"\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    await _read_body(reader, head)
    return head.startswith(b"HTTP/1.1 200")


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The body after ``head``: by ``content-length``, else chunked."""
    lines = [x.lower() for x in head.split(b"\r\n")]
    for line in lines:
        if line.startswith(b"content-length:"):
            return await reader.readexactly(int(line.split(b":", 1)[1]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        body += (await reader.readexactly(size + 2))[:size]
        if size == 0:
            return body


@dataclass
class Liveness:
    """``/health`` on a fresh connection every ``every_s`` and on one kept-alive connection, and a
    normal chat request every ``every_s``, until stopped."""

    port: int
    keep_alive_s: float = 5.0
    """The server's idle keep-alive timeout: the kept connection is renewed before it (a client
    too busy to probe in time would otherwise see the server close it, which is no failure)."""
    every_s: float = 0.25
    fresh: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)
    chat: Counter[str] = field(default_factory=Counter)
    fresh_s: list[float] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        await asyncio.gather(self._fresh(), self._kept(), self._chat())

    async def _fresh(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection(HOST, self.port), PROBE_WAIT_S)
                try:
                    ok = await asyncio.wait_for(_health(r, w, close=True), PROBE_WAIT_S)
                finally:
                    w.close()
                self.fresh["200" if ok else "not 200"] += 1
                if ok:
                    self.fresh_s.append(time.monotonic() - t0)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                self.fresh[type(exc).__name__] += 1
            await self._pause()

    async def _kept(self) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        last = time.monotonic()
        while not self.stop.is_set():
            try:
                if conn is not None and time.monotonic() - last > self.keep_alive_s / 2:
                    conn[1].close()  # idle for long: renewed, as a pooling client does
                    conn = None
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(HOST, self.port), PROBE_WAIT_S)
                last = time.monotonic()  # before the request: the server's idle timer starts later
                ok = await asyncio.wait_for(_health(*conn, close=False), PROBE_WAIT_S)
                self.kept["200" if ok else "not 200"] += 1
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                self.kept[type(exc).__name__] += 1
                if conn is not None:
                    conn[1].close()
                conn = None
            await self._pause()
        if conn is not None:
            conn[1].close()

    async def _chat(self) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        req = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
        )
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(HOST, self.port), PROBE_WAIT_S)
                r, w = conn
                w.write(req)
                await w.drain()
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), PROBE_WAIT_S)
                await asyncio.wait_for(_read_body(r, head), PROBE_WAIT_S)
                self.chat[head[9:12].decode()] += 1
                if b"\r\nconnection: close" in head.lower():  # a refusal closes the connection
                    w.close()
                    conn = None
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                self.chat[type(exc).__name__] += 1
                if conn is not None:
                    conn[1].close()
                conn = None
            await self._pause()
        if conn is not None:
            conn[1].close()

    async def _pause(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), self.every_s)


# -- phases ---------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    sockets: int
    behave: Behaviour | None
    wait_s: float
    """How long a socket may wait for the server's answer after behaving (its timeout + slack)."""
    concurrency: int = 0
    """0: all at once; else at most this many sockets at a time."""
    hold_s: float = 0.0
    """Phases without sockets: how long to watch."""


async def run_phase(ph: Phase, port: int, pid: int, keep_alive_s: float) -> dict[str, Any]:
    live = Liveness(port, keep_alive_s)
    live_task = asyncio.create_task(live.run())
    await asyncio.sleep(0.3)  # the kept connection is open before the attack
    rss_peak = rss_mib(pid)
    opened = 0

    def on_open() -> None:
        nonlocal opened
        opened += 1

    outcomes: Counter[str] = Counter()
    t0 = time.monotonic()
    if ph.behave is not None and ph.sockets:
        gate = asyncio.Semaphore(ph.concurrency or ph.sockets)
        behave = ph.behave

        async def one() -> str:
            async with gate:
                return await hostile(port, behave, ph.wait_s, on_open)

        tasks = [asyncio.create_task(one()) for _ in range(ph.sockets)]
        pending: set[asyncio.Task[str]] = set(tasks)
        while pending:
            _done, pending = await asyncio.wait(pending, timeout=0.2)
            rss_peak = max(rss_peak, rss_mib(pid))
        outcomes.update(t.result() for t in tasks)
    else:
        end = t0 + ph.hold_s
        while time.monotonic() < end:
            await asyncio.sleep(0.2)
            rss_peak = max(rss_peak, rss_mib(pid))
    wall = time.monotonic() - t0
    live.stop.set()
    await live_task
    lat = sorted(live.fresh_s)
    return {
        "phase": ph.name,
        "sockets": ph.sockets,
        "outcomes": dict(sorted(outcomes.items())),
        "wall_s": round(wall, 1),
        "rss_peak_mib": round(max(rss_peak, rss_mib(pid)), 1),
        "rss_end_mib": round(rss_mib(pid), 1),
        "health_fresh": dict(live.fresh),
        "health_kept": dict(live.kept),
        "health_fresh_p50_ms": round(percentile(lat, 50) * 1000, 1) if lat else None,
        "chat": dict(live.chat),
    }


ATTACKS = ("idle", "keepalive", "slowloris", "oversize", "half-bodies", "announced", "slow-bodies", "flood")


def phases(a: argparse.Namespace) -> list[Phase]:
    """quiet, the attacks chosen (``--only``) ``--rounds`` times (a later round's name says its
    number: memory that grew in round 1 and not again in round 2 is bounded), after."""
    slack = 10.0
    attacks = {
        "idle": Phase("idle", a.idle, send_nothing, a.header_timeout + slack),
        "keepalive": Phase("keepalive", a.idle, one_health_then_idle, a.keep_alive + slack),
        "slowloris": Phase("slowloris", a.slowloris, slow_headers, a.header_timeout + slack),
        "oversize": Phase("oversize", a.oversize, oversize_header(1.0), slack, concurrency=32),
        "half-bodies": Phase("half-bodies", a.half_bodies, half_body(a.body_mib), a.body_timeout + slack),
        "announced": Phase("announced", a.announced, announced_body(a.body_mib), a.body_timeout + slack),
        "slow-bodies": Phase("slow-bodies", a.slowloris, slow_body, a.body_timeout + slack),
        "flood": Phase("flood", a.max_connections + a.flood_extra, send_nothing, a.header_timeout + slack),
    }
    chosen = [n for n in ATTACKS if not a.only or n in a.only]
    out = [Phase("quiet", 0, None, 0, hold_s=a.quiet_s)]
    for r in range(a.rounds):
        for n in chosen:
            ph = attacks[n]
            out.append(
                ph if r == 0 else Phase(f"{n}#{r + 1}", ph.sockets, ph.behave, ph.wait_s, ph.concurrency)
            )
    out.append(Phase("after", 0, None, 0, hold_s=a.quiet_s))
    return out


EXPECTED = {
    "idle": {"408"},
    "keepalive": {"200"},
    "slowloris": {"408", "closed"},
    "oversize": {"431", "closed"},
    "half-bodies": {"408", "503", "closed"},
    "announced": {"408"},
    "slow-bodies": {"408", "closed"},
    "flood": {"408", "503"},
}
"""Each phase's acceptable outcomes. keepalive: the 200 was read, then the server closed the idle
connection (any socket still open at the phase's end is ``open``, a violation). slowloris,
oversize, half-bodies, slow-bodies: the 408 / 431 / 503, or a reset that lost it (the server
answers and closes while the client is still sending, so its TCP stack may send a RST that
discards the answer before the client reads it)."""


def violations(report: dict[str, Any], rss_slack_mib: float) -> list[str]:
    out = []
    rows = {r["phase"]: r for r in report["phases"]}
    for r in report["phases"]:
        ok = EXPECTED.get(r["phase"].split("#")[0])
        bad = {k: v for k, v in r["outcomes"].items() if ok is not None and k not in ok}
        if bad:
            out.append(f"{r['phase']}: unexpected outcomes {bad}")
    for r in report["phases"]:
        if set(r["health_kept"]) - {"200"} or not r["health_kept"]:
            out.append(f"{r['phase']}: /health on the kept connection {r['health_kept']}")
    for name in ("quiet", "after", "announced"):
        # announced bodies hold what was sent, not what was announced: others are served
        r = rows.get(name)
        if r is None:
            continue
        if set(r["chat"]) - {"200"} or not r["chat"]:
            out.append(f"{name}: chat requests {r['chat']}")
        if set(r["health_fresh"]) - {"200"} or not r["health_fresh"]:
            out.append(f"{name}: /health on fresh connections {r['health_fresh']}")
    for r in report["phases"]:
        flood = r["outcomes"].get("503", 0)
        past = report["flood_extra"] - report.get("probe_reserve", 0)  # the reserve's get their 408
        if r["phase"].startswith("flood") and flood < past:
            out.append(
                f"{r['phase']}: {flood} connection(s) refused with 503, {past} past the cap and reserve"
            )
    growth = rows["after"]["rss_end_mib"] - rows["quiet"]["rss_end_mib"]
    if growth > rss_slack_mib:
        out.append(f"RSS after the attack {growth:.1f} MiB above the quiet gateway's")
    # rounds: what the first round left in memory, a later one must not add to
    ends = [r["rss_end_mib"] for r in report["phases"] if r["phase"].startswith("flood")]
    if len(ends) > 1 and ends[-1] - ends[0] > ROUND_SLACK_MIB:
        out.append(f"RSS grew {ends[-1] - ends[0]:.1f} MiB from the first round's end to the last's")
    return out


ROUND_SLACK_MIB = 16.0
"""RSS a later round of the attacks may add to the first round's (allocator noise)."""


def table(report: dict[str, Any]) -> str:
    lines = [
        "| phase | sockets | outcomes | RSS peak / end (MiB) | /health fresh | /health kept | "
        "/health p50 (ms) | chat |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(d: dict[str, int]) -> str:
        return ", ".join(f"{k}: {v}" for k, v in d.items()) or "-"

    for r in report["phases"]:
        lines.append(
            f"| {r['phase']} | {r['sockets']} | {fmt(r['outcomes'])} | {r['rss_peak_mib']} / "
            f"{r['rss_end_mib']} | {fmt(r['health_fresh'])} | {fmt(r['health_kept'])} | "
            f"{r['health_fresh_p50_ms']} | {fmt(r['chat'])} |"
        )
    return "\n".join(lines)


def _raise_fd_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hostile", description=__doc__.split("\n")[0])
    ap.add_argument("--idle", type=int, default=3000, help="idle sockets (idle and keepalive phases)")
    ap.add_argument("--slowloris", type=int, default=500, help="slow header senders (and slow bodies)")
    ap.add_argument("--oversize", type=int, default=200, help="requests with a 1 MiB header")
    ap.add_argument("--half-bodies", type=int, default=64, help="requests that stop before the body's end")
    ap.add_argument("--body-mib", type=float, default=16.0, help="body size they announce")
    ap.add_argument(
        "--announced", type=int, default=64, help="requests that announce a body and send one byte"
    )
    ap.add_argument("--probe-reserve", type=int, default=16, help="server.probe_reserve")
    ap.add_argument(
        "--body-budget-mib",
        type=float,
        default=256.0,
        help="limits.max_buffered_body_bytes (0: leave the default)",
    )
    ap.add_argument("--max-connections", type=int, default=4096, help="server.max_connections")
    ap.add_argument("--flood-extra", type=int, default=500, help="flood: sockets past the cap")
    ap.add_argument("--header-timeout", type=float, default=5.0, help="server.header_timeout_s")
    ap.add_argument("--body-timeout", type=float, default=5.0, help="server.body_timeout_s")
    ap.add_argument("--keep-alive", type=float, default=5.0, help="server.keep_alive_s")
    ap.add_argument("--quiet-s", type=float, default=5.0, help="seconds of the quiet and after phases")
    ap.add_argument(
        "--rss-slack-mib", type=float, default=128.0, help="RSS after the attack above the quiet one allowed"
    )
    ap.add_argument("--rounds", type=int, default=1, help="times the attacks run")
    ap.add_argument("--only", nargs="+", choices=ATTACKS, help="run only these attacks")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    _raise_fd_limit(4 * (args.max_connections + args.flood_extra + args.idle) + 1024)

    work = Path(tempfile.mkdtemp(prefix="agentgw-hostile-"))
    eport, gport = free_port(), free_port()
    cfg: dict[str, Any] = {
        "pools": [
            {"name": "p", "engines": [{"name": "e0", "url": f"http://{HOST}:{eport}", "model": MODEL}]}
        ],
        "server": {
            "max_connections": args.max_connections,
            "header_timeout_s": args.header_timeout,
            "body_timeout_s": args.body_timeout,
            "keep_alive_s": args.keep_alive,
            "probe_reserve": args.probe_reserve,
        },
        "drain": {"deadline_s": 2},
    }
    if args.body_budget_mib > 0:
        cfg["limits"] = {"max_buffered_body_bytes": int(args.body_budget_mib * 2**20)}
    (work / "gw.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (work / "procs.log").open("ab")
    engine = subprocess.Popen(
        [sys.executable, "-m", "testing.fake_engine", "--port", str(eport), "--model", MODEL],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(work / "gw.yaml"), "--port", str(gport)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http_ok(f"http://{HOST}:{eport}/health", 30, engine)
        wait_http_ok(f"http://{HOST}:{gport}/ready", 60, gw)

        async def drive() -> list[dict[str, Any]]:
            rows = []
            for ph in phases(args):
                rows.append(await run_phase(ph, gport, gw.pid, args.keep_alive))
                print(f"{ph.name}: {rows[-1]['outcomes']} rss {rows[-1]['rss_peak_mib']} MiB", flush=True)
            return rows

        rows = asyncio.run(drive())
    finally:
        gw.send_signal(signal.SIGTERM)
        try:
            gw.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(gw.pid, signal.SIGKILL)
            gw.wait(10)
        engine.terminate()
        engine.wait(10)
        log.close()
    report: dict[str, Any] = {
        "command": "python -m benchmarks.hostile " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {**cfg["server"], **cfg.get("limits", {})},
        "flood_extra": args.flood_extra,
        "probe_reserve": args.probe_reserve,
        "phases": rows,
        "gateway_exit": gw.returncode,
    }
    report["violations"] = violations(report, args.rss_slack_mib)
    print(table(report))
    print("violations:", report["violations"] or "none")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
