"""Soak: N concurrent agent sessions through a gateway subprocess, with faults, for a bounded time.

Each session (hinted: ``x-agent-session-id``, tool latency, latency class) runs streamed chat
turns separated by tool gaps (a hint POST announcing the gap, then the wait), its history growing;
some turns fan out 2-3 subagents (``x-agent-parent-session-id``, background class) that run one or
two turns each. A session ends after ``--turns`` turns (half of them with ``DELETE``, the others
left idle so the TTL must expire them) and a new one takes its place, so ``--sessions`` are live at
any moment and the run is bounded by ``--duration``.

Two modes:

- stand-in engines (default): ``--engines`` fast stand-ins (testing/fake_engine.py, paced so
  that streams are in flight when a fault hits), a real redis-server as the session store; during
  the run engines are SIGKILLed and restarted on the same port (``--kill-every``) and Redis is
  stopped and started again (``--redis-every``).
- ``--real``: ``agentgw serve`` with its embedded local vLLM engines (tiny model, ``--warm``
  engines); Redis is bounced, engines are not killed (they are the gateway's children). Run it
  under ``flock /tmp/agentgw-engines.lock``.

Every request is classified from the client's side:

- ok: 200, the stream ends with a finish reason and ``[DONE]``, no error event;
- cut with an error: 200, the stream ends with an error chunk then ``[DONE]`` (an engine died);
- cut silently: 200, the stream ends without ``[DONE]`` or the connection drops (a violation);
- failed before start: a 5xx or a connection error before the response began (a violation: a
  request that had not started must be retried by the gateway on another engine);
- retried: answered after the gateway retried it on another engine (``x-agentgw-reason: retry``).

Also reported: the gateway's RSS (``process_resident_memory_bytes`` on its ``/metrics``) after
start-up, its peak and at the end; sessions left idle longer than the TTL and found gone (404)
(any found still there is a violation); p50/p99 latency of ok turns (end to end, and to the first
token). ``--json`` writes the report; the exit status is 1 when an invariant is violated.

    python -m benchmarks.soak --sessions 200 --duration 240 --json /tmp/soak.json
    flock /tmp/agentgw-engines.lock python -m benchmarks.soak --real --sessions 8 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks._common import free_port, percentile, wait_http_ok

ROOT = Path(__file__).resolve().parents[1]
FAKE_MODEL = "soak-model"
SYSTEM = "You are a coding agent. Tools: read_file, run_tests, edit. " * 8


SMALL_CAPS: dict[str, dict[str, Any]] = {
    "sessions": {"capacity": 1000, "local_capacity": 1000},
    "routing": {"index_capacity_blocks": 500},
    "analysis": {"cache_bytes": 4 * 2**20, "session_tokens_bytes": 2**19},
}
"""``--small-caps``: every bounded table small enough that a few minutes of traffic fill it (the
sessions also hold the Responses-API owner records; the index is per engine and per kind)."""


# -- processes ------------------------------------------------------------------------------------
class Proc:
    """A child process we may kill and start again on the same port."""

    def __init__(self, name: str, argv: list[str], health: str | None, log: Path) -> None:
        self.name, self.argv, self.health, self.log = name, argv, health, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> None:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        if self.health is not None:
            wait_http_ok(self.health, timeout_s, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


class Redis(Proc):
    def __init__(self, port: int, log: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (./scripts/setup.sh --test installs it)")
        argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        super().__init__("redis", argv, None, log)
        self.port = port

    def start(self, timeout_s: float = 10) -> None:
        super().start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5):
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")


# -- the tally ------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    retried: int = 0
    cut_with_error: int = 0
    cut_silently: int = 0
    failed_before_start: int = 0
    refused_4xx: int = 0
    side_calls: int = 0
    side_5xx: int = 0
    sessions_started: int = 0
    sessions_deleted: int = 0
    e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    idle: dict[str, float] = field(default_factory=dict)
    """Sessions left idle (id -> monotonic time of their last request's end)."""
    lost_home: int = 0
    """Later turns of a session routed as a new session's first (the gateway no longer knew it)."""
    lost_homes: list[tuple[float, float, str, str, str]] = field(default_factory=list)
    """Each lost home (the first 64): monotonic and wall-clock time it was sent, session id, the
    replica of its turn before and of this turn (to find both in the replicas' logs)."""
    last_upstream: dict[str, str] = field(default_factory=dict)
    """Behind a balancer: the replica that served each session's last turn (``X-Upstream-Addr``)."""
    events: list[tuple[float, str, str]] = field(default_factory=list)
    """(monotonic time, kind) of every request that did not end ok: ``cut_silently``,
    ``failed_before_start``, ``cut_with_error``, ``refused``, ``lost_home`` (``lost_home_local``:
    placed on a replica's own view while its session store was down; a chaos run charges
    each to the fault whose window it fell in), with the replica that served it behind a balancer."""

    def event(self, kind: str, upstream: str = "", when: float | None = None) -> None:
        """``upstream``: the balancer's ``X-Upstream-Addr`` of the answer (the replica(s) that
        served it), when it came through one. ``when``: the event's monotonic time, if not now."""
        self.events.append((time.monotonic() if when is None else when, kind, upstream))

    def note(self, reason: str) -> None:
        if len(self.reasons) < 64 or reason in self.reasons:
            self.reasons[reason] += 1


@dataclass
class Plan:
    url: str
    model: str
    sessions: int
    duration_s: float
    turns: int
    max_tokens: int
    gap_s: tuple[float, float]
    fan_out_p: float
    seed: int


async def turn(
    c: Client, p: Plan, t: Tally, sid: str, parent: str | None, msgs: list[Any], later: bool = False
) -> str:
    """One streamed turn; returns the assistant's text ("" unless ok). ``later``: not the
    session's first turn (one routed as a new session's first counts in ``lost_home``)."""
    gap_ms = int(p.gap_s[1] * 1000)
    headers = {
        "x-agent-session-id": sid,
        "x-agent-tool-latency-ms": str(gap_ms),
        "x-agent-latency-class": "background" if parent else "interactive",
    }
    if parent is not None:
        headers["x-agent-parent-session-id"] = parent
    body = {"model": p.model, "messages": msgs, "max_tokens": p.max_tokens, "stream": True}
    t.sent += 1
    t0 = time.monotonic()
    started = done = error = finished = False
    first: float | None = None
    upstream = ""
    text: list[str] = []
    try:
        async with c.http.post(c.url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                code = _code(await r.read())
                if r.status >= 500:
                    t.failed_before_start += 1
                    t.event("failed_before_start")
                else:
                    t.refused_4xx += 1
                    t.event("refused")
                t.note(f"{r.status} {code}")
                return ""
            started = True
            upstream = r.headers.get("x-upstream-addr", "")
            if r.headers.get("x-agentgw-reason") == "retry":
                t.retried += 1
            if later and r.headers.get("x-agentgw-reason") == "new_session":
                t.lost_home += 1
                # the replica that served the turn before (it alone may have held the session)
                # at the time it was sent: the replica routes it on arrival, while its answer may
                # come much later (an engine paused under it, a retry); "local": that replica's
                # session store was down, so it placed the turn on its own view alone
                local = r.headers.get("x-agentgw-session-store") == "local"
                kind = "lost_home_local" if local else "lost_home"
                t.event(kind, t.last_upstream.get(sid, ""), when=t0)
                if len(t.lost_homes) < 64:
                    sent_wall = time.time() - (time.monotonic() - t0)
                    t.lost_homes.append((t0, sent_wall, sid, t.last_upstream.get(sid, ""), upstream))
            if upstream:
                t.last_upstream[sid] = upstream.rsplit(", ", 1)[-1]
            async for raw in r.content:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if first is None:
                    first = time.monotonic() - t0
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    error = True
                    t.note(f"stream error: {str(obj['error'].get('message'))[:60]}")
                    continue
                for ch in obj.get("choices") or []:
                    text.append((ch.get("delta") or {}).get("content") or "")
                    finished = finished or ch.get("finish_reason") is not None
    except (aiohttp.ClientError, TimeoutError) as exc:
        if not started:
            t.failed_before_start += 1
            t.event("failed_before_start")
            t.note(f"connect: {type(exc).__name__}")
            return ""
        t.cut_silently += 1
        t.event("cut_silently", upstream)
        t.note(f"cut: {type(exc).__name__}")
        return ""
    if error and done:
        t.cut_with_error += 1
        t.event("cut_with_error")
    elif done and finished:
        t.ok += 1
        t.e2e_s.append(time.monotonic() - t0)
        if first is not None:
            t.ttft_s.append(first)
        return "".join(text)
    else:
        t.cut_silently += 1
        t.event("cut_silently", upstream)
        t.note("stream ended without [DONE]" if not done else "no finish reason")
    return ""


def _code(raw: bytes) -> str:
    """The error's code, and for an upstream failure the exception the last try ended with
    (``502 upstream_connect_error ConnectionTimeoutError``: the cause, counted by kind)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(raw)["error"]
        msg = str(err.get("message") or "")
        last = "ConnectionRefusedError" if "ConnectionRefusedError" in msg else re.search(r": (\w+)\(", msg)
        if isinstance(last, re.Match):
            last = last.group(1)
        return f"{err['code']} {last}" if last else str(err["code"])
    return raw[:40].decode(errors="replace")


@dataclass
class Client:
    http: aiohttp.ClientSession
    url: str


async def side(t: Tally, c: Client, method: str, path: str, body: Any = None) -> int | None:
    """A hint POST / session call; its status (None: no answer). Only a 5xx or a failed
    connection counts against the gateway."""
    t.side_calls += 1
    try:
        async with c.http.request(method, c.url + path, json=body) as r:
            raw = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        t.side_5xx += 1
        t.note(f"side: {type(exc).__name__}")
        return None
    if status >= 500:
        t.side_5xx += 1
        t.note(f"side {status} {_code(raw)}")
    return status


async def agent(c: Client, p: Plan, t: Tally, rng: random.Random, end: float, slot: int) -> None:
    """Slot ``slot``: one session after another until the end of the run."""
    n = 0
    while time.monotonic() < end:
        sid = f"soak{p.seed}-{slot}-{n}"
        n += 1
        t.sessions_started += 1
        msgs: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"task {sid}: fix the failing test"},
        ]
        for k in range(p.turns):
            if time.monotonic() >= end:
                break
            reply = await turn(c, p, t, sid, None, msgs, later=k > 0)
            msgs.append({"role": "assistant", "content": reply or "(cut)"})
            msgs.append({"role": "user", "content": f"tool result {k}: " + "ok " * rng.randint(5, 40)})
            if rng.random() < p.fan_out_p:
                kids = [f"{sid}-sub{j}" for j in range(rng.randint(2, 3))]
                t.sessions_started += len(kids)
                await asyncio.gather(*(subagent(c, p, t, rng, kid, sid, end) for kid in kids))
            gap = rng.uniform(*p.gap_s)
            hint = {"expected_tool_latency_ms": int(gap * 1000)}
            await side(t, c, "POST", f"/v1/agent/sessions/{sid}/hints", hint)
            await asyncio.sleep(gap)
        if rng.random() < 0.5:
            if await side(t, c, "DELETE", f"/v1/agent/sessions/{sid}") == 200:
                t.sessions_deleted += 1
            continue
        t.idle[sid] = time.monotonic()


async def subagent(
    c: Client, p: Plan, t: Tally, rng: random.Random, sid: str, parent: str, end: float
) -> None:
    msgs: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"subtask {sid}"}]
    for k in range(rng.randint(1, 2)):
        if time.monotonic() >= end:
            break
        reply = await turn(c, p, t, sid, parent, msgs, later=k > 0)
        msgs += [{"role": "assistant", "content": reply or "(cut)"}, {"role": "user", "content": "go on"}]
    t.idle[sid] = time.monotonic()


async def rss(c: Client) -> int | None:
    """The gateway's RSS from its /metrics (prometheus_client's process collector)."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with c.http.get(c.url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("process_resident_memory_bytes "):
                    return int(float(line.split()[1]))
    return None


async def upstream_errors(c: Client) -> dict[str, float]:
    """The gateway's ``agentgw_upstream_errors_total`` summed over engines, by kind: ``connect``
    (the engine could not be reached: tried elsewhere), ``connect_lag`` (a connect timeout the
    gateway's own loop lag explains: tried again on the same engine), the mid-response kinds."""
    out: dict[str, float] = {}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with c.http.get(c.url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("agentgw_upstream_errors_total{"):
                    kind = line.split('kind="', 1)[1].split('"', 1)[0]
                    out[kind] = out.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def tables(c: Client) -> dict[str, float]:
    """How full the gateway's bounded tables are, from the outside: sessions evicted at
    ``sessions.capacity`` (``agentgw_session_evictions_total``), the prefix index's blocks per
    engine (``/dashboard/state``: cached tokens / tokens a block), and the analysis workers' and
    token caches' evictions when the metrics have them."""
    out: dict[str, float] = {}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with c.http.get(c.url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("agentgw_session_evictions_total{"):
                    reason = line.split('reason="', 1)[1].split('"', 1)[0]
                    out[f"sessions_evicted_{reason}"] = float(line.rsplit(" ", 1)[1])
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        async with c.http.get(c.url + "/dashboard/state?sessions=0") as r:
            state = await r.json()
        for pool in state["pools"]:
            for e in pool["engines"]:
                out[f"index_tokens_{e['name']}"] = float(e["cached_tokens"]["total"])
    return out


async def faults(
    schedule: list[tuple[float, str, Any]], t0: float, down_s: float, log: list[dict[str, Any]]
) -> None:
    """Run ``(at_s, kind, proc)`` in order: kill (or stop) the process, wait ``down_s``, start it."""
    for at, kind, proc in schedule:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        if kind == "kill":
            await asyncio.to_thread(proc.kill)
        else:
            await asyncio.to_thread(proc.stop)
        down = time.monotonic() - t0
        await asyncio.sleep(down_s)
        await asyncio.to_thread(proc.start)
        log.append(
            {
                "fault": f"{kind} {proc.name}",
                "at_s": round(down, 1),
                "back_s": round(time.monotonic() - t0, 1),
            }
        )


async def drive(
    p: Plan, ttl_s: float, schedule: list[tuple[float, str, Any]], down_s: float, rss_every_s: float = 60.0
) -> dict[str, Any]:
    t = Tally()
    fault_log: list[dict[str, Any]] = []
    conn = aiohttp.TCPConnector(limit=4 * p.sessions + 16)
    timeout = aiohttp.ClientTimeout(total=120, connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        c = Client(http, p.url)
        rss_start = await rss(c)
        peak = rss_start or 0
        t0 = time.monotonic()
        end = t0 + p.duration_s
        rng = random.Random(p.seed)
        tasks = [
            asyncio.create_task(agent(c, p, t, random.Random(rng.random()), end, i))
            for i in range(p.sessions)
        ]
        fault_task = asyncio.create_task(faults(schedule, t0, down_s, fault_log))
        series: list[dict[str, Any]] = [{"t_s": 0.0, "rss_mib": _mib(rss_start), **await tables(c)}]
        next_sample = t0 + rss_every_s
        while time.monotonic() < end:
            await asyncio.sleep(min(2.0, max(0.0, end - time.monotonic())))
            now_rss = await rss(c)
            peak = max(peak, now_rss or 0)
            if time.monotonic() >= next_sample:
                next_sample += rss_every_s
                at = round(time.monotonic() - t0, 1)
                series.append({"t_s": at, "rss_mib": _mib(now_rss), "sent": t.sent, **await tables(c)})
        await asyncio.gather(*tasks)
        await fault_task
        wall = time.monotonic() - t0
        rss_end = await rss(c)
        peak = max(peak, rss_end or 0)
        series.append({"t_s": round(wall, 1), "rss_mib": _mib(rss_end), "sent": t.sent, **await tables(c)})
        errors = await upstream_errors(c)
        # TTL: every session idle for longer than the TTL must be gone
        now = time.monotonic()
        due = [sid for sid, at in t.idle.items() if now - at > ttl_s + 1.0]
        still = 0
        for sid in due:
            if await side(t, c, "GET", f"/v1/agent/sessions/{sid}") == 200:
                still += 1
    lat = sorted(t.e2e_s)
    ttft = sorted(t.ttft_s)
    return {
        "sessions_concurrent": p.sessions,
        "duration_s": round(wall, 1),
        "requests_sent": t.sent,
        "ok": t.ok,
        "retried": t.retried,
        "cut_with_error": t.cut_with_error,
        "cut_silently": t.cut_silently,
        "failed_before_start": t.failed_before_start,
        "refused_4xx": t.refused_4xx,
        "side_calls": t.side_calls,
        "side_5xx": t.side_5xx,
        "sessions_started": t.sessions_started,
        "sessions_deleted": t.sessions_deleted,
        "sessions_idle_past_ttl": len(due),
        "sessions_expired_on_ttl": len(due) - still,
        "sessions_past_ttl_still_there": still,
        "rss_start_mib": _mib(rss_start),
        "rss_peak_mib": _mib(peak),
        "rss_end_mib": _mib(rss_end),
        "e2e_p50_ms": _ms(lat, 50),
        "e2e_p99_ms": _ms(lat, 99),
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p99_ms": _ms(ttft, 99),
        "upstream_errors": errors,
        "faults": fault_log,
        "rss_series": series,
        "reasons": dict(t.reasons.most_common(20)),
    }


def _mib(b: int | None) -> float | None:
    return round(b / 2**20, 1) if b else None


def _ms(sorted_s: list[float], q: float) -> float | None:
    return round(percentile(sorted_s, q) * 1000, 1) if sorted_s else None


def violations(report: dict[str, Any]) -> list[str]:
    """The invariants: none lost before start, every cut with an error, no other 5xx, TTL works."""
    out = []
    if report["failed_before_start"]:
        out.append(f"{report['failed_before_start']} request(s) failed before they started")
    if report["cut_silently"]:
        out.append(f"{report['cut_silently']} stream(s) cut without an error event")
    if report["side_5xx"]:
        out.append(f"{report['side_5xx']} session-API call(s) got a 5xx or no answer")
    if report["sessions_past_ttl_still_there"]:
        out.append(f"{report['sessions_past_ttl_still_there']} session(s) idle past the TTL still stored")
    if not report["ok"]:
        out.append("no request succeeded")
    return out


def table(report: dict[str, Any], label: str) -> str:
    keys = [
        "duration_s",
        "requests_sent",
        "ok",
        "retried",
        "cut_with_error",
        "cut_silently",
        "failed_before_start",
        "side_5xx",
        "sessions_started",
        "sessions_expired_on_ttl",
        "sessions_past_ttl_still_there",
        "rss_start_mib",
        "rss_peak_mib",
        "rss_end_mib",
        "e2e_p50_ms",
        "e2e_p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
    ]
    lines = [f"| {label} | value |", "|---|---|"]
    lines += [f"| {k} | {report[k]} |" for k in keys]
    errors = report.get("upstream_errors") or {}
    lines.append(
        f"| upstream_errors | {', '.join(f'{k} {v:g}' for k, v in sorted(errors.items())) or 'none'} |"
    )
    lines.append(
        f"| faults | {'; '.join(f['fault'] + ' @' + str(f['at_s']) + 's' for f in report['faults']) or 'none'} |"
    )
    lines.append("")
    lines.append(series_table(report["rss_series"]))
    return "\n".join(lines)


def series_table(series: list[dict[str, Any]]) -> str:
    """RSS and table fill over time, one row a sample."""
    cols = sorted({k for row in series for k in row} - {"t_s", "rss_mib", "sent"})
    lines = ["| t (s) | RSS (MiB) | sent | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
    for row in series:
        cells = [str(row.get("t_s")), str(row.get("rss_mib")), str(row.get("sent", 0))]
        cells += [f"{row[k]:g}" if k in row else "" for k in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=20, help="concurrent agent sessions")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--turns", type=int, default=6, help="turns per session before a new one starts")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument(
        "--gap", type=float, nargs=2, default=(0.2, 1.5), metavar=("MIN", "MAX"), help="tool gap (s)"
    )
    ap.add_argument("--fan-out", type=float, default=0.2, help="chance a turn fans out subagents")
    ap.add_argument("--ttl", type=float, default=8.0, help="sessions.ttl_s of the gateway")
    ap.add_argument("--engines", type=int, default=3, help="stand-in engines")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="stand-in engines' inter-token delay")
    ap.add_argument("--kill-every", type=float, default=30.0, help="SIGKILL an engine every N s (0: never)")
    ap.add_argument("--redis-every", type=float, default=45.0, help="stop Redis every N s (0: never)")
    ap.add_argument("--down", type=float, default=3.0, help="seconds a killed process stays down")
    ap.add_argument("--real", action="store_true", help="real vLLM engines (agentgw serve's embedded ones)")
    ap.add_argument("--warm", type=int, default=2, help="--real: local engines")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rss-every", type=float, default=60.0, help="seconds between RSS samples")
    ap.add_argument(
        "--small-caps",
        action="store_true",
        help="small caps on every bounded table (SMALL_CAPS) so that a run fills them all",
    )
    ap.add_argument(
        "--tokenizer",
        help="stand-in engines: a model directory the gateway tokenizes the prompts with "
        "(exercises the token caches), e.g. /tmp/agentgw-test-models/tiny-llama",
    )
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="agentgw-soak-"))
    redis = Redis(free_port(), work / "redis.log")
    engines: list[Proc] = []
    gw_port = free_port()
    cfg: dict[str, Any] = {
        "sessions": {
            "backend": "redis",
            "redis_url": f"redis://127.0.0.1:{redis.port}/0",
            "ttl_s": args.ttl,
            "redis_retry_s": 0.5,
        },
        "drain": {"deadline_s": 5},
    }
    if args.small_caps:
        for section, values in SMALL_CAPS.items():
            cfg.setdefault(section, {}).update(values)
    if args.tokenizer and not args.real:
        cfg["models"] = [{"name": FAKE_MODEL, "tokenizer": args.tokenizer}]
    model = "tiny-llama" if args.real else FAKE_MODEL
    if not args.real:
        for i in range(args.engines):
            port = free_port()
            eargv = [
                sys.executable,
                "-m",
                "testing.fake_engine",
                "--port",
                str(port),
                "--model",
                FAKE_MODEL,
            ]
            eargv += ["--tokens", str(args.max_tokens), "--itl-ms", str(args.itl_ms)]
            engines.append(
                Proc(f"engine{i}", eargv, f"http://127.0.0.1:{port}/health", work / f"engine{i}.log")
            )
        cfg["pools"] = [
            {
                "name": "p",
                "engines": [
                    {"name": e.name, "url": e.health.removesuffix("/health"), "model": FAKE_MODEL}
                    for e in engines
                    if e.health
                ],
            }
        ]
    (work / "gw.yaml").write_text(yaml.safe_dump(cfg))
    gw_argv = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--config",
        str(work / "gw.yaml"),
        "--port",
        str(gw_port),
    ]
    if args.real:
        gw_argv += ["--first-turn", "0", "--warm", str(args.warm)]
    gateway = Proc("gateway", gw_argv, None, work / "gateway.log")
    url = f"http://127.0.0.1:{gw_port}"

    schedule: list[tuple[float, str, Any]] = []
    if args.kill_every > 0 and engines:
        at, i = args.kill_every / 2, 0
        while at < args.duration - args.down - 2:
            schedule.append((at, "kill", engines[i % len(engines)]))
            at, i = at + args.kill_every, i + 1
    if args.redis_every > 0:
        at = args.redis_every * 0.75
        while at < args.duration - args.down - 2:
            schedule.append((at, "stop", redis))
            at += args.redis_every
    schedule.sort(key=lambda s: s[0])

    exit_code: int | None = None
    try:
        redis.start()
        for e in engines:
            e.start()
        gateway.start()
        wait_http_ok(url + "/ready", 600 if args.real else 60, gateway.proc)
        plan = Plan(
            url,
            model,
            args.sessions,
            args.duration,
            args.turns,
            args.max_tokens,
            tuple(args.gap),
            args.fan_out,
            args.seed,
        )
        report = asyncio.run(drive(plan, args.ttl, schedule, args.down, args.rss_every))
    finally:
        exit_code = gateway.stop(60)
        for e in engines:
            e.stop()
        redis.stop()
    report["mode"] = (
        "real vLLM engines" if args.real else f"{args.engines} stand-in engines (itl {args.itl_ms:g} ms)"
    )
    report["gateway_exit"] = exit_code
    report["command"] = "python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    report["violations"] = violations(report)
    if exit_code != 0:
        report["violations"].append(f"gateway exited {exit_code} on SIGTERM")
    print(table(report, report["mode"]))
    print("violations:", report["violations"] or "none")
    print("reasons:", report["reasons"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
