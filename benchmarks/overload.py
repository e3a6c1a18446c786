"""Overload: three tenants' agent sessions at 1x, 3x and 10x the fleet's capacity, through agentgw
and through vllm-router's rate limiter on the same engines, in one run.

    python -m benchmarks.overload                       # capacity search, then 1x / 3x / 10x
    python -m benchmarks.overload --repeat 3 --duration 30

The fleet: ``--engines`` stand-in engines (``testing.fake_engine``) paced to a fixed capacity:
``--max-running`` streams generate at once on each (later ones wait in the engine, their time to
first token growing, as in a full vLLM batch), ``--ttft-ms`` before the first of ``--tokens``
tokens, ``--itl-ms`` between tokens. What is tested is the gateway in front of it.

The traffic: closed-loop agent sessions of three tenants (API keys, ``auth.tenants[].share``
``--shares``, equal numbers of sessions each), a quarter of them subagents (background:
``x-agent-parent-session-id``), each turn a streamed chat completion replaying the session's
growing history (``x-agent-session-id``), a tool gap of ``--gap-s`` (+-50%) between turns. A
refused attempt (429 / 503) is retried as the OpenAI and Anthropic SDKs retry: after
``retry-after-ms``, else ``Retry-After``, else their backoff (0.5 s doubling to 8 s); a retry at
the time a refusal named is *honest* when it is admitted.

1. **Capacity**: the highest number of sessions at which the SLO holds through agentgw (>= 95% of
   turns meet it and none is refused), found by a ladder of short runs; that load is 1x.
2. For each load and target: goodput (turns meeting the SLO per second; a turn's TTFT is that of
   its answered attempt, the refused ones being what admission is for), interactive goodput,
   each tenant's share of the answered turns against its configured share, Jain's fairness
   index over those ratios and the lowest ratio, refusals and the share of honest Retry-Afters,
   the gateway's admission queue (sampled from ``/metrics``), and the p90 time from a turn's
   first attempt to its first token (retries included).

Targets: ``agentgw`` (``agentgw serve``: admission.max_inflight = the fleet's places,
max_inflight_per_engine = ``--max-running``, a queue bounded by ``--queue-timeout-s``, the
tenants' shares) and ``vllm-router`` (0.1.17, ``--policy cache_aware`` with its own limiter:
``--max-concurrent-requests`` = the fleet's places, ``--queue-size`` and ``--queue-timeout-secs``
the same bounds; it has no tenants). vllm-router comes from scripts/bench-setup.sh.
Exit status 1 when a check of the table's last lines fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks._common import ManagedProcess, free_port, percentile, wait_http_ok
from benchmarks.overhead import _default_vllm_router_bin

MODEL = "bench-model"
TENANTS = ("gold", "silver", "bronze")
ADMIN_KEY = "overload-admin-key"
SYSTEM = "You are a coding agent. " * 80  # ~2 KB every turn replays


@dataclass
class Turn:
    tenant: str
    interactive: bool
    start: float
    ttft: float | None = None  # of the answered attempt
    first_token_from_start: float | None = None
    tok_s: float | None = None
    attempts: int = 0
    refused: int = 0
    named: int = 0  # refusals that named a time to retry (retry-after-ms or Retry-After)
    honest: int = 0  # retries at Retry-After that were admitted
    retried: int = 0
    ok: bool = False


@dataclass
class Run:
    target: str
    load: str
    sessions: int
    duration: float
    turns: list[Turn] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    reasons: dict[str, float] = field(default_factory=dict)


@dataclass
class Slo:
    ttft_s: float
    tok_s: float

    def met(self, t: Turn) -> bool:
        return t.ok and t.ttft is not None and t.ttft <= self.ttft_s and (t.tok_s or 0) >= self.tok_s


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait a refusal asks for, read as the OpenAI and Anthropic SDKs read it:
    ``retry-after-ms`` first, then ``retry-after`` (seconds), honoured when in (0, 60]."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        raw = headers.get(name)
        try:
            value = float(raw) / scale if raw is not None else None
        except ValueError:
            value = None
        if value is not None and 0 < value <= 60:
            return value
    return None


async def attempt(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, turn: Turn
) -> tuple[int, float | None]:
    """One attempt: (status, Retry-After); fills the turn's timings when answered."""
    t0 = time.perf_counter()
    turn.attempts += 1
    try:
        async with http.post(url, data=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return r.status, retry_after(r.headers)
            first = last = None
            chunks = 0
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                if b'"content"' in line:
                    chunks += 1
                    if first is None:
                        first = now
                    last = now
            if first is None:
                return 599, None
            turn.ttft = first - t0
            turn.first_token_from_start = first - turn.start
            turn.tok_s = (chunks - 1) / (last - first) if chunks > 1 and last and last > first else math.inf
            turn.ok = True
            return 200, None
    except (TimeoutError, aiohttp.ClientError):
        return 598, None


async def session(
    http: aiohttp.ClientSession,
    url: str,
    tenant: str,
    key: str,
    sid: str,
    parent: str | None,
    gap_s: float,
    deadline: float,
    rng: random.Random,
    out: list[Turn],
) -> None:
    headers = {
        "authorization": f"Bearer {key}",
        "content-type": "application/json",
        "x-agent-session-id": sid,
    }
    if parent:
        headers["x-agent-parent-session-id"] = parent
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    await asyncio.sleep(rng.uniform(0, gap_s))  # sessions start spread out
    n = 0
    while time.perf_counter() < deadline:
        n += 1
        history.append({"role": "user", "content": f"tool result {n} of {sid}: " + "x" * 200})
        body = json.dumps(
            {"model": MODEL, "stream": True, "messages": history[-40:], "max_tokens": 64}
        ).encode()
        turn = Turn(tenant, parent is None, time.perf_counter())
        retry_at_hint = False
        while time.perf_counter() < deadline:
            status, retry_after = await attempt(http, url, headers, body, turn)
            if retry_at_hint:
                turn.retried += 1
                turn.honest += status == 200
            if status in (429, 503):
                turn.refused += 1
                retry_at_hint = retry_after is not None
                turn.named += retry_at_hint
                if retry_after is None:  # the SDKs' own backoff: 0.5 s doubling to 8 s, 0-25% jitter
                    retry_after = min(0.5 * 2 ** (turn.refused - 1), 8.0) * (1 - 0.25 * rng.random())
                await asyncio.sleep(min(retry_after, max(0.0, deadline - time.perf_counter())))
                continue
            break
        if turn.attempts:
            out.append(turn)  # answered, or still refused at the end: both are the record
        history.append({"role": "assistant", "content": "ok " * 40})
        await asyncio.sleep(
            min(rng.uniform(0.5 * gap_s, 1.5 * gap_s), max(0.0, deadline - time.perf_counter()))
        )


async def sample_queue(base: str, until: float, out: list[float]) -> None:
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() < until:
            try:
                async with http.get(base + "/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}) as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith("agentgw_admission_waiting "):
                            out.append(float(line.split()[1]))
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)


async def rejections(base: str) -> dict[str, float]:
    """The gateway's admission refusals so far, by reason, and its retry bookings by outcome."""
    out: dict[str, float] = {}
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession() as http, http.get(base + "/metrics", headers=auth) as r:
        for line in (await r.text()).splitlines():
            for prefix, label in (
                ("agentgw_admission_rejections_total{", "reason"),
                ("agentgw_admission_retry_bookings_total{", "outcome"),
            ):
                if line.startswith(prefix):
                    what = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                    out[what if label == "reason" else f"retry_{what}"] = float(line.rsplit(" ", 1)[1])
    return out


async def drive(
    base: str,
    keys: dict[str, str],
    sessions: int,
    duration: float,
    gap_s: float,
    seed: int,
    run: Run,
    sample: bool,
) -> None:
    rng = random.Random(seed)
    deadline = time.perf_counter() + duration
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=duration + 60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        tasks = []
        for i in range(sessions):
            tenant = TENANTS[i % len(TENANTS)]
            sid = f"{run.target}-{run.load}-{seed}-s{i}"
            parent = f"{sid}-parent" if i % 4 == 3 else None
            tasks.append(
                session(
                    http,
                    base + "/v1/chat/completions",
                    tenant,
                    keys[tenant],
                    sid,
                    parent,
                    gap_s,
                    deadline,
                    random.Random(rng.random()),
                    run.turns,
                )
            )
        before = await rejections(base) if sample else {}
        if sample:
            tasks.append(sample_queue(base, deadline, run.queue))
        await asyncio.gather(*tasks)
        if sample:
            after = await rejections(base)
            run.reasons = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


def jain(xs: list[float]) -> float:
    return (sum(xs) ** 2) / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def summarize(run: Run, slo: Slo, shares: dict[str, float]) -> dict[str, float]:
    turns = run.turns
    good = [t for t in turns if slo.met(t)]
    served = [t for t in turns if t.ok]
    total_share = sum(shares.values())
    ratios = []
    for name in TENANTS:
        mine = sum(1 for t in served if t.tenant == name)
        got = mine / len(served) if served else 0.0
        ratios.append(got / (shares[name] / total_share))
    retried = sum(t.retried for t in turns)
    retried_fg = sum(t.retried for t in turns if t.interactive)
    e2e = sorted(t.first_token_from_start for t in served if t.first_token_from_start is not None)
    ttft = sorted(t.ttft for t in served if t.ttft is not None)
    return {
        "sessions": run.sessions,
        "attempts_s": sum(t.attempts for t in turns) / run.duration,
        "goodput": len(good) / run.duration,
        "goodput_interactive": sum(1 for t in good if t.interactive) / run.duration,
        "goodput_background": sum(1 for t in good if not t.interactive) / run.duration,
        "slo_share": len(good) / len(turns) if turns else 0.0,
        "slo_first_try": sum(1 for t in good if t.refused == 0) / len(turns) if turns else 0.0,
        "jain": jain(ratios),
        "min_ratio": min(ratios),
        **{f"ratio_{n}": r for n, r in zip(TENANTS, ratios, strict=True)},
        "refused": sum(t.refused for t in turns),
        "named": sum(t.named for t in turns),
        "honest": (sum(t.honest for t in turns) / retried) if retried else float("nan"),
        "honest_interactive": (sum(t.honest for t in turns if t.interactive) / retried_fg)
        if retried_fg
        else float("nan"),
        "queue_p50": statistics.median(run.queue) if run.queue else float("nan"),
        "queue_max": max(run.queue) if run.queue else float("nan"),
        "ttft_p90": percentile(ttft, 90) if ttft else float("nan"),
        "e2e_p90": percentile(e2e, 90) if e2e else float("nan"),
        "failed": sum(1 for t in turns if not t.ok and t.refused == 0),
        **{f"reason_{k}": v for k, v in run.reasons.items()},
    }


class Fleet:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.engines: list[ManagedProcess] = []
        self.urls: list[str] = []
        self.keys = {name: f"key-{name}-{os.urandom(4).hex()}" for name in TENANTS}
        self.shares = dict(zip(TENANTS, args.shares, strict=True))
        self.gateway: ManagedProcess | None = None
        self.router: ManagedProcess | None = None
        self.bases: dict[str, str] = {}

    def start(self) -> None:
        a = self.args
        for i in range(a.engines):
            port = free_port()
            argv = [sys.executable, "-m", "testing.fake_engine", "--port", str(port), "--model", MODEL]
            argv += ["--tokens", str(a.tokens), "--ttft-ms", str(a.ttft_ms), "--itl-ms", str(a.itl_ms)]
            argv += ["--max-running", str(a.max_running)]
            self.engines.append(ManagedProcess(f"engine{i}", argv, self.work))
            self.urls.append(f"http://127.0.0.1:{port}")
        for e, url in zip(self.engines, self.urls, strict=True):
            wait_http_ok(url + "/health", 20, e.proc)
        places = a.engines * a.max_running
        gport = free_port()
        env = dict(os.environ, OVERLOAD_ADMIN_KEY=ADMIN_KEY)
        tenants = []
        for name in TENANTS:
            env[f"OVERLOAD_KEY_{name.upper()}"] = self.keys[name]
            tenants.append(
                {"name": name, "key_env": [f"OVERLOAD_KEY_{name.upper()}"], "share": self.shares[name]}
            )
        cfg = {
            "listen": {"host": "127.0.0.1", "port": gport},
            "auth": {"tenants": tenants, "admin_key_env": ["OVERLOAD_ADMIN_KEY"]},
            "pools": [
                {
                    "name": "any",
                    "role": "any",
                    "engines": [{"name": f"e{i}", "url": u, "model": MODEL} for i, u in enumerate(self.urls)],
                }
            ],
            "admission": {
                "max_inflight": places,
                "max_queue": 2 * places,
                "max_inflight_per_engine": a.per_engine or places,
                "max_queue_per_engine": 2 * places,
                "queue_timeout_s": a.queue_timeout_s,
            },
        }
        (self.work / "gateway.yaml").write_text(json.dumps(cfg))
        self.gateway = ManagedProcess(
            "gateway",
            [sys.executable, "-m", "gateway", "serve", "--config", str(self.work / "gateway.yaml")],
            self.work,
            env=env,
        )
        self.bases["agentgw"] = f"http://127.0.0.1:{gport}"
        wait_http_ok(self.bases["agentgw"] + "/ready", 60, self.gateway.proc)

    def start_router(self, turns_per_s: float) -> None:
        """vllm-router with its limiter at the fleet's places and measured rate."""
        a = self.args
        places = a.engines * a.max_running
        if "vllm-router" in a.targets:
            binary = a.vllm_router_bin
            if not binary or not Path(binary).exists():
                raise SystemExit(
                    "no vllm-router executable: run scripts/bench-setup.sh (or --vllm-router-bin)"
                )
            rport = free_port()
            argv = [binary, "--host", "127.0.0.1", "--port", str(rport), "--policy", "cache_aware"]
            argv += ["--max-concurrent-requests", str(places), "--queue-size", str(2 * places)]
            argv += ["--queue-timeout-secs", str(max(1, round(a.queue_timeout_s)))]
            argv += ["--rate-limit-tokens-per-second", str(max(1, round(turns_per_s)))]
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            argv += ["--log-level", "warning", "--worker-urls", *self.urls]
            self.router = ManagedProcess("vllm-router", argv, self.work)
            self.bases["vllm-router"] = f"http://127.0.0.1:{rport}"
            wait_http_ok(self.bases["vllm-router"] + "/health", 60, self.router.proc)

    def stop(self) -> None:
        for p in (self.gateway, self.router, *self.engines):
            if p is not None:
                p.stop()

    def run(self, target: str, load: str, sessions: int, duration: float, seed: int) -> Run:
        run = Run(target, load, sessions, duration)
        asyncio.run(
            drive(
                self.bases[target],
                self.keys,
                sessions,
                duration,
                self.args.gap_s,
                seed,
                run,
                target == "agentgw",
            )
        )
        return run


def capacity(fleet: Fleet, slo: Slo, args: argparse.Namespace) -> tuple[int, list[str]]:
    """The most sessions at which >= 95% of turns meet the SLO and none is refused (agentgw)."""
    places = args.engines * args.max_running
    ladder = sorted({max(3, round(places * f)) for f in (0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8)})
    best, lines = 0, []
    for n in ladder:
        run = fleet.run("agentgw", f"cap{n}", n, args.capacity_duration, 7 + n)
        s = summarize(run, slo, fleet.shares)
        holds = s["slo_first_try"] >= 0.95
        lines.append(
            f"| {n} | {s['goodput']:.1f} | {100 * s['slo_share']:.1f}% | {s['refused']:.0f} | {s['ttft_p90'] * 1000:.0f} | {'yes' if holds else 'no'} |"
        )
        if not holds:
            break
        best = n
    return best, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--max-running", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--ttft-ms", type=float, default=150.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--gap-s", type=float, default=1.0, help="mean tool gap between a session's turns")
    ap.add_argument(
        "--shares", type=float, nargs=3, default=[3.0, 2.0, 1.0], help="the tenants' configured shares"
    )
    ap.add_argument("--queue-timeout-s", type=float, default=0.5)
    ap.add_argument(
        "--per-engine",
        type=int,
        default=0,
        help="agentgw's admission.max_inflight_per_engine (0: the fleet's places, so the one fair queue is the gateway's)",
    )
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tok-s", type=float, default=50.0)
    ap.add_argument("--loads", default="1,3,10", help="multiples of the measured capacity")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of each load and target")
    ap.add_argument("--capacity-duration", type=float, default=10.0)
    ap.add_argument(
        "--capacity-sessions", type=int, default=0, help="skip the search: 1x is this many sessions"
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--targets", default="agentgw,vllm-router")
    ap.add_argument("--vllm-router-bin", default=_default_vllm_router_bin())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tok_s)
    loads = [float(x) for x in args.loads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="overload-"))
    fleet = Fleet(args, work)
    results: dict[tuple[str, float], list[dict[str, float]]] = {}
    try:
        fleet.start()
        if args.capacity_sessions:
            cap, cap_lines = args.capacity_sessions, []
        else:
            cap, cap_lines = capacity(fleet, slo, args)
        if cap == 0:
            print("the SLO does not hold at the smallest load: nothing to overload", file=sys.stderr)
            return 1
        if "vllm-router" in args.targets:  # its limiter's rate: what agentgw serves at 1x
            one = summarize(fleet.run("agentgw", "rate", cap, args.capacity_duration, 3), slo, fleet.shares)
            fleet.start_router(one["goodput"])
        for rep in range(args.repeat):
            order = args.targets if rep % 2 == 0 else list(reversed(args.targets))
            for load in loads:
                for target in order:
                    run = fleet.run(
                        target, f"{load:g}x", max(1, round(cap * load)), args.duration, 1000 * rep + int(load)
                    )
                    results.setdefault((target, load), []).append(summarize(run, slo, fleet.shares))
    finally:
        fleet.stop()
    med = {
        k: {m: statistics.median(r.get(m, 0.0) for r in v) for m in sorted({m for r in v for m in r})}
        for k, v in results.items()
    }
    places = args.engines * args.max_running
    turn_s = (args.ttft_ms + args.itl_ms * (args.tokens - 1)) / 1000
    print(
        f"# {args.engines} stand-in engines x {args.max_running} places, a turn ~{turn_s * 1000:.0f} ms "
        f"({args.tokens} tokens): ~{places / turn_s:.1f} turns/s; tool gap {args.gap_s:g} s; "
        f"SLO TTFT <= {args.slo_ttft_ms:g} ms and >= {args.slo_tok_s:g} tok/s; tenants "
        + ", ".join(f"{n} share {s:g}" for n, s in fleet.shares.items())
        + f"; agentgw queue timeout {args.queue_timeout_s:g} s; medians of {args.repeat} run(s) of {args.duration:g} s"
    )
    if cap_lines:
        print("\n| capacity: sessions | goodput turns/s | turns in SLO | refused | p90 TTFT ms | SLO holds |")
        print("|---|---|---|---|---|---|")
        print("\n".join(cap_lines))
    print(f"\n1x = {cap} sessions\n")
    print(
        "| target | load | sessions | attempts/s | goodput/s | interactive | background | jain | lowest tenant "
        "| gold / silver / bronze | refused | honest Retry-After: all / interactive | queue p50 / max | p90 TTFT ms | p90 first token from first try ms |"
    )
    print("|" + "---|" * 15)
    for (target, load), s in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(
            f"| {target} | {load:g}x | {s['sessions']:.0f} | {s['attempts_s']:.1f} | {s['goodput']:.2f} | "
            f"{s['goodput_interactive']:.2f} | {s['goodput_background']:.2f} | {s['jain']:.3f} | {s['min_ratio']:.2f} | "
            f"{s['ratio_gold']:.2f} / {s['ratio_silver']:.2f} / {s['ratio_bronze']:.2f} | {s['refused']:.0f} | "
            f"{_pct(s['honest'])} / {_pct(s['honest_interactive'])} | {_num(s['queue_p50'])} / {_num(s['queue_max'])} | {_num(s['ttft_p90'] * 1000)} | "
            f"{_num(s['e2e_p90'] * 1000)} |"
        )
    for (target, load), s in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        reasons = {k[7:]: v for k, v in s.items() if k.startswith("reason_")}
        if reasons:
            print(
                f"- {target} {load:g}x refusals by reason, retry bookings by outcome: "
                + ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items()))
            )
    checks = []
    gw1, gw10 = med.get(("agentgw", 1.0)), med.get(("agentgw", 10.0))
    if gw1 and gw10:
        checks.append(
            (
                "interactive goodput at 10x >= 90% of 1x",
                gw10["goodput_interactive"] >= 0.9 * gw1["goodput_interactive"],
                f"{gw10['goodput_interactive']:.2f} vs {gw1['goodput_interactive']:.2f}",
            )
        )
        checks.append(("fairness index at 10x >= 0.95", gw10["jain"] >= 0.95, f"{gw10['jain']:.3f}"))
        checks.append(
            ("no tenant below 80% of its share at 10x", gw10["min_ratio"] >= 0.8, f"{gw10['min_ratio']:.2f}")
        )
    vr10 = med.get(("vllm-router", 10.0))
    if gw10 and vr10:
        checks.append(
            (
                "goodput above vllm-router's at 10x",
                gw10["goodput"] > vr10["goodput"],
                f"{gw10['goodput']:.2f} vs {vr10['goodput']:.2f}",
            )
        )
    print()
    for name, ok, detail in checks:
        print(f"- {'PASS' if ok else 'FAIL'} {name}: {detail}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"capacity_sessions": cap, "runs": {f"{t}@{x:g}x": v for (t, x), v in results.items()}},
                indent=1,
            )
        )
    return 0 if all(ok for _, ok, _ in checks) else 1


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"


def _num(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0f}"


if __name__ == "__main__":
    sys.exit(main())
