"""Live mode: replay an agent trace against a running gateway (or any OpenAI-compatible server).

    python -m benchmarks.live_replay --url http://127.0.0.1:8000 --trace ../shared/traces/weka \\
        --plays 2 --max-requests 30 --scale --speedup 50 --engines http://127.0.0.1:P1,http://127.0.0.1:P2
    python -m benchmarks.live_replay ... --no-hints          # the same replay without any hint

The trace is a Weka/AgentX folder or file (``gateway.sim.traces.load_weka``), optionally cut
to the first ``--max-requests`` requests of the first ``--plays`` plays and scaled down with
``gateway.sim.scale.scale_plays`` (``--scale``: 128-token blocks, a context that fits a tiny
model, the same gaps). ``--write-weka DIR`` writes the replayed plays back as Weka JSON (what the
simulator and aiperf read).

Replay rules are the simulator's (``gateway.sim.cluster``): ``--lanes`` plays at a time, a
request is sent when its dependencies are met (previous turn completed + recorded gap, subagent
spawned on its parent's dispatch or completion, joins), every recorded gap divided by
``--speedup``. Requests are streamed with the OpenAI SDK (async client).

Prompts: every hash id is one block of ``block_size`` tokens whose content is a deterministic
function of the id (and of ``--salt``, so a new run does not hit an old run's cache): equal hash
ids give equal blocks, so the engines' real prefix caches see exactly the trace's sharing. The
partial last block is unique per request (it has no hash id and is never reused). ``--api
completions`` (default) sends token ids, so blocks align with the engine's blocks exactly;
``--api chat`` sends one user message of deterministic words per block (approximate alignment:
the chat template and the tokenizer move the boundaries).

Hints (``--hints body``, default): ``agent_hints`` {session_id (``play`` or ``play#subagent``),
parent_session_id and agent_role ``subagent`` for subagents, fan_out, turn_index,
expected_tool_latency_ms (the recorded gap before the stream's next request, divided by the
speed-up)}. ``--hints headers``: the headers aiperf/Dynamo send (``X-Session-ID``,
``X-Dynamo-Session-ID``, ``X-Dynamo-Parent-Session-ID``, ``X-Correlation-ID``). ``--no-hints``:
nothing. ``ignore_eos`` makes every request produce its recorded output length.

Metrics (the simulator's where measurable): TTFT p50/p90/p99 (send -> first streamed token), P90
interactivity (output tok/s while decoding: ``(out - 1) / (t_last - t_first)``, the value 90% of
requests reach), prefix hit rate two ways: per request from ``usage.prompt_tokens_details.
cached_tokens`` (the simulator's definition: cached / input tokens) and from the engines'
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` deltas; recomputed tokens
(``vllm:prompt_tokens_by_source_total{source="local_compute"}`` delta, and that minus the trace's
ideal misses), preemptions. Engine URLs: ``--engines``, else ``--gateway-config`` (its pools),
else the gateway's ``GET /debug/engines`` when it has one; without any, the engine-side columns
are empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import default_weka_traces
from gateway.sim.metrics import ideal_hits_by_request, percentile
from gateway.sim.scale import scale_plays, weka_json
from gateway.sim.traces import DISPATCH, Play, TraceRequest, load_weka

__all__ = [
    "ENGINE_COUNTERS",
    "LiveConfig",
    "LiveMetrics",
    "LiveRecord",
    "PromptSynth",
    "format_table",
    "load_trace",
    "replay",
    "run_live",
    "scrape_engines",
    "summarize_live",
    "truncate_play",
    "weka_json",
]

FIRST_TOKEN_ID = 3  # the tiny models' special tokens are ids 0-2
_WORDS = tuple(
    a + b
    for a in ("ka", "lo", "mi", "su", "te", "ra", "no", "vi", "de", "po", "ga", "zu", "fe", "ho", "ji", "be")
    for b in ("n", "ra", "to", "mi", "ku", "sa", "le", "do", "ri", "va", "po", "ne", "gu", "ti", "so", "ba")
)

#: Engine counters scraped before and after a run (Prometheus name, label filter).
ENGINE_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "prefix_hits": ("vllm:prefix_cache_hits_total", {}),
    "prefix_queries": ("vllm:prefix_cache_queries_total", {}),
    "local_compute": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "local_cache_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "preemptions": ("vllm:num_preemptions_total", {}),
}


# -- trace ---------------------------------------------------------------------------------------
def truncate_play(play: Play, max_requests: int) -> Play:
    """The play's first ``max_requests`` requests (file order); dependencies only point backwards,
    so the cut keeps every remaining request's dependencies."""
    if max_requests <= 0 or len(play.requests) <= max_requests:
        return play
    reqs = play.requests[:max_requests]
    streams = {r.stream for r in reqs}
    subs = {s: n for s, n in play.subagents.items() if s in streams}
    return replace(play, requests=reqs, subagents=subs)


def load_trace(
    path: str | Path,
    plays: str | int = 0,
    max_requests: int = 0,
    scale: bool = False,
    max_context: int = 4096,
    block_size: int = 128,
    max_output: int = 64,
) -> list[Play]:
    """Weka plays: ``plays`` = N (the first N by name, 0 = all) or comma-separated play ids."""
    loaded = load_weka(path)
    if isinstance(plays, str) and plays and not plays.isdigit():
        wanted = plays.split(",")
        by_id = {p.play_id: p for p in loaded}
        missing = [w for w in wanted if w not in by_id]
        if missing:
            raise SystemExit(f"plays not in the trace: {', '.join(missing)}")
        loaded = [by_id[w] for w in wanted]
    elif int(plays or 0) > 0:
        loaded = loaded[: int(plays)]
    loaded = [truncate_play(p, max_requests) for p in loaded]
    if scale:
        loaded = scale_plays(loaded, max_context=max_context, block_size=block_size, max_output=max_output)
    return loaded


# -- prompts -------------------------------------------------------------------------------------
class PromptSynth:
    """Deterministic prompt content per hash id: equal ids give equal blocks."""

    def __init__(self, vocab_size: int = 4096, salt: int = 0) -> None:
        self.vocab_size = vocab_size
        self.salt = salt
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def _rng(self, key: object) -> random.Random:
        return random.Random(f"{self.salt}:{key}")

    def block(self, h: int, n: int) -> list[int]:
        key = (h, n)
        out = self._blocks.get(key)
        if out is None:
            rng = self._rng(h)
            out = [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(n)]
            if len(self._blocks) > 200_000:
                self._blocks.clear()
            self._blocks[key] = out
        return out

    def token_ids(self, play: Play, r: TraceRequest) -> list[int]:
        bs = play.block_size
        ids: list[int] = []
        for h in r.hashes:
            ids += self.block(h, bs)
        tail = r.input_tokens - len(ids)
        if tail > 0:
            rng = self._rng(("tail", play.play_id, r.idx))
            ids += [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(tail)]
        return ids

    def text(self, play: Play, r: TraceRequest, words_per_block: int | None = None) -> str:
        """Words instead of token ids (``--api chat``): about 3 words per 4 tokens."""
        bs = play.block_size
        n = words_per_block or max(1, bs * 3 // 4)
        parts = []
        for h in r.hashes:
            rng = self._rng(("w", h))
            parts.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
        tail = r.input_tokens - len(r.hashes) * bs
        if tail > 0:
            rng = self._rng(("wtail", play.play_id, r.idx))
            parts.append(" ".join(rng.choice(_WORDS) for _ in range(max(1, tail * 3 // 4))))
        return "\n".join(parts)


# -- replay --------------------------------------------------------------------------------------
@dataclass(slots=True)
class LiveRecord:
    play: str
    stream: str
    idx: int
    session_id: str
    engine: str
    t_arrive: float
    t_first: float
    t_last: float
    input_tokens: int
    """Prompt tokens the engine saw (usage), else the trace's."""
    output_tokens: int
    cached_tokens: int
    """``usage.prompt_tokens_details.cached_tokens`` (-1: not reported)."""
    error: str = ""
    reason: str = ""
    """The gateway's routing reason (``x-agentgw-reason``)."""
    replica: str = ""
    """The gateway replica(s) a balancer sent it to (``x-upstream-addr``: two when retried)."""
    request_id: str = ""
    """``x-request-id`` as returned."""


@dataclass
class LiveConfig:
    url: str
    model: str = "tiny-llama"
    api: str = "completions"
    hints: str = "body"
    """body | headers | none."""
    speedup: float = 1.0
    lanes: int | None = 4
    salt: int = 0
    vocab_size: int = 4096
    timeout_s: float = 600.0
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=lambda: {"ignore_eos": True})
    api_key: str = "unused"
    """Sent as ``Authorization: Bearer`` (a gateway with tenants' keys needs one)."""


def hint_fields(play: Play, r: TraceRequest, turn: int, next_gap_s: float | None, speedup: float) -> dict:
    """The agent_hints of one request (our body dialect)."""
    hints: dict[str, Any] = {"session_id": play.session_id(r.stream), "turn_index": turn}
    if r.stream != "root":
        hints["parent_session_id"] = play.play_id
        hints["agent_role"] = "subagent"
        fan = play.subagents.get(r.stream, 0)
        if fan:
            hints["fan_out"] = fan
    if next_gap_s is not None:
        hints["expected_tool_latency_ms"] = round(1000.0 * next_gap_s / speedup)
    return hints


def hint_headers(play: Play, r: TraceRequest) -> dict[str, str]:
    """What aiperf / Dynamo send."""
    sid = play.session_id(r.stream)
    h = {"X-Session-ID": sid, "X-Dynamo-Session-ID": sid, "X-Correlation-ID": sid}
    if r.stream != "root":
        h["X-Dynamo-Parent-Session-ID"] = play.play_id
    return h


def _next_gaps(play: Play) -> tuple[dict[int, float | None], dict[int, int]]:
    """Per request: the recorded gap before its stream's next request (None for the last), and
    its turn index within the stream."""
    by_stream: dict[str, list[TraceRequest]] = {}
    for r in play.requests:
        by_stream.setdefault(r.stream, []).append(r)
    gaps: dict[int, float | None] = {}
    turns: dict[int, int] = {}
    for reqs in by_stream.values():
        for k, r in enumerate(reqs):
            turns[r.idx] = k
            gaps[r.idx] = reqs[k + 1].gap_s if k + 1 < len(reqs) else None
    return gaps, turns


async def stream_request(
    client: Any,
    rec: LiveRecord,
    model: str,
    max_tokens: int,
    extra_body: dict[str, Any],
    headers: dict[str, str],
    now: Callable[[], float],
    prompt: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
) -> LiveRecord:
    """One streamed request with the OpenAI SDK's ``client``: a completion of the token ids
    ``prompt``, else a chat of ``messages``. Fills ``rec`` (its ``t_arrive`` already set, on
    ``now``'s clock): the gateway's headers, first and last token times, usage; a failed request
    is recorded in ``rec.error``, never raised."""
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": extra_body,
        "extra_headers": headers,
    }
    n_events = 0
    usage = None
    try:
        if prompt is None:
            ctx = client.chat.completions.with_streaming_response.create(messages=messages, **common)
        else:
            ctx = client.completions.with_streaming_response.create(prompt=prompt, **common)
        async with ctx as resp:
            rec.engine = resp.headers.get("x-agentgw-engine", "")
            rec.reason = resp.headers.get("x-agentgw-reason", "")
            rec.replica = resp.headers.get("x-upstream-addr", "")
            rec.request_id = resp.headers.get("x-request-id", "")
            stream = await resp.parse()
            async for chunk in stream:
                if chunk.choices:
                    t = now()
                    if rec.t_first < 0:
                        rec.t_first = t
                    rec.t_last = t
                    n_events += 1
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage
    except Exception as exc:  # a failed request is recorded; the replay goes on
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    if usage is not None:
        rec.input_tokens = usage.prompt_tokens
        rec.output_tokens = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        rec.cached_tokens = int(cached) if cached is not None else -1
    else:
        rec.output_tokens = n_events
    return rec


class _Replayer:
    def __init__(self, cfg: LiveConfig, client: Any, total: int) -> None:
        self.cfg = cfg
        self.client = client
        self.synth = PromptSynth(cfg.vocab_size, cfg.salt)
        self.records: list[LiveRecord] = []
        self.t0 = time.perf_counter()
        self.bar = None
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", desc="replay", dynamic_ncols=True, file=sys.stderr)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def sleep_until(self, t: float) -> None:
        d = t - self.now()
        if d > 0:
            await asyncio.sleep(d)

    async def send(self, play: Play, r: TraceRequest, turn: int, next_gap: float | None) -> LiveRecord:
        cfg = self.cfg
        extra_body: dict[str, Any] = dict(cfg.extra_body)
        headers: dict[str, str] = {}
        if cfg.hints == "body":
            extra_body["agent_hints"] = hint_fields(play, r, turn, next_gap, cfg.speedup)
        elif cfg.hints == "headers":
            headers = hint_headers(play, r)
        rec = LiveRecord(
            play.play_id, r.stream, r.idx, play.session_id(r.stream), "", self.now(), -1.0, -1.0,
            r.input_tokens, 0, -1,
        )  # fmt: skip
        if cfg.api == "chat":
            messages = [{"role": "user", "content": self.synth.text(play, r)}]
            prompt = None
        else:
            messages, prompt = None, self.synth.token_ids(play, r)
        return await stream_request(
            self.client, rec, cfg.model, r.output_tokens, extra_body, headers, self.now, prompt, messages
        )

    async def run_play(self, play: Play, start: float) -> None:
        loop = asyncio.get_running_loop()
        n = len(play.requests)
        dispatched: list[asyncio.Future[float]] = [loop.create_future() for _ in range(n)]
        completed: list[asyncio.Future[float]] = [loop.create_future() for _ in range(n)]
        gaps, turns = _next_gaps(play)
        first_t = min(q.t for q in play.requests)
        sp = self.cfg.speedup

        async def one(r: TraceRequest) -> None:
            try:
                if r.deps:
                    ready = 0.0
                    for d in r.deps:
                        fut = dispatched[d.on] if d.trigger == DISPATCH else completed[d.on]
                        ready = max(ready, await fut + d.delay_s / sp)
                else:
                    ready = start + (r.t - first_t) / sp
                await self.sleep_until(ready)
                dispatched[r.idx].set_result(self.now())
                rec = await self.send(play, r, turns[r.idx], gaps[r.idx])
                self.records.append(rec)
                if self.bar is not None:
                    self.bar.update(1)
                    if rec.error:
                        self.bar.set_postfix_str(f"error: {rec.error[:60]}")
            finally:
                if not dispatched[r.idx].done():
                    dispatched[r.idx].set_result(self.now())
                completed[r.idx].set_result(self.now())

        await asyncio.gather(*(one(r) for r in play.requests))

    async def run(self, plays: Sequence[Play]) -> list[LiveRecord]:
        queue = deque(plays)
        if self.cfg.lanes is None:
            await asyncio.gather(*(self.run_play(p, p.start_s / self.cfg.speedup) for p in plays))
        else:

            async def lane() -> None:
                while queue:
                    await self.run_play(queue.popleft(), self.now())

            await asyncio.gather(*(lane() for _ in range(min(self.cfg.lanes, len(queue)))))
        if self.bar is not None:
            self.bar.close()
        return self.records


async def replay(plays: Sequence[Play], cfg: LiveConfig) -> list[LiveRecord]:
    """Replay ``plays`` against ``cfg.url``; one record per request."""
    from openai import AsyncOpenAI

    total = sum(len(p.requests) for p in plays)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with (
        httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s, connect=10.0)) as http,
        AsyncOpenAI(
            base_url=cfg.url.rstrip("/") + "/v1", api_key=cfg.api_key, http_client=http, max_retries=0
        ) as client,
    ):
        return await _Replayer(cfg, client, total).run(plays)


# -- engines -------------------------------------------------------------------------------------
def parse_prometheus(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples (optionally those carrying every label in ``labels``)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        try:
            total += float(value)
        except ValueError:
            continue
    return total


def scrape_engines(urls: Sequence[str], timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for u in urls:
        try:
            text = httpx.get(u.rstrip("/") + "/metrics", timeout=timeout_s).text
        except httpx.HTTPError:
            continue
        out[u] = {k: parse_prometheus(text, n, lab) for k, (n, lab) in ENGINE_COUNTERS.items()}
    return out


def engine_urls_from_gateway(url: str, config_path: str | None = None) -> list[str]:
    """Engine URLs: from a gateway config file's pools, else the gateway's ``/debug/engines``."""
    if config_path:
        import yaml

        data = yaml.safe_load(Path(config_path).read_text()) or {}
        return [e["url"] for p in data.get("pools", []) for e in p.get("engines", [])]
    try:
        resp = httpx.get(url.rstrip("/") + "/debug/engines", timeout=5)
        if resp.status_code == 200:
            data = resp.json()
            items = data.get("engines", data) if isinstance(data, dict) else data
            return [e["url"] for e in items if isinstance(e, dict) and "url" in e]
    except (httpx.HTTPError, ValueError):
        pass
    return []


# -- metrics -------------------------------------------------------------------------------------
@dataclass(slots=True)
class LiveMetrics:
    label: str
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    hit_rate: float
    """Token-weighted, from the responses' usage: cached / prompt tokens."""
    ideal_hit_rate: float
    engine_hit_rate: float
    """From the engines' counters: prefix_cache_hits / prefix_cache_queries deltas (nan: no engines)."""
    local_compute_tokens: float
    recomputed_tokens: float
    """local_compute minus the trace's ideal misses (prefill the ideal cache would have saved)."""
    preemptions: float
    interactivity_p90: float
    input_tokens: int
    output_tokens: int
    makespan_s: float
    engines_used: dict[str, int]
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize_live(
    records: Sequence[LiveRecord],
    plays: Sequence[Play],
    before: dict[str, dict[str, float]] | None = None,
    after: dict[str, dict[str, float]] | None = None,
    label: str = "live",
) -> LiveMetrics:
    ok = [r for r in records if not r.error and r.t_first >= 0]
    ideal = ideal_hits_by_request(plays)
    ttft = [(r.t_first - r.t_arrive) * 1000.0 for r in ok]
    tin = sum(r.input_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    cached = sum(max(0, r.cached_tokens) for r in ok)
    ideal_hits = sum(ideal.get((r.play, r.idx), 0) for r in ok)
    inter = [
        (r.output_tokens - 1) / (r.t_last - r.t_first)
        for r in ok
        if r.output_tokens > 1 and r.t_last > r.t_first
    ]
    delta: dict[str, float] = {k: 0.0 for k in ENGINE_COUNTERS}
    have_engines = bool(before and after)
    if before and after:
        for u, a in after.items():
            b = before.get(u, {})
            for k in delta:
                delta[k] += a.get(k, 0.0) - b.get(k, 0.0)
    nan = float("nan")
    queries = delta["prefix_queries"]
    engine_hit = delta["prefix_hits"] / queries if have_engines and queries > 0 else nan
    ideal_miss = sum(r.input_tokens for r in ok) - ideal_hits
    used: dict[str, int] = {}
    for r in ok:
        used[r.engine or "?"] = used.get(r.engine or "?", 0) + 1
    t0 = min((r.t_arrive for r in ok), default=0.0)
    t1 = max((r.t_last for r in ok), default=0.0)
    return LiveMetrics(
        label=label,
        requests=len(records),
        errors=len(records) - len(ok),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        hit_rate=cached / tin if tin else 0.0,
        ideal_hit_rate=ideal_hits / tin if tin else 0.0,
        engine_hit_rate=engine_hit,
        local_compute_tokens=delta["local_compute"] if have_engines else nan,
        recomputed_tokens=max(0.0, delta["local_compute"] - ideal_miss) if have_engines else nan,
        preemptions=delta["preemptions"] if have_engines else nan,
        interactivity_p90=percentile(inter, 10.0),
        input_tokens=tin,
        output_tokens=tout,
        makespan_s=max(0.0, t1 - t0),
        engines_used=dict(sorted(used.items())),
    )


def format_table(rows: Sequence[LiveMetrics]) -> str:
    head = (
        f"{'run':<14} {'reqs':>5} {'err':>4} {'hit':>7} {'engine hit':>10} {'ideal':>7} "
        f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'P90 tok/s':>9} {'local_compute':>13} "
        f"{'recompute':>9} {'preempt':>7} {'span s':>7}"
    )
    lines = [head, "-" * len(head)]
    for m in rows:
        lines.append(
            f"{m.label:<14} {m.requests:>5d} {m.errors:>4d} {m.hit_rate:>7.1%} {m.engine_hit_rate:>10.1%} "
            f"{m.ideal_hit_rate:>7.1%} {m.ttft_p50_ms:>9.0f} {m.ttft_p90_ms:>8.0f} {m.ttft_p99_ms:>8.0f} "
            f"{m.interactivity_p90:>9.1f} {m.local_compute_tokens:>13.0f} {m.recomputed_tokens:>9.0f} "
            f"{m.preemptions:>7.0f} {m.makespan_s:>7.1f}"
        )
    for m in rows:
        lines.append(f"{m.label}: requests per engine {m.engines_used}")
    return "\n".join(lines)


def run_live(
    plays: Sequence[Play], cfg: LiveConfig, engines: Sequence[str] = (), label: str = "live"
) -> tuple[LiveMetrics, list[LiveRecord]]:
    """Scrape the engines, replay, scrape again, summarize."""
    before = scrape_engines(engines) if engines else None
    t = time.perf_counter()
    records = asyncio.run(replay(plays, cfg))
    wall = time.perf_counter() - t
    time.sleep(0.5 if engines else 0.0)  # counters are updated after the last response
    after = scrape_engines(engines) if engines else None
    m = summarize_live(records, plays, before, after, label=label)
    m.wall_s = wall
    return m, records


# -- CLI -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.live_replay",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    ap.add_argument("--url", required=True, help="the gateway (or engine) base URL, without /v1")
    ap.add_argument("--trace", default=None, help="Weka folder or file (default: shared/traces/weka)")
    ap.add_argument("--plays", default="0", help="N (first N plays by name) or play ids, comma-separated")
    ap.add_argument("--max-requests", type=int, default=0, help="keep each play's first N requests")
    ap.add_argument("--scale", action="store_true", help="scale down with gateway.sim.scale")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("--hints", choices=("body", "headers", "none"), default="body")
    ap.add_argument("--no-hints", action="store_true", help="same as --hints none")
    ap.add_argument("--compare", action="store_true", help="run with hints, then again with --no-hints")
    ap.add_argument("--speedup", type=float, default=10.0, help="divides every recorded gap")
    ap.add_argument("--lanes", type=int, default=4, help="plays at a time (0: all at their start)")
    ap.add_argument("--salt", type=int, default=None, help="prompt content salt (default: random)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--engines", default="", help="engine URLs, comma-separated (for /metrics deltas)")
    ap.add_argument("--gateway-config", default=None, help="take the engine URLs from this config")
    ap.add_argument("--write-weka", default=None, help="write the replayed plays as Weka JSON here")
    ap.add_argument("--json", default=None, help="write metrics and per-request records here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--api-key", default="unused", help="the gateway key (Authorization: Bearer)")
    return ap


def default_trace() -> Path:
    return default_weka_traces()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plays = load_trace(
        args.trace or default_trace(),
        args.plays,
        args.max_requests,
        args.scale,
        args.max_context,
        args.block_size,
        args.max_output,
    )
    n_req = sum(len(p.requests) for p in plays)
    print(
        f"trace: {len(plays)} plays, {n_req} requests "
        f"({sum(1 for p in plays for r in p.requests if r.stream != 'root')} subagent), "
        f"{sum(r.input_tokens for p in plays for r in p.requests)} input tokens, block {plays[0].block_size}",
        flush=True,
    )
    if args.write_weka:
        out = Path(args.write_weka)
        out.mkdir(parents=True, exist_ok=True)
        for p in plays:
            (out / f"{p.play_id}.json").write_text(json.dumps(weka_json(p)))
        print(f"wrote {len(plays)} Weka files to {out}")
    engines = [u for u in args.engines.split(",") if u] or engine_urls_from_gateway(
        args.url, args.gateway_config
    )
    if not engines:
        print("no engine URLs (--engines / --gateway-config): engine-side columns stay empty")
    salt = args.salt if args.salt is not None else random.randrange(1 << 30)
    hints = "none" if args.no_hints else args.hints
    runs = [(hints, "hints" if hints != "none" else "no-hints")]
    if args.compare:
        runs = [("body", "hints"), ("none", "no-hints")]
    rows, dump = [], {}
    for i, (mode, label) in enumerate(runs):
        cfg = LiveConfig(
            url=args.url,
            model=args.model,
            api=args.api,
            hints=mode,
            speedup=args.speedup,
            lanes=args.lanes or None,
            salt=salt + i,  # a second run must not hit the first run's cache
            vocab_size=args.vocab_size,
            progress=not args.no_progress,
            api_key=args.api_key,
        )
        m, records = run_live(plays, cfg, engines, label=label)
        rows.append(m)
        dump[label] = {"metrics": m.as_dict(), "records": [asdict(r) for r in records]}
        errs = [r.error for r in records if r.error]
        if errs:
            print(f"{label}: {len(errs)} failed requests, first: {errs[0]}", file=sys.stderr)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"salt": salt, "engines": engines, "runs": dump}, indent=1))
    return 0 if all(m.errors == 0 for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
