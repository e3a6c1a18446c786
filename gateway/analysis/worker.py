"""An analysis worker: one spawned process that renders, tokenizes and hashes prompts, and the
event loop's end of the socket pair it is reached through.

The gateway's side has no thread: :class:`AnalysisWorker` writes length-prefixed request frames
to its end of a ``socketpair`` and reads the answers with the loop's ``add_reader``. (The
``ProcessPoolExecutor`` this replaces fed each request through a feeder thread, woke a
management thread through a pipe and read every answer on that thread: three GIL hand-offs per
request on a core the event loop shares, ~1/3 of the gateway's samples on the 647 KB body.)

Frames, both ways: a 4-byte little-endian length, then the bytes. A request is a ``marshal``-ed
header ``(id, model, kind, salt, keep, place)`` then, unless ``place`` says where the body lies
in the worker's shared-memory arena (:class:`Arena`: bodies of 64 KiB to 1 MiB, copied once on
the loop), the raw JSON body itself. The worker parses the body, sets ``cache_salt`` from the
gateway's copy, analyses it with its :class:`~gateway.analysis.tokenize.ChatTokenizer` and
answers ``(id, outcome)``, ``marshal``-ed: ``("ok", tokens, block hashes as packed ``array("Q")``
bytes, encoded, token ids as packed ``array("i")`` bytes or None, seconds)``, ``("bad", message,
field, code, seconds)`` (a :class:`~gateway.errors.BadRequest`, rebuilt on the gateway's side),
``("unsupported", reason, seconds)`` or ``("error", text, None)`` (the body did not parse, or the
analysis raised: the worker goes on). A worker handles one request at a time, in order; its first
frame says it is ready (its pid).

A worker that dies (EOF on the socket) fails every request in flight with :class:`WorkerDied`
and is started again at once (after a growing delay if it died before it was ready, so a worker
that cannot start does not spin); requests meanwhile fail with :class:`WorkerDied` too. The
worker exits when the gateway closes its end, which the gateway's lifespan does, or the kernel
when the gateway dies. It ignores SIGINT and SIGTERM, so a Ctrl-C or a SIGTERM sent to the whole
process group leaves it serving the requests the gateway drains. For the same reason
``multiprocessing``'s exit handler, which SIGTERMs daemonic children and then joins them, would
wait for ever on a worker whose gateway never ran its lifespan's shutdown (an embedding process
that exits with the gateway still up): an exit handler registered after it, so run before it,
kills the workers still running. Marshal is safe here: both ends are this program.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import marshal
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import struct
import time
import weakref
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import orjson

from gateway.analysis.tokenize import ChatTokenizer, Unsupported
from gateway.errors import BadRequest

__all__ = [
    "ARENA_MIN_BYTES",
    "ARENA_SLOT_BYTES",
    "AnalysisWorker",
    "Spec",
    "WorkerDied",
    "analyse",
]

Spec = tuple[str, str, int, str | None, bool]
"""(model name, tokenizer dir, block size, hash seed, fast BPE on)"""

_LEN = struct.Struct("<I")
_READ_CHUNK = 1 << 18
_RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Seconds before restarting a worker that died before it was ready, by attempt."""

_LIVE: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()
"""Worker processes started and not yet reaped, for :func:`_kill_leftovers`."""


def _kill_leftovers() -> None:
    """At interpreter exit, before ``multiprocessing``'s own handler (``multiprocessing.util`` is
    imported above, so its handler was registered first and runs last): kill the workers still
    running, which ignore the SIGTERM that handler sends and would make its join wait for ever."""
    for proc in list(_LIVE):
        with contextlib.suppress(Exception):
            if proc.exitcode is None:
                proc.kill()
                proc.join(5.0)


atexit.register(_kill_leftovers)


class WorkerDied(Exception):
    """The worker process died (or was stopped) before answering."""


def analyse(tok: ChatTokenizer, kind: str, body: dict[str, Any]) -> tuple[Any, ...]:
    """In this process: ("info", :class:`PromptInfo`, s), ("bad", message, field, code, s) (a
    :class:`~gateway.errors.BadRequest`) or ("unsupported", reason, s); s the seconds it took."""
    start = time.perf_counter()
    try:
        info = tok.prompt_info(kind, body)
    except BadRequest as exc:
        return ("bad", exc.message, exc.field, exc.code, time.perf_counter() - start)
    except Unsupported as exc:
        return ("unsupported", exc.reason, time.perf_counter() - start)
    return ("info", info, time.perf_counter() - start)


# -- the shared-memory arena --------------------------------------------------------------------

ARENA_SLOT_BYTES = 1 << 20
"""A slot's size: larger bodies go through the socket (their analysis dwarfs the copy)."""
ARENA_MIN_BYTES = 64 << 10
"""Smaller bodies go through the socket (one socket buffer: no gain)."""


class Arena:
    """One shared-memory block per worker, cut in slots, for the raw bodies sent to it: the body
    is copied once into a free slot and the frame carries only (name, slot, length), instead of
    647 KB crossing a socket whose buffer holds a fraction of it, each buffer-full a switch to
    the worker and back on a shared core (``benchmarks.analysis_hop``). Slots are taken and given
    back on the event loop. Made on first use; when the block cannot be made (no /dev/shm) the
    socket is used. It outlives a worker's restart (the new one attaches to it).

    ``slots``: bodies in flight through it (more go through the socket). The analyzer gives it
    one per request its backlog admits: a 647 KB body pushed through the socket advances one
    socket buffer (~200 KB) per loop iteration, and the worker, which answers in order, waits for
    it (at c64 on one core with 8 slots, ~all requests were skipped to the approximate index as
    ``backlog``; with 16, 69%: ``benchmarks.overhead``). The block is sparse: only slots written
    take memory."""

    def __init__(self, slots: int = 16) -> None:
        self.slots = slots
        self.shm: shared_memory.SharedMemory | None = None
        self.free: list[int] = []
        self._broken = False

    def put(self, raw: bytes) -> tuple[str, int, int] | None:
        """Copy ``raw`` into a free slot: (name, slot, length) for the worker, else None."""
        if self._broken or not ARENA_MIN_BYTES <= len(raw) <= ARENA_SLOT_BYTES:
            return None
        if self.shm is None:
            try:
                self.shm = shared_memory.SharedMemory(create=True, size=self.slots * ARENA_SLOT_BYTES)
            except OSError:
                self._broken = True
                return None
            self.free = list(range(self.slots))
        if not self.free:
            return None
        slot = self.free.pop()
        buf = self.shm.buf
        assert buf is not None
        buf[slot * ARENA_SLOT_BYTES : slot * ARENA_SLOT_BYTES + len(raw)] = raw
        return self.shm.name, slot, len(raw)

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def close(self) -> None:
        shm, self.shm = self.shm, None
        if shm is not None:
            shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


# -- the worker process -------------------------------------------------------------------------


def _serve(sock: socket.socket, specs: Sequence[Spec], cache_bytes: int, nice: int) -> None:
    """The worker's main: load the tokenizers, say ready, answer frames until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice:
        os.nice(nice)
    toks = {
        name: ChatTokenizer(path, bs, seed, cache_bytes, fast_bpe=fast)
        for name, path, bs, seed, fast in specs
    }
    attached: dict[str, shared_memory.SharedMemory] = {}
    f = sock.makefile("rb", buffering=_READ_CHUNK)

    def send(obj: Any) -> None:
        data = marshal.dumps(obj)
        sock.sendall(_LEN.pack(len(data)) + data)

    def read(n: int) -> bytes:
        data: bytes = f.read(n)
        if len(data) < n:
            raise EOFError
        return data

    try:
        send(os.getpid())
        while True:
            rid, model, kind, salt, keep, place = marshal.loads(read(_LEN.unpack(read(4))[0]))
            raw = read(_LEN.unpack(read(4))[0]) if place is None else None
            try:
                if raw is not None:
                    body = orjson.loads(raw)
                else:
                    name, slot, n = place
                    shm = attached.get(name)
                    if shm is None:
                        shm = attached[name] = shared_memory.SharedMemory(name)
                    buf = shm.buf
                    assert buf is not None
                    body = orjson.loads(buf[slot * ARENA_SLOT_BYTES : slot * ARENA_SLOT_BYTES + n])
                if salt is None:
                    body.pop("cache_salt", None)
                else:
                    body["cache_salt"] = salt[0]
                out = _answer(toks[model], kind, body, keep)
            except Exception as exc:  # a bad body or a bug: this request fails, the worker stays
                out = ("error", f"{type(exc).__name__}: {exc}"[:500], None)
            send((rid, out))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the gateway closed its end: stop


def _answer(tok: ChatTokenizer, kind: str, body: dict[str, Any], keep: bool) -> tuple[Any, ...]:
    """A marshal-able outcome. Token ids travel back only when ``keep`` (a session keeps them):
    for a 168K-token prompt they are 673 KB, the largest part of an answer."""
    out = analyse(tok, kind, body)
    if out[0] != "info":
        return out
    _, info, seconds = out
    data = None
    if keep:
        tokens = info.tokens
        data = tokens.tobytes() if isinstance(tokens, array) else array("i", tokens).tobytes()
    return ("ok", info.num_tokens, array("Q", info.hashes).tobytes(), info.encoded_tokens, data, seconds)


# -- the loop's side ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    fut: asyncio.Future[tuple[Any, ...]]
    slot: int | None


class AnalysisWorker:
    """One worker process and the loop's end of its socket. :meth:`submit` returns a future
    that the worker's answer (or its death: :class:`WorkerDied`) resolves, never a timeout: a
    caller that stops waiting leaves the work to warm the worker's cache.

    The process starts at construction (no loop needed); the loop starts reading on first use.
    Requests in flight are bounded by the caller (its backlog per worker)."""

    def __init__(self, specs: Sequence[Spec], cache_bytes: int, nice: int = 0, arena_slots: int = 16) -> None:
        self._args = (list(specs), cache_bytes, nice)
        self.arena = Arena(arena_slots)
        self.restarts = 0
        """Workers started again after one died."""
        self._pending: dict[int, _Pending] = {}
        self._chunk = bytearray(_READ_CHUNK)
        self._chunk_view = memoryview(self._chunk)
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._failed_starts = 0
        self._restart_handle: asyncio.TimerHandle | None = None
        self._start()

    # -- process lifecycle ----------------------------------------------------------------------
    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=_serve, args=(theirs, *self._args), name="agentgw-analysis", daemon=True)
        try:
            proc.start()
        finally:
            theirs.close()  # the child has its own copy: EOF here when it exits
        _LIVE.add(proc)
        ours.setblocking(False)
        self._proc = proc
        self._sock: socket.socket | None = ours
        self._rbuf = bytearray()
        self._wbuf: deque[memoryview] = deque()
        self._writing = False
        self._ready: asyncio.Future[int] | None = None
        self._pid: int | None = None
        if self._loop is not None:
            self._attach(self._loop)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready = loop.create_future()
        if self._sock is not None:
            loop.add_reader(self._sock.fileno(), self._on_readable)

    def _use_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._attach(loop)
        return loop

    async def wait_ready(self) -> int:
        """The worker's pid, once it has loaded its tokenizers (:class:`WorkerDied` if it died
        first)."""
        self._use_loop()
        if self._closed or self._ready is None:
            raise WorkerDied("closed" if self._closed else "restarting")
        return await asyncio.shield(self._ready)

    @property
    def pid(self) -> int | None:
        """The current worker process's pid (None until it has said it is ready)."""
        return self._pid

    def _disconnect(self) -> bool:
        """Close our end, fail what is in flight; whether the worker had said it was ready."""
        sock, self._sock = self._sock, None
        if sock is None:
            return False
        loop = self._loop
        if loop is not None:
            loop.remove_reader(sock.fileno())
            if self._writing:
                loop.remove_writer(sock.fileno())
        sock.close()
        self._writing = False
        self._wbuf.clear()
        self._rbuf.clear()
        pending, self._pending = self._pending, {}
        for p in pending.values():
            self._settle(p, None)
        ready = self._ready
        if ready is not None and not ready.done():
            ready.set_exception(WorkerDied("died before it was ready"))
            ready.exception()
            return False
        return ready is not None

    def _died(self) -> None:
        """EOF or a broken pipe: fail what is in flight, reap the process, start another."""
        if self._sock is None:
            return
        was_ready = self._disconnect()
        self._reap(self._proc)
        if self._closed:
            return
        self.restarts += 1
        if was_ready:
            self._failed_starts = 0
            self._start()
            return
        delay = _RESTART_DELAYS[min(self._failed_starts, len(_RESTART_DELAYS) - 1)]
        self._failed_starts += 1
        if self._loop is None:
            self._start()
        else:
            self._restart_handle = self._loop.call_later(delay, self._restart_later)

    def _restart_later(self) -> None:
        self._restart_handle = None
        if not self._closed and self._sock is None:
            self._start()

    def _reap(self, proc: multiprocessing.process.BaseProcess) -> None:
        """Collect the exited process without blocking the loop: polled (``waitpid``, no hang)
        every 20 ms, killed if it is still there after 5 s."""
        loop = self._loop
        if loop is None:
            proc.kill()
            proc.join(1.0)
            return
        deadline = loop.time() + 5.0

        def poll() -> None:
            if proc.exitcode is not None:
                return
            if loop.time() > deadline:
                proc.kill()
            loop.call_later(0.02, poll)

        poll()

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self, model: str, kind: str, raw: bytes, salt: tuple[Any] | None, keep: bool
    ) -> asyncio.Future[tuple[Any, ...]]:
        """Send a request: ``raw`` the body's JSON, ``salt`` the ``cache_salt`` to set (``(value,)``)
        or None to remove it, ``keep`` whether the token ids come back. Raises :class:`WorkerDied`
        when no worker is running (it is being restarted)."""
        loop = self._use_loop()
        if self._sock is None or self._closed:
            raise WorkerDied("restarting" if not self._closed else "closed")
        rid = self._next_id
        self._next_id += 1
        place = self.arena.put(raw)
        head = marshal.dumps((rid, model, kind, salt, keep, place))
        parts = [_LEN.pack(len(head)), head]
        if place is None:
            parts += [_LEN.pack(len(raw)), raw]
        fut: asyncio.Future[tuple[Any, ...]] = loop.create_future()
        self._pending[rid] = _Pending(fut, place[1] if place is not None else None)
        self._write(b"".join(parts))
        return fut

    def _settle(self, p: _Pending, out: tuple[Any, ...] | None) -> None:
        if p.slot is not None:
            self.arena.release(p.slot)  # the worker has read it (or died)
        if p.fut.done():
            return
        if out is None:
            p.fut.set_exception(WorkerDied("worker died"))
            p.fut.exception()  # retrieved: a caller that stopped waiting logs nothing
        else:
            p.fut.set_result(out)

    def _write(self, data: bytes) -> None:
        sock = self._sock
        assert sock is not None
        if not self._wbuf:
            try:
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:  # EPIPE, ECONNRESET: the worker is gone
                self._died()
                return
            if n == len(data):
                return
            self._wbuf.append(memoryview(data)[n:])
        else:
            self._wbuf.append(memoryview(data))
        if not self._writing:
            assert self._loop is not None
            self._loop.add_writer(sock.fileno(), self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while self._wbuf:
            data = self._wbuf[0]
            try:
                n = sock.send(data)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._died()
                return
            if n < len(data):
                self._wbuf[0] = data[n:]
                return
            self._wbuf.popleft()
        assert self._loop is not None
        self._loop.remove_writer(sock.fileno())
        self._writing = False

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            got = sock.recv_into(self._chunk)  # into a buffer made once: no 256 KB malloc a call
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = 0
        if not got:
            self._died()
            return
        buf = self._rbuf
        buf += self._chunk_view[:got]
        pos = 0
        while len(buf) - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if len(buf) - pos - 4 < n:
                break
            msg = marshal.loads(memoryview(buf)[pos + 4 : pos + 4 + n])
            pos += 4 + n
            if isinstance(msg, int):  # ready: the worker's pid
                self._pid = msg
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg)
                continue
            rid, out = msg
            p = self._pending.pop(rid, None)
            if p is not None:
                self._settle(p, out)
        if pos:
            del buf[:pos]

    # -- shutdown -------------------------------------------------------------------------------
    async def aclose(self, timeout: float = 10.0) -> None:
        """Close the socket (the worker exits after its current request), fail what is in
        flight, wait for the process (killed past ``timeout``), free the arena."""
        if self._closed:
            return
        self._closed = True
        if self._restart_handle is not None:
            self._restart_handle.cancel()
        proc = self._proc
        self._disconnect()
        # the sentinel pipe closes a moment before the process can be reaped: poll waitpid
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while proc.exitcode is None:
            if loop.time() > deadline:
                proc.kill()
                deadline = loop.time() + timeout
            await asyncio.sleep(0.02)
        self.arena.close()
