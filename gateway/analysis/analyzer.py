"""Prompt analysis (chat-template render, tokenization, block hashing) off the event loop.

One :class:`PromptAnalyzer` per app. Prompts under ``analysis.inline_chars`` characters (a few
hundred tokens) are analysed on the loop, where a round trip to a worker would cost more than the
work. In mode ``process``, prompts under ``analysis.thread_chars`` characters go to one thread of
the gateway process (the in-process tokenizer and its cache: no copy, no socket; the tokenizer's
``encode_batch`` releases the GIL), larger ones to one of two process lanes by the size of their
prompt text: ``small`` (under ``analysis.small_chars`` characters) and ``large``, so that a small
request never waits behind a 200K-token first turn. Each lane runs on its own workers:

- ``process`` (the default): worker processes (``spawn``), each reached through its own socket
  pair that the event loop reads directly, with no thread in the gateway
  (:class:`~gateway.analysis.worker.AnalysisWorker`), one :class:`ChatTokenizer` per
  model in each. Large-lane workers run at a lower CPU priority (``nice``), so the event loop
  and the small lane preempt them. A request
  goes to the worker picked by the content key of its first message
  (:func:`~gateway.analysis.tokenize.affinity_key`), so the content-keyed cache of that worker
  holds the conversation's earlier turns and every session sharing its system prompt; when that
  worker's backlog is full, the least-loaded one. The worker gets the request's raw JSON bytes
  (parsed there, ``cache_salt`` set from the gateway's copy of the body: a tenant's salt replaces
  the client's; a body of 64 KiB to 1 MiB is written into a slot of a shared-memory arena made
  once per worker, the socket carrying only its place) and answers with counts and block hashes
  (packed), plus the token ids only when the caller keeps them (a session's, for KV prefetch): a
  168K-token prompt's ids are 673 KB. A worker that dies fails its requests in flight into
  :class:`AnalysisSkipped` (``worker_died``: routed approximately) and is started again.
- ``thread``: thread pools sharing one tokenizer (and cache) per model. Tokenizers' ``encode_batch``
  releases the GIL, but templating and hashing do not.
- ``inline``: on the event loop, as before this module existed (for comparisons only).

Each request has a budget (``budget_ms``): past it, or when the wait predicted from its worker's
queue (characters queued / the lane's measured characters per second) exceeds it, or the worker
already has ``max_backlog`` requests queued, :meth:`PromptAnalyzer.analyze` raises
:class:`AnalysisSkipped` and the caller routes on the approximate index; the work itself is not cancelled, so the cache
still warms for the next turn. Skips are counted in ``agentgw_analysis_skipped_total{reason}``.

It also keeps the token ids of each session's last prompt (for KV prefetch), bounded by bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.analysis.tokenize import ChatTokenizer, PromptInfo, Unsupported, affinity_key
from gateway.analysis.worker import AnalysisWorker, Spec, WorkerDied, analyse
from gateway.config import AnalysisConfig, ModelConfig
from gateway.errors import BadRequest

__all__ = ["Analysis", "AnalysisRequest", "AnalysisSkipped", "PromptAnalyzer", "SkipCounter", "prompt_chars"]


@dataclass(frozen=True, slots=True)
class AnalysisRequest:
    """What prompt analysis reads of a parsed request."""

    model: str
    kind: str
    """``chat`` (a ``messages`` body) or ``completion`` (a ``prompt`` body)."""
    body: dict[str, Any]
    """The parsed body (the gateway's copy: its ``cache_salt`` is the one that counts)."""
    raw: bytes | None = None
    """The request's JSON bytes, of which ``body`` is the parse (``cache_salt`` aside): a worker
    process gets these instead of a serialization of ``body``."""
    tokens: bool = False
    """Whether :attr:`Analysis.tokens` is wanted (to keep for the session's KV prefetch); else a
    worker process sends back only the counts and block hashes."""


@dataclass(frozen=True, slots=True)
class Analysis:
    """A prompt's exact tokens and vLLM block hashes."""

    num_tokens: int
    hashes: list[int]
    """External (64-bit) vLLM block hashes of the prompt's full blocks."""
    block_size: int
    encoded_tokens: int
    """Tokens encoded for this request (the rest came from the content-keyed cache)."""
    tokens: Sequence[int] = ()
    """The prompt's token ids when asked for (:attr:`AnalysisRequest.tokens`), else maybe empty."""


class SkipCounter(Protocol):
    """Where skipped analyses are counted (the gateway's metrics)."""

    def count_analysis_skipped(self, reason: str) -> None: ...


class AnalysisSkipped(Exception):
    """No exact analysis for this request: route it on the approximate index."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def prompt_chars(kind: str, body: dict[str, Any]) -> int:
    """Characters of prompt text (an estimate of the analysis work; O(messages))."""
    if kind != "chat":
        p = body.get("prompt")
        if isinstance(p, str):
            return len(p)
        return 4 * len(p) if isinstance(p, list) else 0
    n = 0
    for m in body.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(t) for p in c if isinstance(p, dict) and isinstance(t := p.get("text"), str))
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            n += 256 * len(calls)
    tools = body.get("tools")
    return n + 512 * (len(tools) if isinstance(tools, list) else 0)


def _outcome(out: tuple[Any, ...]) -> PromptInfo:
    if out[0] == "info":
        info: PromptInfo = out[1]
        return info
    if out[0] == "bad":
        raise BadRequest(out[1], out[2], out[3])
    if out[0] == "unsupported":
        raise AnalysisSkipped(f"unsupported: {out[1]}")
    if out[0] == "error":
        raise AnalysisSkipped(f"worker_error: {out[1]}")
    hashes = array("Q")
    hashes.frombytes(out[2])
    tokens: Sequence[int] = ()
    if out[4] is not None:
        arr = array("i")
        arr.frombytes(out[4])
        tokens = arr
    return PromptInfo(out[1], hashes.tolist(), out[3], tokens)


# -- the loop side ------------------------------------------------------------------------------


MIN_RATE_SAMPLE_CHARS = 16_384
"""Only analyses of at least this many characters update a lane's speed estimate."""


class _Lane:
    """The workers of one lane (worker processes, or a thread pool), what each has queued, and
    how fast the lane works.

    A request is admitted to a worker only if its predicted wait, (characters queued there +
    its own) / measured characters per second, fits in the budget and the worker has fewer than
    ``max_backlog`` requests queued: otherwise it is routed approximately at once, instead of
    waiting for a budget it cannot meet."""

    def __init__(self, name: str, pools: Sequence[AnalysisWorker | cf.ThreadPoolExecutor]) -> None:
        self.name = name
        self.pools = list(pools)
        self.backlog = [0] * len(pools)
        self.queued_chars = [0] * len(pools)
        self.chars_per_s = 2e6  # optimistic until measured

    def _fits(self, i: int, chars: int, budget_s: float, max_backlog: int) -> bool:
        wait = (self.queued_chars[i] + chars) / self.chars_per_s
        return self.backlog[i] < max_backlog and (self.backlog[i] == 0 or wait <= budget_s)

    def pick(self, key: bytes, chars: int, budget_s: float, max_backlog: int) -> int | None:
        i = int.from_bytes(key[:8], "big") % len(self.pools)
        if self._fits(i, chars, budget_s, max_backlog):
            return i
        j = min(range(len(self.pools)), key=self.queued_chars.__getitem__)
        return j if self._fits(j, chars, budget_s, max_backlog) else None

    def done(self, i: int, chars: int, seconds: float | None) -> None:
        self.backlog[i] -= 1
        self.queued_chars[i] -= chars
        if seconds is not None and chars >= MIN_RATE_SAMPLE_CHARS:
            self.chars_per_s = 0.7 * self.chars_per_s + 0.3 * (chars / max(seconds, 1e-4))

    def workers(self) -> list[AnalysisWorker]:
        return [p for p in self.pools if isinstance(p, AnalysisWorker)]


class PromptAnalyzer:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        config: AnalysisConfig,
        metrics: SkipCounter | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.specs: list[Spec] = [
            (m.name, m.tokenizer, m.block_size, m.hash_seed, m.fast_bpe) for m in models if m.tokenizer
        ]
        self.models = frozenset(s[0] for s in self.specs)
        self.block_sizes = {s[0]: s[2] for s in self.specs}
        self.skipped: dict[str, int] = {}
        self._sessions: OrderedDict[str, array[int]] = OrderedDict()
        self._session_bytes = 0
        self.tokenizers: dict[str, ChatTokenizer] = {}
        """In-process tokenizers (modes inline and thread)."""
        self.lanes: dict[str, _Lane] = {}
        if not self.specs:
            return
        mode = config.mode
        n_large, n_small = config.workers, config.small_workers
        # in-process tokenizers: every request in modes inline and thread, tiny prompts (under
        # inline_chars, well under a millisecond of work) in mode process
        local_bytes = config.cache_bytes if mode != "process" else config.cache_bytes // 16
        self.tokenizers = {
            name: ChatTokenizer(path, bs, seed, local_bytes, fast_bpe=fast)
            for name, path, bs, seed, fast in self.specs
        }
        if mode == "thread":
            self.lanes = {
                "large": _Lane("large", [cf.ThreadPoolExecutor(n_large, thread_name_prefix="analysis")]),
                "small": _Lane("small", [cf.ThreadPoolExecutor(n_small, thread_name_prefix="analysis-s")]),
            }
        elif mode == "process":
            per = (config.cache_bytes - local_bytes) // (n_large + n_small)
            slots = min(config.max_backlog, 64)  # every request the backlog admits, by the arena

            def worker(nice: int) -> AnalysisWorker:
                return AnalysisWorker(self.specs, per, nice, slots)

            # each worker starts now and loads its tokenizers (wait_ready waits for that)
            self.lanes = {
                "large": _Lane("large", [worker(config.large_nice) for _ in range(n_large)]),
                "small": _Lane("small", [worker(0) for _ in range(n_small)]),
            }
            if config.thread_chars > config.inline_chars:
                self.lanes["thread"] = _Lane(
                    "thread", [cf.ThreadPoolExecutor(1, thread_name_prefix="analysis-t")]
                )

    async def wait_ready(self) -> None:
        """Wait until every worker process has started and loaded its tokenizers."""
        await asyncio.gather(*(w.wait_ready() for lane in self.lanes.values() for w in lane.workers()))

    def _skip(self, reason: str) -> AnalysisSkipped:
        key = reason.split(":", 1)[0]
        self.skipped[key] = self.skipped.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.count_analysis_skipped(key)
        return AnalysisSkipped(reason)

    async def analyze(self, req: AnalysisRequest) -> Analysis:
        """The exact tokens and block hashes of a request. Raises :class:`AnalysisSkipped` (route
        approximately: no tokenizer for the model, not reproducible exactly, no time) or
        :class:`~gateway.errors.BadRequest` (the template rejects the body)."""
        model, kind, body = req.model, req.kind, req.body
        bs = self.block_sizes.get(model)
        if bs is None:
            raise AnalysisSkipped("no_tokenizer")  # not counted: nothing was skipped
        cfg = self.config
        chars = prompt_chars(kind, body)
        if cfg.mode == "inline" or chars < cfg.inline_chars:
            try:
                info = self.tokenizers[model].prompt_info(kind, body)
            except Unsupported as exc:
                raise self._skip(f"unsupported: {exc.reason}") from None
        else:
            info = await self._offload(model, kind, body, chars, req.raw, req.tokens)
        return Analysis(info.num_tokens, info.hashes, bs, info.encoded_tokens, info.tokens)

    async def _offload(
        self, model: str, kind: str, body: dict[str, Any], chars: int, raw: bytes | None, keep: bool
    ) -> PromptInfo:
        cfg = self.config
        start = time.monotonic()
        if not self.lanes:
            raise self._skip("closed")
        if chars < cfg.thread_chars and "thread" in self.lanes:
            lane = self.lanes["thread"]
        else:
            lane = self.lanes["small" if chars < cfg.small_chars else "large"]
        key = affinity_key(kind, body) if len(lane.pools) > 1 else b"\0"
        i = lane.pick(key, chars, cfg.budget_ms / 1000, cfg.max_backlog)
        if i is None:
            raise self._skip(f"backlog: {lane.name} lane full")
        pool = lane.pools[i]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Any, ...]]
        if isinstance(pool, AnalysisWorker):
            # the gateway's salt (a tenant's replaces the client's) goes with the raw bytes
            salt = (body["cache_salt"],) if "cache_salt" in body else None
            try:
                data = raw if raw is not None else orjson.dumps(body)
            except TypeError:  # orjson.JSONEncodeError: not JSON (an int past 64 bits)
                raise self._skip("unsupported: body not JSON") from None
            try:
                fut = pool.submit(model, kind, data, salt, keep)
            except WorkerDied:
                raise self._skip("worker_died") from None
        else:
            fut = asyncio.wrap_future(pool.submit(analyse, self.tokenizers[model], kind, body), loop=loop)
        lane.backlog[i] += 1
        lane.queued_chars[i] += chars
        fut.add_done_callback(lambda f: _done(lane, i, chars, f))
        if not fut.done():
            left = cfg.budget_ms / 1000 - (time.monotonic() - start)
            waiter = loop.create_future()
            wake = waiter.set_result
            fut.add_done_callback(lambda _: waiter.done() or wake(None))
            timer = loop.call_later(max(left, 0.0), lambda: waiter.done() or wake(None))
            try:
                await waiter
            finally:
                timer.cancel()
            if not fut.done():  # the work goes on and warms the cache; nobody waits for it
                raise self._skip("budget")
        if fut.exception() is not None:
            if isinstance(fut.exception(), WorkerDied):
                raise self._skip("worker_died")
            fut.result()  # raises
        try:
            return _outcome(fut.result())
        except AnalysisSkipped as exc:
            raise self._skip(exc.reason) from None

    @property
    def workers(self) -> list[AnalysisWorker]:
        """Every worker process's handle (mode process)."""
        return [w for lane in self.lanes.values() for w in lane.workers()]

    # -- session tokens (for KV prefetch) -------------------------------------------------------
    def remember(self, session_id: str, tokens: Sequence[int]) -> None:
        """Keep ``tokens`` as the session's last prompt (bounded by bytes, oldest session out).
        Analysis itself never writes: the caller keeps a turn's tokens once it is admitted."""
        arr = tokens if isinstance(tokens, array) else array("i", tokens)
        old = self._sessions.pop(session_id, None)
        if old is not None:
            self._session_bytes -= old.itemsize * len(old)
        self._sessions[session_id] = arr
        self._session_bytes += arr.itemsize * len(arr)
        while self._session_bytes > self.config.session_tokens_bytes and self._sessions:
            _, gone = self._sessions.popitem(last=False)
            self._session_bytes -= gone.itemsize * len(gone)

    def session_tokens(self, session_id: str) -> list[int] | None:
        """The last prompt's token ids of a session (a copy), if kept."""
        arr = self._sessions.get(session_id)
        return arr.tolist() if arr is not None else None

    def forget(self, session_id: str) -> None:
        arr = self._sessions.pop(session_id, None)
        if arr is not None:
            self._session_bytes -= arr.itemsize * len(arr)

    async def aclose(self) -> None:
        """Stop every worker (processes exit after their current request; what is in flight
        fails into ``worker_died``) and thread pool."""
        lanes = list(self.lanes.values())
        self.lanes = {}
        threads = [p for lane in lanes for p in lane.pools if isinstance(p, cf.ThreadPoolExecutor)]
        for p in threads:
            p.shutdown(wait=False, cancel_futures=True)
        await asyncio.gather(*(w.aclose() for lane in lanes for w in lane.workers()))
        if threads:
            await asyncio.to_thread(_join, threads)


def _join(pools: list[cf.ThreadPoolExecutor]) -> None:
    for p in pools:
        p.shutdown(wait=True)


def _done(lane: _Lane, i: int, chars: int, fut: asyncio.Future[tuple[Any, ...]]) -> None:
    out = None if fut.cancelled() or fut.exception() is not None else fut.result()
    lane.done(i, chars, out[-1] if out else None)
