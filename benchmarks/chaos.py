"""Chaos: the shape users deploy, with faults landing together.

Three ``agentgw serve`` replicas behind Debian's nginx (testing/replicas.py), sharing one real
``redis-server``; three engines; agent sessions (the soak's: hinted turns, tool gaps, subagents,
streamed) and Responses chains (``previous_response_id``) running throughout; and a fault schedule
whose windows overlap:

1. SIGKILL a gateway replica (streams in flight on it), restart it 3 s later;
2. restart Redis (no persistence: it comes back empty);
3. SIGSTOP an engine for 8 s, then SIGCONT;
4. SIGKILL an engine while a planned move is in flight (the run waits up to 40 s for one; the row
   says whether a move was in flight), restart it;
5. restart ``mooncake_master`` (SIGKILL: it comes back with no keys).

Engines (``--engines``): ``real`` (default) starts ``agentgw serve``'s own stack
(gateway/local/embedded.py: tiny vLLM engines with engine_ext, its host tier, the Mooncake tier and
the control API, so the replicas pin sessions through their tool gaps and the planner moves
them); ``stand-in`` uses testing/fake_engine.py (no control API: no pins and no moves; Mooncake
still runs and is restarted, but nothing uses it). Run the real form under
``flock /tmp/agentgw-engines.lock``. The real form sets ``sessions.redis_timeout_s`` to 2 s: with
three CPU engines on a 2-core machine the load average nears 20, and Redis, though up, answers
past the 0.5 s default, which sends every replica into degraded mode with no fault injected.

Reported per fault: when it hit, when the part was back, the time to recover (every replica
``/ready`` and, for an engine, admitted again on every replica), and the requests that did not end
ok in its window (from the hit until 5 s after the recovery). Reported per run: requests accepted
and never answered (a 5xx or no answer before the stream started), streams cut without an error
event, Responses chains that could not continue, later turns of a session routed as a new
session's (the gateway lost a home it had), and each replica's peak RSS.

What counts as a violation (exit status 1):

- any request failed before it started, or got no answer;
- a stream cut without an error event, except one the SIGKILLed replica was relaying (nginx's
  ``X-Upstream-Addr`` names it): a process killed mid-stream cannot write an error event, and
  nginx cannot either once the response has begun; the client sees the transport error (an
  incomplete chunked body). Those are reported apart (``cut_by_replica_kill``);
- a Responses chain that could not continue while the engine holding its last response was up
  (vLLM keeps a stored response in the memory of the engine that made it: a chain whose engine
  was SIGKILLed is reported apart, ``chains_lost_with_engine``; and one whose last response
  went through the SIGKILLed replica, broken after the kill: Redis restarts empty while that
  replica is down, so the record of the response's engine had its only copies there, as a
  session's home; reported apart, ``chains_lost_with_replica``);
- a later turn of a session routed as a new session's, except one whose turn before went
  through the SIGKILLed replica: Redis restarts empty while that replica is down, so the
  session's only copies (in Redis and in that replica's local view) are both gone; reported
  apart (``lost_home_with_replica``); and one routed while Redis was down or restarted empty and
  not yet refilled (from the restart until every replica is out of degraded mode): the replica
  that served it routed on its own local view, which need not hold a session another replica
  served (the store's degraded mode), or routed by a replica that answered it with
  ``x-agentgw-session-store: local`` (its store was down then, as when the loaded Redis times
  out); reported apart (``lost_home_store_down``). A turn counts
  at the time it was sent (its replica routes it on arrival; the answer can come seconds later,
  after an engine paused under it); the report lists each lost home (``lost_homes``: when,
  session, the replica of the turn before and of this one) to find them in the replicas' logs.

    flock /tmp/agentgw-engines.lock python -m benchmarks.chaos --repeats 3
    python -m benchmarks.chaos --engines stand-in --duration 40 --repeats 1   # the CI form
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.soak import SYSTEM, Client, Plan, Proc, Tally, agent
from gateway.local.engines import LocalEngine, free_ports
from gateway.local.mooncake import MooncakeMaster
from gateway.local.redis_server import LocalRedis
from testing.replicas import GatewayReplica, Nginx

STAND_IN_MODEL = "chaos-model"
RETRIES = 8
"""A Responses link is retried this many times (a connection error, a 429, a 5xx), each after
its Retry-After: about as long as a fault's outage, where the OpenAI SDK's default is 2."""
SETTLE_S = 5.0
"""A fault's window runs this long past its recovery."""


# -- the parts a fault hits -----------------------------------------------------------------------
class Engine:
    """One engine the faults may pause, kill and restart: a real :class:`LocalEngine` or a
    stand-in process."""

    def __init__(self, name: str, real: LocalEngine | None = None, proc: Proc | None = None) -> None:
        self.name, self.real, self.proc = name, real, proc

    def _pid(self) -> int | None:
        if self.real is not None:
            return self.real.pid
        return None if self.proc is None or self.proc.proc is None else self.proc.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        pid = self._pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)

    def kill(self) -> None:
        if self.real is not None:
            self.real.kill()
        elif self.proc is not None:
            self.proc.kill()

    def restart(self) -> None:
        if self.real is not None:
            self.real = LocalEngine(self.real.spec)
            self.real.start()
            self.real.wait_ready(600)
        elif self.proc is not None:
            self.proc.start()

    def stop(self) -> None:
        if self.real is not None:
            self.real.stop()
        elif self.proc is not None:
            self.proc.stop()


@dataclass
class Deployment:
    engines: list[Engine]
    redis: LocalRedis
    mooncake: MooncakeMaster
    replicas: list[GatewayReplica]
    nginx: Nginx
    model: str

    def stop(self) -> None:
        for step in (
            self.nginx.stop,
            *(r.stop for r in self.replicas),
            *(e.stop for e in self.engines),
            self.mooncake.stop,
            self.redis.stop,
        ):
            with contextlib.suppress(Exception):
                step()


def deploy(kind: str, work: Path, replicas: int) -> Deployment:
    """Start everything: Redis, Mooncake, engines, the replicas, nginx."""
    engines: list[Engine] = []
    if kind == "real":
        from gateway.local.embedded import DEFAULT_HOME, SERVED_NAMES, start_local_stack

        model_dir = DEFAULT_HOME / "models" / SERVED_NAMES["llama"]  # agentgw serve's, built once
        stack = start_local_stack(
            store="mooncake", sessions="redis", home=work, model_dir=model_dir, timeout_s=900
        )
        assert stack.redis is not None and stack.mooncake is not None
        redis, mooncake = stack.redis, stack.mooncake
        engines = [Engine(e.spec.name, real=e) for e in stack.engines]
        config = dict(stack.config)
        model = str(config["models"][0]["name"])
    else:
        redis = LocalRedis(work / "redis.log").start()
        mooncake = MooncakeMaster(work / "mooncake_master.log").start()
        for i, port in enumerate(free_ports(3)):
            argv = [sys.executable, "-m", "testing.fake_engine", "--port", str(port)]
            argv += ["--model", STAND_IN_MODEL, "--tokens", "24", "--itl-ms", "40"]
            proc = Proc(f"engine{i}", argv, f"http://127.0.0.1:{port}/health", work / f"engine{i}.log")
            proc.start()
            engines.append(Engine(proc.name, proc=proc))
        pool = [
            {"name": e.name, "url": str(e.proc.health).removesuffix("/health"), "model": STAND_IN_MODEL}
            for e in engines
            if e.proc is not None
        ]
        config = {"pools": [{"name": "p", "engines": pool}]}
        model = STAND_IN_MODEL
    config["sessions"] = {
        **config.get("sessions", {}),
        "backend": "redis",
        "redis_url": redis.url,
        "redis_retry_s": 0.5,
        # three CPU engines on a 2-core machine hold the load average near 20: Redis, though up,
        # then answers past the 0.5 s default and every replica goes degraded with no fault
        # injected; the real form gives it what such a host needs
        **({"redis_timeout_s": 2.0} if kind == "real" else {}),
    }
    config["timeouts"] = {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "health_timeout_s": 1}
    config["drain"] = {"deadline_s": 5}
    reps = [GatewayReplica(f"r{i}", config, work / "replicas") for i in range(replicas)]
    try:
        for r in reps:
            r.start(120)
        nginx = Nginx(work / "nginx", [r.addr for r in reps]).start()
    except BaseException:
        for r in reps:
            with contextlib.suppress(Exception):
                r.stop()
        for e in engines:
            e.stop()
        mooncake.stop()
        redis.stop()
        raise
    return Deployment(engines, redis, mooncake, reps, nginx, model)


# -- observation ----------------------------------------------------------------------------------
async def _metrics(http: aiohttp.ClientSession, url: str) -> str:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=3)) as r:
            if r.status == 200:
                return await r.text()
    return ""


def _sum(text: str, name: str, where: Callable[[str], bool] = lambda _: True) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and where(line):
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def move_running(
    http: aiohttp.ClientSession, d: Deployment, sid: str, deadline: float
) -> dict[str, Any] | None:
    """The session's planned move as the replica that planned it shows it (the session API's
    ``migration``), as soon as it runs or has ended; None when none shows one by ``deadline``
    or within 10 s."""
    stop = min(deadline, time.monotonic() + 10)
    while time.monotonic() < stop:
        for r in d.replicas:
            try:
                async with http.get(f"{r.url}/v1/agent/sessions/{sid}") as resp:
                    body = await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            m = body.get("migration") if isinstance(body, dict) else None
            if isinstance(m, dict) and m.get("kind") in ("move", "replicate"):
                return m
        await asyncio.sleep(0.02)
    return None


async def provoke_move(
    http: aiohttp.ClientSession, d: Deployment, engine: str, deadline: float, attempt: int = 0
) -> str:
    """Start a planner move off ``engine``: a session homed there announces a fan-out
    (``agent_hints.fan_out``), so the planner replicates its prefix to other engines before the
    subagents arrive. New sessions are opened until one lands on ``engine`` (at most 8). Returns
    the session id, or "" when none landed there before ``deadline``."""
    history = [{"role": "system", "content": SYSTEM * 24}]  # a prefix of some blocks to move
    for k in range(8):
        if time.monotonic() >= deadline:
            break
        sid = f"chaos-move-{attempt}-{k}"
        msgs = [*history, {"role": "user", "content": f"task {k}: read the repository and plan"}]
        body: dict[str, Any] = {"model": d.model, "messages": msgs, "max_tokens": 8, "temperature": 0}
        body["agent_hints"] = {"session_id": sid}
        try:
            async with http.post(d.nginx.url + "/v1/chat/completions", json=body) as r:
                got = await r.json(content_type=None)
                landed = r.headers.get("x-agentgw-engine")
            if r.status != 200 or landed != engine:
                continue
            text = got["choices"][0]["message"]["content"] or "ok"
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "spawn 2 explorers"}]
            body["messages"] = msgs
            body["agent_hints"] = {"session_id": sid, "fan_out": 2}
            async with http.post(d.nginx.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                if r.status == 200:
                    return sid
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
            continue
    return ""


async def recovered(http: aiohttp.ClientSession, d: Deployment, engine: str | None) -> bool:
    """Every replica ready with its session store out of degraded mode, and ``engine`` (if
    given) admitted on every one."""
    for r in d.replicas:
        try:
            async with http.get(r.url + "/ready", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status != 200:
                    return False
                body = await resp.json(content_type=None)
                if isinstance(body, dict) and body.get("degraded"):
                    return False  # its session store still on the local view
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        if engine is not None:
            text = await _metrics(http, r.url)
            if _sum(text, "agentgw_engine_healthy", lambda ln, e=engine: f'engine="{e}"' in ln) < 1:
                return False
    return True


@dataclass
class FaultRecord:
    fault: str
    at: float
    back: float | None = None
    recovered: float | None = None
    note: str = ""
    target: str = ""
    """The part it hit (a replica's address)."""
    stuck: str = ""
    """What the fault left hanging after its recovery (a move still running on a dead engine)."""


async def run_fault(
    http: aiohttp.ClientSession,
    d: Deployment,
    rec: FaultRecord,
    hit: Callable[[], None],
    bring_back: Callable[[], None] | None,
    down_s: float,
    engine: str | None = None,
) -> None:
    rec.at = time.monotonic()
    await asyncio.to_thread(hit)
    await asyncio.sleep(down_s)
    if bring_back is not None:
        await asyncio.to_thread(bring_back)
    rec.back = time.monotonic()
    deadline = rec.back + 300
    while time.monotonic() < deadline:
        if await recovered(http, d, engine):
            rec.recovered = time.monotonic()
            return
        await asyncio.sleep(0.25)


async def schedule(
    http: aiohttp.ClientSession,
    d: Deployment,
    t0: float,
    duration: float,
    moves: bool,
    out: list[FaultRecord],
) -> None:
    """The faults, overlapping: at 15% of the run a replica dies; while it restarts Redis restarts;
    while Redis comes back an engine is paused; then an engine dies during a move; while it
    restarts, mooncake_master dies."""

    async def at(frac: float) -> None:
        await asyncio.sleep(max(0.0, t0 + frac * duration - time.monotonic()))

    victim = d.replicas[-1]
    paused, killed = d.engines[1 % len(d.engines)], d.engines[-1]
    tasks = []
    await at(0.15)
    r1 = FaultRecord("SIGKILL replica " + victim.name, 0.0, target=victim.addr)
    tasks.append(asyncio.create_task(run_fault(http, d, r1, victim.kill, lambda: victim.start(120), 3.0)))
    await asyncio.sleep(1.5)
    r2 = FaultRecord("restart redis-server (empty)", 0.0)
    tasks.append(asyncio.create_task(run_fault(http, d, r2, d.redis.stop, d.redis.start, 3.0)))
    await asyncio.sleep(2.0)
    r3 = FaultRecord(f"SIGSTOP engine {paused.name} 8 s, SIGCONT", 0.0)
    tasks.append(
        asyncio.create_task(
            run_fault(
                http,
                d,
                r3,
                lambda: paused.signal(signal.SIGSTOP),
                lambda: paused.signal(signal.SIGCONT),
                8.0,
                engine=paused.name,
            )
        )
    )
    await at(0.40)
    note, sid = "no moves (stand-in engines)", ""
    if moves:
        deadline = time.monotonic() + 40
        note = "no move in flight within 40 s"
        # the chaos sessions' own moves come rarely at this point of a run, and seldom off the
        # engine about to die: provoke one (a fan-out replicating a prefix that engine holds) and
        # kill the engine while the session's move is running
        for attempt in range(3):
            sid = await provoke_move(http, d, killed.name, deadline, attempt)
            if not sid:
                note += f" (no probe session landed on {killed.name})"
                break
            m = await move_running(http, d, sid, deadline)
            if m is not None and m["state"] == "running":
                note = f"{m['kind']} of {sid} from {m['source']} to {', '.join(m['targets'])} in flight"
                break
            note = f"{sid}'s move: {m['state'] if m else 'none planned'} before it could be hit"
            sid = ""
    r4 = FaultRecord(f"SIGKILL engine {killed.name} during a move", 0.0, note=note)
    tasks.append(
        asyncio.create_task(run_fault(http, d, r4, killed.kill, killed.restart, 2.0, engine=killed.name))
    )
    await asyncio.sleep(3.0)
    mc = d.mooncake
    r5 = FaultRecord("SIGKILL mooncake_master, restart (no keys)", 0.0)
    tasks.append(asyncio.create_task(run_fault(http, d, r5, mc.kill, mc.start, 3.0)))
    await asyncio.gather(*tasks)
    if moves and sid:  # the move the kill hit must have ended (failed or cancelled), not hang
        m = await move_running(http, d, sid, time.monotonic() + 10)
        state = m["state"] if m is not None else "gone"
        r4.note += f"; then {state}" + (f" ({m['error']})" if m is not None and m.get("error") else "")
        if state == "running":
            r4.stuck = f"the move of {sid} still running after its engine's recovery"
    out += [r1, r2, r3, r4, r5]


# -- Responses chains -----------------------------------------------------------------------------
@dataclass
class Chains:
    links: int = 0
    ok: int = 0
    broken: int = 0
    lost_with_engine: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    last_errors: list[tuple[int, str]] = field(default_factory=list)
    retries: int = 0


async def chain(
    c: Client,
    model: str,
    ch: Chains,
    t: Tally,
    end: float,
    killed_at: dict[str, float],
    slot: int,
    rng: random.Random,
) -> None:
    """Responses chains, one after another: each link continues the last by ``previous_response_id``."""
    n = 0
    while time.monotonic() < end:
        # (id, engine, when its request was sent, the replica that answered it)
        prev: tuple[str, str, float, str] | None = None
        n += 1
        for k in range(4):
            if time.monotonic() >= end:
                break
            body: dict[str, Any] = {
                "model": model,
                "input": f"chain {slot}-{n} step {k}: " + SYSTEM[:200],
                "max_output_tokens": 16,
                "store": True,
            }
            if prev is not None:
                body["previous_response_id"] = prev[0]
            ch.links += 1
            status, got, engine, upstream = 0, None, "", ""
            for attempt in range(RETRIES + 1):
                # as the OpenAI SDK does: a connection error, a 429 or a 5xx is retried (after
                # its Retry-After when it gives one)
                wait = 1.0
                sent = time.monotonic()
                try:
                    async with c.http.post(c.url + "/v1/responses", json=body) as r:
                        status = r.status
                        engine = r.headers.get("x-agentgw-engine", "")
                        upstream = r.headers.get("x-upstream-addr", "").rsplit(", ", 1)[-1]
                        raw = await r.read()
                        if status == 200:
                            got = json.loads(raw).get("id")
                        else:
                            ch.last_errors.append((status, raw[:200].decode(errors="replace")))
                            wait = float(r.headers.get("retry-after") or 1.0)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    status = -1
                    ch.reasons[type(exc).__name__] = ch.reasons.get(type(exc).__name__, 0) + 1
                if got or not (status == -1 or status == 429 or status >= 500) or attempt == RETRIES:
                    break
                ch.retries += 1
                await asyncio.sleep(wait)
            if got:
                ch.ok += 1
                prev = (got, engine, sent, upstream)
            else:
                # the engine that held the previous response was killed after its request was
                # sent: the response was stored in that engine's memory, gone with it (on a
                # loaded machine the client may read the answer only after the kill)
                if prev is not None and killed_at.get(prev[1], -1.0) >= prev[2]:
                    ch.lost_with_engine += 1
                    t.event("chain_lost_with_engine")
                else:
                    ch.broken += 1
                    t.event("chain_broken", prev[3] if prev is not None else "")
                    if prev is not None:  # which engine and replica the broken link followed
                        ch.last_errors.append((0, f"after {prev[0]} on {prev[1]} via {prev[3]}"))
                    key = f"status {status}"
                    ch.reasons[key] = ch.reasons.get(key, 0) + 1
                break
            await asyncio.sleep(rng.uniform(0.2, 1.0))


# -- one run --------------------------------------------------------------------------------------
async def rss_of(http: aiohttp.ClientSession, d: Deployment) -> dict[str, float]:
    out = {}
    for r in d.replicas:
        text = await _metrics(http, r.url)
        v = _sum(text, "process_resident_memory_bytes")
        if v:
            out[r.name] = v / 2**20
    return out


async def drive(d: Deployment, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    t = Tally()
    chains = Chains()
    faults: list[FaultRecord] = []
    killed_at: dict[str, float] = {}
    conn = aiohttp.TCPConnector(limit=8 * args.sessions + 32)
    timeout = aiohttp.ClientTimeout(total=180, connect=10)
    peak: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        c = Client(http, d.nginx.url)
        plan = Plan(d.nginx.url, d.model, args.sessions, args.duration, 5, 16, (0.5, 3.0), 0.3, seed)
        t0 = time.monotonic()
        end = t0 + args.duration
        rng = random.Random(seed)
        tasks = [
            asyncio.create_task(agent(c, plan, t, random.Random(rng.random()), end, i))
            for i in range(args.sessions)
        ]
        tasks += [
            asyncio.create_task(chain(c, d.model, chains, t, end, killed_at, i, random.Random(rng.random())))
            for i in range(args.chains)
        ]
        killed = d.engines[-1]
        orig_kill = killed.kill

        def kill_and_note() -> None:
            killed_at[killed.name] = time.monotonic()
            orig_kill()

        killed.kill = kill_and_note  # type: ignore[method-assign]
        sched = asyncio.create_task(schedule(http, d, t0, args.duration, args.engines == "real", faults))
        while time.monotonic() < end or not sched.done():
            await asyncio.sleep(2.0)
            for name, mib in (await rss_of(http, d)).items():
                peak[name] = max(peak.get(name, 0.0), mib)
        await asyncio.gather(*tasks)
        await sched
        killed.kill = orig_kill  # type: ignore[method-assign]
    replica_kill = next((f for f in faults if f.fault.startswith("SIGKILL replica")), None)
    killed_addr = replica_kill.target if replica_kill is not None else ""

    def through_killed(when: float, upstream: str) -> bool:
        """An event after the replica kill that names the killed replica: a stream it was
        relaying, or a turn before it served (Redis restarts empty while that replica is down,
        so what it recorded had its only copies in that Redis and that replica)."""
        return replica_kill is not None and upstream == killed_addr and when >= replica_kill.at

    # a stream the killed replica was relaying (nginx's X-Upstream-Addr names it), cut after the kill
    cut_by_kill = sum(
        1
        for when, kind, upstream in t.events
        if kind == "cut_silently" and through_killed(when, upstream.rsplit(", ", 1)[-1])
    )

    lost = ("lost_home", "lost_home_local")
    # a home lost with the killed replica's record of the session
    lost_with_replica = sum(1 for when, kind, up in t.events if kind in lost and through_killed(when, up))
    # a home lost while Redis was down or empty and not yet refilled (from its restart until
    # every replica was ready again, out of degraded mode): the replica that served the turn
    # had only its own local view, which may not hold a session another replica served before
    # ... and one the replica placed on its own view because its store was down then, the
    # injected restart or a Redis that timed out under the load (x-agentgw-session-store: local)
    redis_fault = next((f for f in faults if f.fault.startswith("restart redis")), None)
    start = redis_fault.at if redis_fault is not None else float("inf")
    end = (redis_fault.recovered or redis_fault.back or redis_fault.at) if redis_fault is not None else 0.0
    lost_store_down = sum(
        1
        for when, kind, upstream in t.events
        if kind in lost
        and not through_killed(when, upstream)
        and (kind == "lost_home_local" or start <= when <= end)
    )
    # a chain broken with the killed replica's record of its last response's engine
    chains_with_replica = sum(
        1 for when, kind, up in t.events if kind == "chain_broken" and through_killed(when, up)
    )
    rows = []
    for f in faults:
        stop = (f.recovered or f.back or f.at) + SETTLE_S
        counts: dict[str, int] = {}
        for when, kind, _upstream in t.events:
            if f.at <= when <= stop:
                counts[kind] = counts.get(kind, 0) + 1
        rows.append(
            {
                "fault": f.fault,
                "at_s": round(f.at - t0, 1),
                "back_s": round(f.back - t0, 1) if f.back else None,
                "recover_s": round(f.recovered - f.at, 1) if f.recovered else None,
                "in_window": counts,
                "note": f.note,
                "stuck": f.stuck,
            }
        )
    return {
        "requests_sent": t.sent,
        "ok": t.ok,
        "retried": t.retried,
        "cut_with_error": t.cut_with_error,
        "cut_by_replica_kill": cut_by_kill,
        "cut_silently": t.cut_silently - cut_by_kill,
        "failed_before_start": t.failed_before_start,
        "refused_4xx": t.refused_4xx,
        "side_5xx": t.side_5xx,
        "lost_home": t.lost_home - lost_with_replica - lost_store_down,
        "lost_home_with_replica": lost_with_replica,
        "lost_home_store_down": lost_store_down,
        "chain_links": chains.links,
        "chains_broken": chains.broken - chains_with_replica,
        "chains_lost_with_replica": chains_with_replica,
        "chains_lost_with_engine": chains.lost_with_engine,
        "chain_reasons": chains.reasons,
        "chain_errors": chains.last_errors[-5:],
        "chain_retries": chains.retries,
        "rss_peak_mib": {k: round(v, 1) for k, v in sorted(peak.items())},
        "faults": rows,
        "lost_homes": [
            {
                "at_s": round(when - t0, 2),
                "wall": time.strftime("%H:%M:%S", time.localtime(wall)) + f"{wall % 1:.3f}"[1:],
                "session": sid,
                "before": before,
                "now": now,
            }
            for when, wall, sid, before, now in t.lost_homes
        ],
        "reasons": dict(t.reasons.most_common(12)),
    }


def violations(r: dict[str, Any]) -> list[str]:
    out = []
    for key, what in (
        (
            "failed_before_start",
            "request(s) accepted and never answered (5xx or no answer before the stream)",
        ),
        ("cut_silently", "stream(s) cut without an error event (not by a replica's SIGKILL)"),
        ("side_5xx", "session-API call(s) with a 5xx or no answer"),
        ("chains_broken", "Responses chain(s) could not continue with their engine up"),
        ("lost_home", "later turn(s) routed as a new session's (a home lost)"),
    ):
        if r[key]:
            out.append(f"{r[key]} {what}")
    if not r["ok"]:
        out.append("no turn succeeded")
    for f in r["faults"]:
        if f["recover_s"] is None:
            out.append(f"{f['fault']}: not recovered within 300 s")
        if f.get("stuck"):
            out.append(f"{f['fault']}: {f['stuck']}")
    return out


def table(runs: list[dict[str, Any]]) -> str:
    keys = [
        "requests_sent",
        "ok",
        "retried",
        "cut_with_error",
        "cut_by_replica_kill",
        "cut_silently",
        "failed_before_start",
        "refused_4xx",
        "side_5xx",
        "lost_home",
        "lost_home_with_replica",
        "lost_home_store_down",
        "chain_links",
        "chain_retries",
        "chains_broken",
        "chains_lost_with_replica",
        "chains_lost_with_engine",
    ]
    lines = [
        "| | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(str(r[k]) for r in runs) + " |")
    lines.append(
        "| replica RSS peak (MiB) | "
        + " | ".join(", ".join(f"{n} {v:g}" for n, v in r["rss_peak_mib"].items()) for r in runs)
        + " |"
    )
    lines.append("| violations | " + " | ".join(str(len(r["violations"])) for r in runs) + " |")
    lines += [
        "",
        "| fault | hit (s) | back (s) | recovered after (s), median | in its window (run 1) | note |",
        "|---|---|---|---|---|---|",
    ]
    for i, f in enumerate(runs[0]["faults"]):
        rec = [r["faults"][i]["recover_s"] for r in runs if r["faults"][i]["recover_s"] is not None]
        window = ", ".join(f"{k} {v}" for k, v in sorted(f["in_window"].items())) or "none"
        lines.append(
            f"| {f['fault']} | {f['at_s']} | {f['back_s']} | "
            f"{statistics.median(rec) if rec else 'never'} | {window} | {f['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", choices=("real", "stand-in"), default="real")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=6, help="concurrent agent sessions")
    ap.add_argument("--chains", type=int, default=2, help="concurrent Responses chains")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of traffic per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="agentgw-chaos-"))
    runs = []
    d = deploy(args.engines, work, args.replicas)
    try:
        for i in range(args.repeats):
            report = asyncio.run(drive(d, args, seed=i + 1))
            report["violations"] = violations(report)
            runs.append(report)
            print(
                f"run {i + 1}: violations: {report['violations'] or 'none'}; reasons: {report['reasons']}",
                flush=True,
            )
            for lost in report["lost_homes"]:
                print(f"  lost home: {lost}", flush=True)
            if report["chains_broken"]:
                print(f"  chain errors: {report['chain_errors']}", flush=True)
    finally:
        d.stop()
    print(table(runs))
    cmd = "python -m benchmarks.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    print(
        f"\n{cmd}  ({args.engines} engines, {args.replicas} replicas behind nginx, {args.sessions} "
        f"sessions + {args.chains} Responses chains, {args.duration:g} s a run)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "runs": runs}, indent=1))
    if any(r["violations"] for r in runs):
        print(f"logs (nginx, replicas, engines): {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
