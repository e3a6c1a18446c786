"""Prompt analysis (chat-template render, tokenization, block hashing) off the event loop.

One :class:`PromptAnalyzer` per app. Prompts under ``analysis.inline_chars`` characters (a few
hundred tokens) are analysed on the loop, where a round trip to a worker would cost more than the
work. In mode ``process``, prompts under ``analysis.thread_chars`` characters go to one thread of
the gateway process (the in-process tokenizer and its cache: no pickling, no pipe; the tokenizer's
``encode_batch`` releases the GIL), larger ones to one of two process lanes by the size of their
prompt text: ``small`` (under ``analysis.small_chars`` characters) and ``large``, so that a small
request never waits behind a 200K-token first turn. Each lane runs on its own workers:

- ``process`` (the default): single-process pools (``spawn``), one :class:`ChatTokenizer` per
  model in each (the per-process state a pool initializer sets up). Large-lane workers run at a
  lower CPU priority (``nice``), so the event loop and the small lane preempt them. A request
  goes to the worker picked by the content key of its first message
  (:func:`~gateway.service.tokenize.affinity_key`), so the content-keyed cache of that worker
  holds the conversation's earlier turns and every session sharing its system prompt; when that
  worker's backlog is full, the least-loaded one. The worker gets the request's raw JSON bytes
  (parsed there, ``cache_salt`` set from the gateway's copy of the body: a tenant's salt replaces
  the client's; a body of 64 KiB to 1 MiB is written into a slot of a shared-memory arena made
  once per worker, the pipe carrying only its place: :class:`_Arena`) and answers with counts and block hashes, plus the token ids only when the caller
  keeps them (a session's, for KV prefetch): a 168K-token prompt's ids are 673 KB.
- ``thread``: thread pools sharing one tokenizer (and cache) per model. Tokenizers' ``encode_batch``
  releases the GIL, but templating, hashing and pickling do not.
- ``inline``: on the event loop, as before this module existed (for comparisons only).

Each request has a budget (``budget_ms``): past it, or when the wait predicted from its worker's
queue (characters queued / the lane's measured characters per second) exceeds it, or the worker
already has ``max_backlog`` requests queued, :meth:`PromptAnalyzer.analyze` raises
:class:`AnalysisSkipped`
and the caller routes on the approximate index; the work itself is not cancelled, so the cache
still warms for the next turn. Skips are counted in ``agentgw_analysis_skipped_total{reason}``.

It also keeps the token ids of each session's last prompt (for KV prefetch), bounded by bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import orjson

from gateway.config import AnalysisConfig, ModelConfig
from gateway.errors import ApiError
from gateway.service.metrics import GatewayMetrics
from gateway.service.tokenize import ChatTokenizer, PromptInfo, Unsupported, affinity_key

__all__ = ["AnalysisSkipped", "PromptAnalyzer", "prompt_chars"]

_Spec = tuple[str, str, int, str | None]
"""(model name, tokenizer dir, block size, hash seed)"""


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


# -- the worker side (a process of a pool) ------------------------------------------------------

_worker_tokenizers: dict[str, ChatTokenizer] = {}
"""Per worker process: set once by :func:`_init_worker`, the pool initializer."""


def _init_worker(specs: Sequence[_Spec], cache_bytes: int, nice: int) -> None:
    if nice:
        os.nice(nice)
    for name, path, block_size, seed in specs:
        _worker_tokenizers[name] = ChatTokenizer(path, block_size, seed, cache_bytes)


def _run(tok: ChatTokenizer, kind: str, body: dict[str, Any], keep: bool) -> tuple[Any, ...]:
    """A picklable outcome, its last item the seconds it took: ("ok", n, hashes as ``array("Q")``
    bytes, encoded, token bytes or None, s), ("api", ..., s) or ("unsupported", reason, s).
    Token ids travel back only when ``keep`` (a session keeps them): for a 168K-token prompt they
    are 673 KB, the largest part of a worker's answer. (ApiError does not pickle.)"""
    out = _run_local(tok, kind, body)
    if out[0] != "info":
        return out
    _, info, seconds = out
    data = None
    if keep:
        tokens = info.tokens
        data = tokens.tobytes() if isinstance(tokens, array) else array("i", tokens).tobytes()
    hashes = array("Q", info.hashes).tobytes()
    return ("ok", info.num_tokens, hashes, info.encoded_tokens, data, seconds)


def _run_local(tok: ChatTokenizer, kind: str, body: dict[str, Any]) -> tuple[Any, ...]:
    """In this process (a thread): the :class:`PromptInfo` itself, nothing copied."""
    start = time.perf_counter()
    try:
        info = tok.prompt_info(kind, body)
    except ApiError as exc:
        return ("api", exc.status, exc.message, exc.param, exc.code, time.perf_counter() - start)
    except Unsupported as exc:
        return ("unsupported", exc.reason, time.perf_counter() - start)
    return ("info", info, time.perf_counter() - start)


_NO_SALT = ("absent",)


def _work(
    model: str,
    kind: str,
    body: bytes | tuple[str, int, int] | dict[str, Any],
    salt: tuple[Any, ...],
    keep: bool,
) -> tuple[Any, ...]:
    """``body``: the request's raw JSON bytes (parsed here, not pickled on the loop's side), their
    place in the gateway's shared-memory arena (name, slot, length) or, for a prompt converted
    from another API, the chat body itself. ``salt``: the ``cache_salt`` the gateway's copy of
    the body has (the tenant's replaces the client's), ``("absent",)`` or ``("set", value)``."""
    if isinstance(body, (bytes, tuple)):
        body = orjson.loads(body) if isinstance(body, bytes) else _from_arena(*body)
        if salt[0] == "set":
            body["cache_salt"] = salt[1]
        else:
            body.pop("cache_salt", None)
    return _run(_worker_tokenizers[model], kind, body, keep)  # type: ignore[arg-type]


def _ready() -> int:
    return os.getpid()


def _outcome(out: tuple[Any, ...]) -> PromptInfo:
    if out[0] == "info":
        info: PromptInfo = out[1]
        return info
    if out[0] == "api":
        raise ApiError(out[1], out[2], out[3], out[4])
    if out[0] == "unsupported":
        raise AnalysisSkipped(f"unsupported: {out[1]}")
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


ARENA_SLOTS = 8
"""Bodies in flight to one worker through its shared-memory arena (more go through the pipe)."""
ARENA_SLOT_BYTES = 1 << 20
"""A slot's size: larger bodies go through the pipe (their analysis dwarfs the copy)."""
ARENA_MIN_BYTES = 64 << 10
"""Smaller bodies go through the pipe (one pipe buffer: no gain)."""


class _Arena:
    """One shared-memory block per worker process, cut in slots, for the raw bodies sent to it:
    the body is copied once into a free slot and the pipe carries only (name, offset, length),
    instead of the pool's feeder thread pushing 647 KB through a 64 KB pipe buffer, each
    buffer-full a switch to the worker and back on a shared core (``benchmarks.analysis_hop``:
    ~0.3 ms of CPU and ~1 ms of wall time per 647 KB body). Slots are taken and given back on
    the event loop. Made on first use; when the block cannot be made (no /dev/shm) the pipe is
    used."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._free: list[int] = []
        self._broken = False

    def put(self, raw: bytes) -> tuple[str, int, int] | None:
        """Copy ``raw`` into a free slot: (name, slot, length) for the worker, else None."""
        if self._broken or not ARENA_MIN_BYTES <= len(raw) <= ARENA_SLOT_BYTES:
            return None
        if self._shm is None:
            try:
                self._shm = shared_memory.SharedMemory(create=True, size=ARENA_SLOTS * ARENA_SLOT_BYTES)
            except OSError:
                self._broken = True
                return None
            self._free = list(range(ARENA_SLOTS))
        if not self._free:
            return None
        slot = self._free.pop()
        buf = self._shm.buf
        assert buf is not None
        buf[slot * ARENA_SLOT_BYTES : slot * ARENA_SLOT_BYTES + len(raw)] = raw
        return self._shm.name, slot, len(raw)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


_attached: dict[str, shared_memory.SharedMemory] = {}
"""Per worker process: the arenas it has read from, attached once."""


def _from_arena(name: str, slot: int, n: int) -> dict[str, Any]:
    shm = _attached.get(name)
    if shm is None:
        shm = _attached[name] = shared_memory.SharedMemory(name)
    buf = shm.buf
    assert buf is not None
    start = slot * ARENA_SLOT_BYTES
    out: dict[str, Any] = orjson.loads(buf[start : start + n])
    return out


class _Lane:
    """The workers of one lane, what each has queued, and how fast the lane works.

    A request is admitted to a worker only if its predicted wait, (characters queued there +
    its own) / measured characters per second, fits in the budget and the worker has fewer than
    ``max_backlog`` requests queued: otherwise it is routed approximately at once, instead of
    waiting for a budget it cannot meet."""

    def __init__(self, name: str, pools: list[cf.Executor]) -> None:
        self.name = name
        self.pools = pools
        self.backlog = [0] * len(pools)
        self.arenas = [_Arena() for _ in pools]
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


class PromptAnalyzer:
    def __init__(
        self,
        models: Sequence[ModelConfig],
        config: AnalysisConfig,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.specs: list[_Spec] = [
            (m.name, m.tokenizer, m.block_size, m.hash_seed) for m in models if m.tokenizer
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
            name: ChatTokenizer(path, bs, seed, local_bytes) for name, path, bs, seed in self.specs
        }
        if mode == "thread":
            self.lanes = {
                "large": _Lane("large", [cf.ThreadPoolExecutor(n_large, thread_name_prefix="analysis")]),
                "small": _Lane("small", [cf.ThreadPoolExecutor(n_small, thread_name_prefix="analysis-s")]),
            }
        elif mode == "process":
            ctx = multiprocessing.get_context("spawn")
            per = (config.cache_bytes - local_bytes) // (n_large + n_small)

            def pool(nice: int) -> cf.Executor:
                return cf.ProcessPoolExecutor(
                    1, ctx, initializer=_init_worker, initargs=(self.specs, per, nice)
                )

            self.lanes = {
                "large": _Lane("large", [pool(config.large_nice) for _ in range(n_large)]),
                "small": _Lane("small", [pool(0) for _ in range(n_small)]),
            }
            if config.thread_chars > config.inline_chars:
                self.lanes["thread"] = _Lane(
                    "thread", [cf.ThreadPoolExecutor(1, thread_name_prefix="analysis-t")]
                )
            for lane in self.lanes.values():
                for p in lane.pools:
                    if isinstance(p, cf.ProcessPoolExecutor):
                        p.submit(_ready)  # start the worker and load its tokenizers now

    async def wait_ready(self) -> None:
        """Wait until every worker process has started and loaded its tokenizers."""
        loop = asyncio.get_running_loop()
        futs = [
            asyncio.wrap_future(p.submit(_ready), loop=loop)
            for lane in self.lanes.values()
            for p in lane.pools
            if isinstance(p, cf.ProcessPoolExecutor)
        ]
        await asyncio.gather(*futs)

    def _skip(self, reason: str) -> AnalysisSkipped:
        key = reason.split(":", 1)[0]
        self.skipped[key] = self.skipped.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.count_analysis_skipped(key)
        return AnalysisSkipped(reason)

    async def analyze(
        self,
        model: str,
        kind: str,
        body: dict[str, Any],
        session_id: str | None = None,
        *,
        raw: bytes | None = None,
        tokens: bool = True,
    ) -> PromptInfo | None:
        """Exact tokens and block hashes of a request; None when the model has no tokenizer.
        Raises :class:`AnalysisSkipped` (route approximately) or :class:`ApiError` (a 400).

        ``raw``: the request's JSON bytes, of which ``body`` is the parse (``cache_salt`` aside:
        the body's wins); a worker process gets these instead of a pickled ``body``.
        ``tokens``: whether the answer needs the token ids (else a worker process sends back only
        the counts and block hashes, and :attr:`PromptInfo.tokens` may be empty); a
        ``session_id``'s token ids are kept (:meth:`session_tokens`) when they come back."""
        if model not in self.models:
            return None
        cfg = self.config
        chars = prompt_chars(kind, body)
        if cfg.mode == "inline" or chars < cfg.inline_chars:
            try:
                info = self.tokenizers[model].prompt_info(kind, body)
            except Unsupported as exc:
                raise self._skip(f"unsupported: {exc.reason}") from None
        else:
            info = await self._offload(model, kind, body, chars, raw, tokens or session_id is not None)
        if session_id is not None:
            self._remember(session_id, info.tokens)
        return info

    async def _offload(
        self, model: str, kind: str, body: dict[str, Any], chars: int, raw: bytes | None, keep: bool
    ) -> PromptInfo:
        cfg = self.config
        start = time.monotonic()
        if chars < cfg.thread_chars and "thread" in self.lanes:
            lane = self.lanes["thread"]
        else:
            lane = self.lanes["small" if chars < cfg.small_chars else "large"]
        key = affinity_key(kind, body) if len(lane.pools) > 1 else b"\0"
        i = lane.pick(key, chars, cfg.budget_ms / 1000, cfg.max_backlog)
        if i is None:
            raise self._skip(f"backlog: {lane.name} lane full")
        pool = lane.pools[i]
        slot = None
        if isinstance(pool, cf.ProcessPoolExecutor):
            salt = ("set", body["cache_salt"]) if "cache_salt" in body else _NO_SALT
            where = lane.arenas[i].put(raw) if raw is not None else None
            if where is not None:
                slot = where[1]
            payload = where or (raw if raw is not None else body)
            try:
                cfut = pool.submit(_work, model, kind, payload, salt, keep)
            except BaseException:
                if slot is not None:
                    lane.arenas[i].release(slot)
                raise
        else:
            cfut = pool.submit(_run_local, self.tokenizers[model], kind, body)
        lane.backlog[i] += 1
        lane.queued_chars[i] += chars
        loop = asyncio.get_running_loop()
        cfut.add_done_callback(lambda f: _call_soon(loop, _done, lane, i, chars, f, slot))
        fut = asyncio.wrap_future(cfut)
        left = cfg.budget_ms / 1000 - (time.monotonic() - start)
        try:
            out = await asyncio.wait_for(asyncio.shield(fut), max(left, 0.0))
        except TimeoutError:
            fut.add_done_callback(_consume)  # keeps warming the cache; nobody waits for it
            raise self._skip("budget") from None
        except cf.process.BrokenProcessPool:
            lane.pools[i] = self._respawn(lane, pool)
            raise self._skip("worker_died") from None
        try:
            return _outcome(out)
        except AnalysisSkipped as exc:
            raise self._skip(exc.reason) from None

    def _respawn(self, lane: _Lane, old: cf.Executor) -> cf.Executor:
        old.shutdown(wait=False, cancel_futures=True)
        ctx = multiprocessing.get_context("spawn")
        cfg = self.config
        per = (cfg.cache_bytes - cfg.cache_bytes // 16) // (cfg.workers + cfg.small_workers)
        nice = cfg.large_nice if lane.name == "large" else 0
        return cf.ProcessPoolExecutor(1, ctx, initializer=_init_worker, initargs=(self.specs, per, nice))

    # -- session tokens (for KV prefetch) -------------------------------------------------------
    def _remember(self, session_id: str, tokens: Sequence[int]) -> None:
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
        lanes = list(self.lanes.values())
        pools = [p for lane in lanes for p in lane.pools]
        self.lanes = {}
        for p in pools:
            p.shutdown(wait=False, cancel_futures=True)
        if pools:
            await asyncio.to_thread(_join, pools)
        for lane in lanes:
            for arena in lane.arenas:
                arena.close()


def _join(pools: list[cf.Executor]) -> None:
    for p in pools:
        p.shutdown(wait=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """From a pool thread: run ``fn`` on the loop, unless the loop is already gone."""
    if not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # closed in between
            loop.call_soon_threadsafe(fn, *args)


def _done(lane: _Lane, i: int, chars: int, fut: cf.Future[tuple[Any, ...]], slot: int | None = None) -> None:
    out = None if fut.cancelled() or fut.exception() is not None else fut.result()
    lane.done(i, chars, out[-1] if out else None)
    if slot is not None:
        lane.arenas[i].release(slot)  # the worker has read it (or died)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" warning
