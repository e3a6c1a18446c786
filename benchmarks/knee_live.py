"""Real engines: a session whose next turn would pass the decode knee at home, moved during its
tool gap (the planner's ``knee_ahead``) against moved when the turn arrives (the router's
``kv_balance``), on the same engines, in one run.

    flock /tmp/agentgw-heavy.lock python -m benchmarks.knee_live      # 3 engines, ~9 min
    python -m benchmarks.knee_live --report RUN.json                  # the table of a saved run

Starts the embedded default's stack once (``gateway.local.embedded``: 3 tiny-llama vLLM CPU
engines with engine_ext's offload connector, control API and a Mooncake tier, KV events), with
a small device KV cache (``--num-gpu-blocks``, vLLM's ``--num-gpu-blocks-override``) so that a
home passes the router's decode knee (the cost model's knee for 50 tok/s: 31% of an engine's KV)
with two sessions' contexts. Then, once per mode, an ``agentgw serve`` over those engines and a
fresh prompt salt:

- ``arrival``: ``migration.enabled: false``: no planner; a turn whose home would pass the knee
  moves when it arrives (``kv_balance``, unpriced: the ``agentic+hints`` router) and its new
  engine loads what it lacks from Mooncake while the client waits.
- ``ahead``: the default on engines with the control API: after each turn the planner projects
  the home's decoding KV at the session's expected return (the tool-latency hint) and, past the
  knee, prefetches the session's KV onto another engine during the gap (``knee_ahead``); the
  session is re-homed when the copy is done; the arrival-time moves that remain are priced.

Scenarios: ``rounds`` (default, :class:`Rounds`): sessions in lockstep rounds, the ones on one
engine made hot; ``plays``: seeded AgentX-shaped plays (:func:`gateway.sim.traces.synth_agentx`,
scaled into ``--max-context``, their first ``--max-requests`` requests) through
``benchmarks.live_replay``.

Per mode: the planner's moves by reason and outcome (``agentgw_moves_total``), the routing
reasons, and the *next turns* (each session's turns after its first): served on the previous
turn's engine (local), moved during the tool gap (re-homed by a completed planner move) or moved
at arrival, with TTFT, cached share and, for rounds, each turn's TTFT over the median of the
other turns of its round and kind, hot or cold (the machine's load at that moment).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fidelity import cache_config_info, start_gateway
from benchmarks.live_replay import (
    FIRST_TOKEN_ID,
    LiveConfig,
    LiveRecord,
    format_table,
    run_live,
    stream_request,
    truncate_play,
)
from gateway.local.engines import free_ports
from gateway.sim.metrics import percentile
from gateway.sim.scale import scale_plays
from gateway.sim.traces import Play, synth_agentx, trace_stats

MODES = ("arrival", "ahead")
ARRIVAL_MOVES = {"kv_balance", "kv_overflow"}
"""Routing reasons of a turn moved at arrival because its home had no room under the knee."""


def plays_for(args: argparse.Namespace) -> list[Play]:
    """The seeded AgentX-shaped plays, scaled into the engines' window and cut."""
    plays = scale_plays(synth_agentx(args.plays, seed=args.seed), args.max_context, 128, args.max_output)
    return [truncate_play(p, args.max_requests) for p in plays]


def mode_config(base: dict[str, Any], mode: str, turn_s: float | None = None) -> dict[str, Any]:
    """``turn_s``: the planner's ``migration.turn_s`` (how long a turn holds its KV) in ``ahead``."""
    cfg = copy.deepcopy(base)
    cfg["timeouts"] = {"health_interval_s": 0.5, "metrics_interval_s": 0.5}
    if mode == "arrival":
        cfg.setdefault("migration", {})["enabled"] = False
    elif mode != "ahead":
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    elif turn_s is not None:
        cfg.setdefault("migration", {})["turn_s"] = turn_s
    return cfg


@dataclass
class NextTurns:
    """Each session's turns after its first, by where they ran relative to the turn before."""

    local: list[LiveRecord]
    """Served on the previous turn's engine."""
    moved: list[LiveRecord]
    """Served on another engine."""

    @property
    def moved_at_arrival(self) -> list[LiveRecord]:
        """Of ``moved``, those the router moved at arrival (``kv_balance`` / ``kv_overflow``)."""
        return [r for r in self.moved if r.reason in ARRIVAL_MOVES]

    @property
    def moved_in_gap(self) -> list[LiveRecord]:
        """Of ``moved``, those re-homed before they arrived (a completed planner move)."""
        return [r for r in self.moved if r.reason not in ARRIVAL_MOVES]


def next_turns(records: Sequence[LiveRecord]) -> NextTurns:
    by_session: dict[str, list[LiveRecord]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    local: list[LiveRecord] = []
    moved: list[LiveRecord] = []
    for turns in by_session.values():
        turns.sort(key=lambda r: (r.t_arrive, r.idx))
        for prev, cur in itertools.pairwise(turns):
            if prev.error or cur.error or cur.t_first < 0 or not prev.engine or not cur.engine:
                continue
            (local if cur.engine == prev.engine else moved).append(cur)
    return NextTurns(local, moved)


def ttft_ms(recs: Sequence[LiveRecord]) -> list[float]:
    return [(r.t_first - r.t_arrive) * 1000.0 for r in recs]


def cached_share(recs: Sequence[LiveRecord]) -> float:
    tin = sum(r.input_tokens for r in recs)
    return sum(max(0, r.cached_tokens) for r in recs) / tin if tin else float("nan")


_MOVES = re.compile(r"^agentgw_moves_total\{([^}]*)\} ([0-9.e+]+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def planner_moves(url: str) -> dict[str, int]:
    """The gateway's planner moves, ``"<reason> <outcome>" -> count`` (``agentgw_moves_total``)."""
    out = {}
    for labels, v in _MOVES.findall(httpx.get(url + "/metrics", timeout=10).text):
        lab = dict(_LABEL.findall(labels))
        if float(v):
            out[f"{lab.get('reason')} {lab.get('outcome')}"] = int(float(v))
    return dict(sorted(out.items()))


@dataclass
class Rounds:
    """The directed scenario: ``sessions`` agent sessions take their turns in lockstep rounds
    (all at once, then a ``gap_s`` tool gap, with the hint), so that the sessions homed on one
    engine hold their KV there at the same time. After the first round the engine that got the
    most sessions is made hot: each of its sessions grows by ``hot_growth`` tokens a turn (a long
    tool result), every other session by ``cold_growth``. With the default 96 blocks per engine
    (knee 3,809 tokens), two hot sessions pass the knee together from the third turn, neither alone
    does, and a cold engine can take one."""

    sessions: int = 4
    rounds: int = 6
    gap_s: float = 4.0
    start_tokens: int = 1024
    hot_growth: int = 512
    cold_growth: int = 32
    max_tokens: int = 4


async def _turn(
    client: Any, sid: str, idx: int, prompt: list[int], gap_s: float, max_tokens: int
) -> LiveRecord:
    rec = LiveRecord("rounds", "root", idx, sid, "", time.perf_counter(), -1.0, -1.0, len(prompt), 0, -1)
    hints = {"session_id": sid, "turn_index": idx, "expected_tool_latency_ms": round(gap_s * 1000)}
    extra = {"ignore_eos": True, "agent_hints": hints}
    return await stream_request(client, rec, "tiny-llama", max_tokens, extra, {}, time.perf_counter, prompt)


def run_rounds(url: str, sc: Rounds, salt: int) -> tuple[list[LiveRecord], set[str]]:
    """Play the scenario against the gateway at ``url``; returns every turn and the hot sessions."""
    import asyncio

    rng = random.Random(salt)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, 4096) for _ in range(n)]

    sids = [f"knee-{salt}-{i}" for i in range(sc.sessions)]
    prompts = {sid: tokens(sc.start_tokens) for sid in sids}
    records: list[LiveRecord] = []
    hot: set[str] = set()

    async def go() -> None:
        from openai import AsyncOpenAI

        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as http,
            AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0) as client,
        ):
            for k in range(sc.rounds):
                if k:
                    await asyncio.sleep(sc.gap_s)  # the tool runs
                turns = await asyncio.gather(
                    *(_turn(client, sid, k, prompts[sid], sc.gap_s, sc.max_tokens) for sid in sids)
                )
                records.extend(turns)
                if k == 0:
                    homes = Counter(r.engine for r in turns if r.engine)
                    engine = max(sorted(homes), key=lambda e: homes[e])
                    hot.update(r.session_id for r in turns if r.engine == engine)
                for sid in sids:  # the answer and the tool result join the context
                    prompts[sid] = prompts[sid] + tokens(sc.hot_growth if sid in hot else sc.cold_growth)

    asyncio.run(go())
    return records, hot


def round_ratio(turn: LiveRecord, records: Sequence[LiveRecord], hot: set[str]) -> float | None:
    """The rounds scenario: ``turn``'s TTFT over the median TTFT of the other turns of its round
    (same repeat, same turn index) of its own kind (hot sessions with hot ones: the same new
    tokens to prefill): they share the machine's load at that moment, so the ratio separates a
    turn's own cost from a noisy machine's. None for a play's turn or a turn with no such peer."""
    if not turn.session_id.startswith("knee-"):
        return None
    run, kind = turn.session_id.rsplit("-", 1)[0], turn.session_id in hot
    others = [
        (r.t_first - r.t_arrive) * 1000.0
        for r in records
        if r is not turn
        and r.idx == turn.idx
        and r.session_id.rsplit("-", 1)[0] == run
        and (r.session_id in hot) == kind
        and r.t_first >= 0
    ]
    if not others:
        return None
    return (turn.t_first - turn.t_arrive) * 1000.0 / statistics.median(others)


def next_turns_report(records: Sequence[LiveRecord], hot: set[str] | None = None) -> dict[str, Any]:
    nt = next_turns(records)

    def part(recs: Sequence[LiveRecord]) -> dict[str, Any]:
        ratios = [x for r in recs if (x := round_ratio(r, records, hot or set())) is not None]
        return {"n": len(recs), "ttft_ms": ttft_ms(recs), "cached": cached_share(recs), "round_ratio": ratios}

    return {
        "local": part(nt.local),
        "moved": part(nt.moved),
        "moved_in_gap": part(nt.moved_in_gap),
        "moved_at_arrival": part(nt.moved_at_arrival),
    }


def format_next_turns(modes: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'mode':<8} | {'next turns, local (n: TTFT p50 / p90, cached, xround)':<52} | "
        f"{'moved during the tool gap (re-homed)':<44} | {'moved at arrival':<44} | planner moves completed"
    )
    lines = [head, "-" * len(head)]
    for mode, d in modes.items():
        nt = d["next_turns"]

        def c(k: str, nt: dict[str, Any] = nt) -> str:
            v = nt[k]
            if not v["n"]:
                return "-"
            t = v["ttft_ms"]
            out = f"{v['n']}: {statistics.median(t):.0f} / {percentile(t, 90):.0f} ms, {v['cached']:.0%}"
            if v.get("round_ratio"):
                out += f", x{statistics.median(v['round_ratio']):.2f}"
            return out

        moves = sum(n for k, n in d["planner_moves"].items() if k.endswith(" completed"))
        lines.append(
            f"{mode:<8} | {c('local'):<52} | {c('moved_in_gap'):<44} | {c('moved_at_arrival'):<44} | {moves}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.knee_live", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--scenario",
        choices=("rounds", "plays"),
        default="rounds",
        help="rounds: the directed hot-engine scenario (Rounds); plays: seeded AgentX-shaped plays",
    )
    ap.add_argument("--rounds", type=int, default=Rounds.rounds)
    ap.add_argument("--sessions", type=int, default=Rounds.sessions)
    ap.add_argument("--gap", type=float, default=Rounds.gap_s, help="rounds: the tool gap (s)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds: the scenario this many times per mode")
    ap.add_argument("--plays", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-requests", type=int, default=24, help="per play")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--num-gpu-blocks", type=int, default=96, help="per engine (128-token blocks)")
    ap.add_argument("--lanes", type=int, default=9)
    ap.add_argument("--speedup", type=float, default=4.0, help="the plays' tool gaps divided by this")
    ap.add_argument(
        "--turn-s",
        type=float,
        default=3.0,
        help="migration.turn_s of the ahead mode: how long a turn holds its KV on these engines "
        "(a prefill and a few output tokens: 1-3 s; the default, 20 s, is a full-scale AgentX turn)",
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", type=Path, default=Path("benchmarks/out/knee_live.json"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--report", type=Path, help="print the next-turns table of a saved --json and exit")
    args = ap.parse_args(argv)
    if args.report is not None:
        saved = json.loads(args.report.read_text())
        for d in saved["modes"].values():
            d["next_turns"] = next_turns_report(
                [LiveRecord(**r) for r in d["records"]], set(d.get("hot_sessions", []))
            )
        print(format_next_turns(saved["modes"]))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        mode_config({}, m)  # an unknown mode fails before the engines start

    from gateway.local.embedded import start_local_stack
    from gateway.local.layout import DEFAULT

    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "modes": {}}
    sc = Rounds(sessions=args.sessions, rounds=args.rounds, gap_s=args.gap)
    plays: list[Play] = []
    if args.scenario == "plays":
        plays = plays_for(args)
        st = trace_stats(plays)
        report["trace"] = st
        print(
            f"plays: {st['plays']} AgentX-shaped (seed {args.seed}), {st['requests']} requests, "
            f"{st['input_tokens']} input tokens, ideal reuse {st['ideal_hit_rate']:.1%}",
            flush=True,
        )
    else:
        print(f"rounds: {sc}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="agentgw-knee-live-"))
    t0 = time.perf_counter()
    stack = start_local_stack(
        DEFAULT,
        store="mooncake",
        home=work,
        max_model_len=args.max_context,
        extra_args=("--num-gpu-blocks-override", str(args.num_gpu_blocks)),
        timeout_s=400,
    )
    rows = []
    try:
        urls = [s.url for s in stack.specs]
        info = cache_config_info(urls[0])
        print(
            f"{len(urls)} engines up in {time.perf_counter() - t0:.0f} s: block_size {info.get('block_size')}, "
            f"num_gpu_blocks {info.get('num_gpu_blocks')} (logs in {work / 'logs'})",
            flush=True,
        )
        port = free_ports(1)[0]
        gw_url = f"http://127.0.0.1:{port}"
        salt = random.randrange(1 << 30)
        for i, mode in enumerate(modes):
            mdir = work / mode
            mdir.mkdir()
            gw = start_gateway(mode_config(stack.config, mode, args.turn_s), mdir, port)
            hot: set[str] = set()
            try:
                if args.scenario == "plays":
                    live = LiveConfig(
                        url=gw_url,
                        speedup=args.speedup,
                        lanes=args.lanes,
                        salt=salt + i,
                        progress=not args.no_progress,
                    )
                    m, records = run_live(plays, live, urls, label=mode)
                    rows.append(m)
                    print(format_table([m]), flush=True)
                else:
                    records = []
                    for rep in range(args.repeats):
                        recs, h = run_rounds(gw_url, sc, salt + 1000 * rep + i)
                        records += recs
                        hot |= h
                time.sleep(1.0)  # the last turns' plans
                moves = planner_moves(gw_url)
            finally:
                gw.terminate()
                gw.wait(30)
            ok = [r for r in records if not r.error and r.t_first >= 0]
            reasons = Counter(r.reason for r in ok)
            d: dict[str, Any] = {
                "requests": len(records),
                "errors": len(records) - len(ok),
                "ttft_p50_ms": percentile(ttft_ms(ok), 50) if ok else float("nan"),
                "ttft_p90_ms": percentile(ttft_ms(ok), 90) if ok else float("nan"),
                "planner_moves": moves,
                "reasons": dict(reasons),
                "next_turns": next_turns_report(records, hot),
                "records": [asdict(r) for r in records],
            }
            if hot:
                d["hot_sessions"] = sorted(hot)
            report["modes"][mode] = d
            print(
                f"{mode}: {len(records)} requests, {d['errors']} errors, TTFT p50 {d['ttft_p50_ms']:.0f} / "
                f"p90 {d['ttft_p90_ms']:.0f} ms; routing reasons {dict(reasons.most_common())}; "
                f"planner moves {moves}",
                flush=True,
            )
    finally:
        stack.stop()

    if rows:
        print()
        print(format_table(rows))
    print()
    print(format_next_turns(report["modes"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
