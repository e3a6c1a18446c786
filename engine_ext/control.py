"""Control API for the gateway: a small HTTP side server inside the engine's scheduler process.

Why a side server: vLLM 0.32's `vllm.endpoint_plugins` add routes to the API-server process,
but the offload state (host-tier index, pins, tier counters) lives in the EngineCore process,
and the API server has no channel to a connector's scheduler half. The spec starts this server
next to the state it serves when `control_port` is set in kv_connector_extra_config.

Endpoints (JSON; every call needs `Authorization: Bearer <control_token>`):
    GET  /v1/kv/stats                     per-tier bytes, hits, duplicates skipped, latency;
                                          `device`: device pins (pinned blocks, pinned_share)
    GET  /metrics                         the device-pin gauges and counters, Prometheus text
    GET  /v1/kv/sessions/{session_id}     host chunks held for the session, its pins
    POST /v1/kv/pin    {"session_id", "ttl_s"}   (idempotent: re-pinning resets the TTL)
    POST /v1/kv/unpin  {"session_id"}            (idempotent)
    POST /v1/kv/evict  {"session_id"}            drop the pins; the session's host chunks go first
    POST /v1/kv/prefetch {"token_ids", "session_id"?, "pin_ttl_s"?}
        load a token prefix's KV (host tier or Mooncake) into this engine's device cache and
        host tier ahead of the request: it runs a 1-token completion of the prefix through the
        engine's own serving path (`engine_url`), so loads use vLLM's normal connector path;
        answers prompt_tokens and cached_tokens. Idempotent (a repeat is a local cache hit).
The server (:class:`ControlServer`) is bounded and time-limited: one asyncio loop thread and
``control_max_inflight`` (default 8) operation threads whatever connects (429 past it), at most
``control_max_connections`` sockets (64; 503 past it), the head within ``control_header_timeout_s``
(5 s) and 16 KiB, authentication before any body byte is read, a body of at most
``control_max_body_bytes`` (4 MiB) within ``control_body_timeout_s`` (10 s); numbers validated
(a pin TTL in (0, 7 days]).

KV hint envelopes (engine_ext.kv_hints): the same operations, attached to a request instead of
called over HTTP. Once started, the server takes each request the pin-aware policy sees end
(:meth:`ControlServer.apply_kv_hints`), which maps its envelope's actions to the calls above and
runs them through :meth:`ControlServer.route`, the API's own validation and dispatch (a pin on
the turn that carries it covers that turn's chunks: they are recorded first). The counters are
in ``GET /v1/kv/stats`` -> ``kv_hints``.

Device pins (engine_ext.scheduler): the pinning scheduler attaches its `DevicePins` to the
service started on the same `control_port` (`service_on`: vLLM builds the connector's spec and
the scheduler separately, by name, and hands neither to the other, so this per-process table
keyed by port is their one link). Pin, unpin and evict then also queue a device command, which
the scheduler applies on the engine-core thread at its next step; the answer says `queued`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from engine_ext.device_pins import DevicePins, PinCommand
from engine_ext.kv_hints import (
    ACTIONS,
    PROTOCOL_VERSION,
    ControlCall,
    InvalidEnvelope,
    control_calls,
    request_envelope,
)
from engine_ext.pinned_policy import PinnedLRUCachePolicy
from engine_ext.pins import parse_pin_hint

if TYPE_CHECKING:
    from vllm.v1.kv_hints import KvHintsEnvelope

__all__ = ["ControlServer", "ControlService", "HintCounters", "register_service", "service_on"]

logger = logging.getLogger(__name__)

_SERVICES: dict[int, ControlService] = {}  # control_port -> the service of this process


def register_service(port: int, service: ControlService) -> None:
    _SERVICES[port] = service


def service_on(port: int) -> ControlService | None:
    return _SERVICES.get(port)


class ControlService:
    """The operations, independent of HTTP. `stats` is a callable returning a JSON-able dict."""

    def __init__(self, policy: Any, stats: Callable[[], dict[str, Any]], engine_url: str | None = None):
        self._policy = policy
        self._stats = stats
        self._engine_url = engine_url.rstrip("/") if engine_url else None
        self._model: str | None = None
        self._device: DevicePins | None = None
        self._clock: Callable[[], float] = time.monotonic

    def attach_device(self, pins: DevicePins, clock: Callable[[], float]) -> None:
        """Serve the scheduler's device pins too (called once, from the scheduler's __init__)."""
        self._device, self._clock = pins, clock

    def on_request_end(self, apply: Callable[[HintedRequest], None] | None) -> None:
        """Hand each request the pin-aware policy sees end to ``apply`` (None: stop); a policy
        of another kind has no such hook and nothing is handed."""
        if isinstance(self._policy, PinnedLRUCachePolicy):
            self._policy.on_request_end = apply

    def _queue(self, command: PinCommand) -> dict[str, Any] | None:
        if self._device is None:
            return None
        return {
            "queued": self._device.submit(command),
            "known_blocks": self._device.known_blocks(command.session_id),
        }

    def stats(self) -> dict[str, Any]:
        out = self._stats()
        out["device"] = None if self._device is None else self._device.snapshot(self._clock)
        return out

    def metrics(self) -> str:
        """Prometheus text for the device pins (empty when the engine has no pinning scheduler)."""
        if self._device is None:
            return ""
        snap = self._device.snapshot()
        lines = []
        for name, key, kind in (
            ("agentgw_kv_device_pinned_blocks", "pinned_blocks", "gauge"),
            ("agentgw_kv_device_pinned_sessions", "pinned_sessions", "gauge"),
            ("agentgw_kv_device_pinned_share", "pinned_share", "gauge"),
            ("agentgw_kv_device_pin_bound_blocks", "max_pinned_blocks", "gauge"),
        ):
            lines += [f"# TYPE {name} {kind}", f"{name} {snap[key]}"]
        name = "agentgw_kv_device_pin_releases_total"
        lines.append(f"# TYPE {name} counter")
        for reason in ("expired", "released", "yielded_to_bound", "released_for_admission", "reset"):
            lines.append(f'{name}{{reason="{reason}"}} {snap[reason]}')
        for key in ("pinned", "refused_over_bound"):
            lines += [
                f"# TYPE agentgw_kv_device_{key}_total counter",
                f"agentgw_kv_device_{key}_total {snap[key]}",
            ]
        return "\n".join(lines) + "\n"

    def session(self, session_id: str) -> dict[str, Any]:
        out = {"session_id": session_id, **self._policy.session_state(session_id)}
        if self._device is not None:
            out["device_pin"] = self._device.session(session_id, self._clock())
        return out

    def pin(self, session_id: str, ttl_s: float) -> dict[str, Any]:
        n = self._policy.pin_session(session_id, ttl_s)
        device = self._queue(PinCommand(session_id, until=self._clock() + ttl_s))
        return {"session_id": session_id, "pinned_chunks": n, "ttl_s": ttl_s, "device": device}

    def unpin(self, session_id: str) -> dict[str, Any]:
        unpinned = self._policy.unpin_session(session_id)
        return {"session_id": session_id, "unpinned": unpinned, "device": self._queue(PinCommand(session_id))}

    def evict(self, session_id: str) -> dict[str, Any]:
        demoted = self._policy.demote_session(session_id)
        device = self._queue(PinCommand(session_id, end=True))
        return {"session_id": session_id, "demoted_chunks": demoted, "device": device}

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._engine_url is not None
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self._engine_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            reply: dict[str, Any] = json.loads(response.read())  # the engine answers a JSON object
            return reply

    def prefetch(self, token_ids: list[int], hint: dict[str, Any] | None) -> dict[str, Any]:
        if self._engine_url is None:
            raise LookupError("prefetch needs engine_url in kv_connector_extra_config")
        if self._model is None:
            self._model = self._post("/v1/models")["data"][0]["id"]
        body: dict[str, Any] = {"model": self._model, "prompt": token_ids, "max_tokens": 1, "temperature": 0}
        if hint:
            body["kv_transfer_params"] = {"agentgw": hint}
        usage = self._post("/v1/completions", body).get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}


class HintedRequest(Protocol):
    """What :meth:`ControlServer.apply_kv_hints` reads of a request (vLLM's ``ReqContext``)."""

    @property
    def kv_hints(self) -> KvHintsEnvelope | None: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


class HintCounters:
    """What the KV hint envelopes did (``GET /v1/kv/stats`` -> ``kv_hints``); any thread.

    ``envelopes``: read; ``envelopes_refused``: not readable (nothing applied); ``applied``:
    actions answered 200; ``refused``: actions refused (by the mapping or the control API's
    validation); ``prefetches_running``: prefetch actions on the operation pool now. Refusals
    are logged: the first :data:`LOG_FIRST`, then one in :data:`LOG_EVERY` (a client repeating
    a bad envelope does not flood the engine's log)."""

    LOG_FIRST = 10
    LOG_EVERY = 1000

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(
            ("envelopes", "envelopes_refused", "applied", "refused", "prefetches_running"), 0
        )
        self.by_action: dict[str, int] = {}
        """action_type -> actions applied."""
        self.last_refusal: str | None = None

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def applied(self, action_type: str) -> None:
        with self.lock:
            self.counts["applied"] += 1
            self.by_action[action_type] = self.by_action.get(action_type, 0) + 1

    def refuse(self, key: str, reason: str) -> None:
        with self.lock:
            self.counts[key] += 1
            self.last_refusal = reason[:300]
            n = self.counts["envelopes_refused"] + self.counts["refused"]
        if n <= self.LOG_FIRST or n % self.LOG_EVERY == 0:
            logger.warning("engine_ext: KV hints refused (%d so far): %s", n, reason[:300])

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            counts = {**self.counts, "by_action": dict(self.by_action), "last_refusal": self.last_refusal}
        # what the engine reads: a gateway or an operator can tell the envelope is served here
        return {"protocol_version": PROTOCOL_VERSION, "actions": sorted(ACTIONS), **counts}


def _error(status: int, message: str, kind: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "code": status}}


MAX_TTL_S = 7 * 24 * 3600.0
"""The longest pin accepted (the gateway's ``kv_retention_ttl_s`` hint bound): a TTL of 1e308
would pin a session's KV for good."""
MAX_SESSION_ID = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_HEAD_BYTES = 16 * 1024
"""Request line plus headers."""
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class _Refuse(Exception):
    """Answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _ttl(value: Any, name: str) -> float:
    """A pin TTL: a finite number in (0, MAX_TTL_S]; raises _Refuse(400) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TTL_S:
        raise _Refuse(400, f"{name} (a number of seconds in (0, {MAX_TTL_S:g}]) is required")
    return float(value)


def _session_id(value: Any, name: str = "session_id") -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_ID or not value.isprintable():
        raise _Refuse(400, f"{name} (a string of 1-{MAX_SESSION_ID} printable characters) is required")
    return value


class ControlServer:
    """The control API's HTTP server: one asyncio loop on its own thread, the operations on a
    pool of ``max_inflight`` threads (the total is bounded: 1 + ``max_inflight``, however many
    sockets connect). Every limit is answered in the API's error shape, then the connection
    closes:

    - ``max_connections`` open sockets; past it a 503 at once;
    - the request line and headers within ``header_timeout_s`` and :data:`MAX_HEAD_BYTES` (408,
      431); a malformed head, a bad, negative or repeated ``Content-Length``, or a chunked body:
      400 / 501;
    - authentication before anything else is read (401; an empty token is refused at start);
    - the body, at most ``max_body_bytes`` (413) within ``body_timeout_s`` (408); then
      ``max_inflight`` operations at once (429: a slow body never holds an operation slot);
    - an idle keep-alive connection is closed after ``keep_alive_s`` (75 s: longer than the
      gateway's pooled connections idle, 60 s, so the client closes first and never sends on a
      connection the server is closing).
    """

    def __init__(
        self,
        service: ControlService,
        host: str,
        port: int,
        token: str,
        max_inflight: int = 8,
        *,
        max_connections: int = 64,
        header_timeout_s: float = 5.0,
        body_timeout_s: float = 10.0,
        keep_alive_s: float = 75.0,
        max_body_bytes: int = 4 * 1024 * 1024,
    ):
        if not token or token != token.strip():
            # an empty token matched a bare "Authorization: Bearer": the API was open
            raise ValueError("control_token must be set (non-empty, no surrounding spaces)")
        if max_inflight < 1 or max_connections < 1:
            raise ValueError("control_max_inflight and control_max_connections must be >= 1")
        self.service = service
        self._token = token.encode()
        self.max_inflight = max_inflight
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.keep_alive_s = keep_alive_s
        self.max_body_bytes = max_body_bytes
        self.connections = 0
        """Sockets open now (read on the loop thread)."""
        self.peak_connections = 0
        """The most sockets served at once (never past ``max_connections``)."""
        self.inflight = 0
        self.refused: dict[int, int] = {}
        """Answers that closed the connection, by status (a counter for tests and operators)."""
        self._sock = socket.create_server((host, port), backlog=128)
        self.port = self._sock.getsockname()[1]
        self._configured_port = port
        self._pool = ThreadPoolExecutor(max_inflight, thread_name_prefix="agentgw_control_op")
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Future[None] | None = None
        self._started = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._run, name="agentgw_control", daemon=True)
        self.hints = HintCounters()
        self.max_hint_prefetches = max(1, max_inflight // 2)
        """Prefetch actions of KV hint envelopes on the operation pool at once (the rest of the
        pool stays for the API's own calls); past it a prefetch action is refused."""

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Serve: register the service for the pinning scheduler (:func:`service_on`), take the
        pin-aware policy's ended requests (:meth:`apply_kv_hints`), start the loop thread."""
        register_service(self._configured_port, self.service)
        self.service.on_request_end(self.apply_kv_hints)
        self._thread.start()
        self._started.wait(10)

    def stop(self) -> None:
        if _SERVICES.get(self._configured_port) is self.service:
            del _SERVICES[self._configured_port]
        self.service.on_request_end(None)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._request_stop)
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    def _request_stop(self) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = self._loop.create_future()
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=MAX_HEAD_BYTES)
        self._started.set()
        try:
            await self._stop
        finally:
            server.close()
            for w in list(self._writers):
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- one connection ----------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.connections += 1
        try:
            if self.connections > self.max_connections:
                raise _Refuse(503, "too many open control connections", "overloaded")
            self.peak_connections = max(self.peak_connections, self.connections)
            first = True
            while await self._request(reader, writer, first):
                first = False
        except _Refuse as r:
            self.refused[r.status] = self.refused.get(r.status, 0) + 1
            with contextlib.suppress(Exception):
                await self._write(writer, *_error(r.status, r.message, r.kind), keep=False)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            writer.close()

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool) -> bool:
        """Serve one request; whether the connection stays open. A kept-alive connection may
        idle ``keep_alive_s`` before its next request (then it is closed without an answer)."""
        wait = self.header_timeout_s if first else self.keep_alive_s + self.header_timeout_s
        try:
            async with asyncio.timeout(wait):
                raw = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            if not first and not reader._buffer:  # type: ignore[attr-defined]  # idle: just close
                return False
            raise _Refuse(408, f"request headers not received within {self.header_timeout_s:g} s") from None
        except asyncio.LimitOverrunError:
            raise _Refuse(431, f"request headers exceed {MAX_HEAD_BYTES} bytes") from None
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise _Refuse(400, "the connection closed inside the request headers") from None
            return False
        method, path, version, headers = _parse_head(raw)
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.encode(), self._token):
            raise _Refuse(401, "missing or invalid bearer token", "unauthorized")
        if method not in ("GET", "POST"):
            raise _Refuse(405, f"method {method} is not allowed", "invalid_request_error")
        length = _content_length(headers)
        if length > self.max_body_bytes:
            raise _Refuse(413, f"body exceeds {self.max_body_bytes} bytes")
        body = b""
        if length:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await reader.readexactly(length)
            except TimeoutError:
                raise _Refuse(408, f"request body not received within {self.body_timeout_s:g} s") from None
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        # the operation slots are taken once the request is whole: a slow body holds a
        # connection (bounded, timed), never a slot the gateway's own calls need
        if self.inflight >= self.max_inflight:
            self.refused[429] = self.refused.get(429, 0) + 1
            await self._write(
                writer, *_error(429, "too many control requests in flight", "rate_limited"), keep
            )
            return keep
        self.inflight += 1
        try:
            status, answer = await self._loop.run_in_executor(
                self._pool, self.dispatch, method, path, auth, body
            )
        finally:
            self.inflight -= 1
        await self._write(writer, status, answer, keep)
        return keep

    async def _write(
        self, writer: asyncio.StreamWriter, status: int, body: dict[str, Any] | str, keep: bool
    ) -> None:
        if isinstance(body, str):
            data, kind = body.encode(), "text/plain; version=0.0.4"
        else:
            data, kind = json.dumps(body).encode(), "application/json"
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {kind}\r\nContent-Length: {len(data)}\r\n"
            + ("" if keep else "Connection: close\r\n")
            + "\r\n"
        )
        writer.write(head.encode() + data)
        async with asyncio.timeout(self.body_timeout_s):  # a client that does not read is dropped
            await writer.drain()

    # -- the operations ----------------------------------------------------------------------
    def dispatch(
        self, method: str, path: str, auth: str, raw: bytes = b""
    ) -> tuple[int, dict[str, Any] | str]:
        """One authenticated request (``auth`` is checked again: a direct caller is not the
        server), on a pool thread."""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token or not hmac.compare_digest(token.encode(), self._token):
            return _error(401, "missing or invalid bearer token", "unauthorized")
        try:
            return self._dispatch(method, path, raw)
        except _Refuse as r:
            return _error(r.status, r.message, r.kind)

    # -- KV hint envelopes ----------------------------------------------------------------
    def apply_kv_hints(self, request: HintedRequest) -> None:
        """Apply the KV hint envelope of a request that ended (engine_ext.kv_hints: the native
        one, else ``kv_transfer_params.kv_hints``), on the engine-core thread: the pin-aware
        policy calls it once the request's chunks are recorded under its session. Each action
        goes through :meth:`route` as the control API call it maps to (same validation, same
        operations); a prefetch runs on the operation pool, since it completes a prompt through
        this engine. Never raises: a bad envelope or action is counted and logged, the engine
        goes on."""
        try:
            params = request.kv_transfer_params
            try:
                envelope = request_envelope(request.kv_hints, params)
            except InvalidEnvelope as exc:
                self.hints.refuse("envelopes_refused", str(exc))
                return
            if envelope is None:
                return
            self.hints.add("envelopes")
            hint = parse_pin_hint(params)
            calls, refused = control_calls(envelope, None if hint is None else hint.session_id)
            for r in refused:
                self.hints.refuse(
                    "refused",
                    f"message {envelope.message_id[:64]!r}, {r.action_type} {r.action_id[:64]!r}: {r.reason}",
                )
            for call in calls:
                if call.path == "/v1/kv/prefetch":
                    self._start_prefetch(call)
                else:
                    self._apply(call)
        except Exception:  # the engine-core thread: an envelope must never stop the engine
            logger.exception("engine_ext: applying a KV hint envelope failed")
            self.hints.refuse("envelopes_refused", "internal error (see the engine's log)")

    def _apply(self, call: ControlCall) -> None:
        try:
            status, answer = self.route("POST", call.path, call.body)
        except _Refuse as r:
            status, answer = r.status, r.message
        if status == 200:
            self.hints.applied(call.action_type)
        else:
            message = answer["error"]["message"] if isinstance(answer, dict) else answer
            self.hints.refuse("refused", f"{call.action_type} {call.action_id[:64]!r}: {message}")

    def _start_prefetch(self, call: ControlCall) -> None:
        with self.hints.lock:
            busy = self.hints.counts["prefetches_running"] >= self.max_hint_prefetches
            if not busy:
                self.hints.counts["prefetches_running"] += 1
        if busy:
            self.hints.refuse(
                "refused", f"{call.action_type} {call.action_id[:64]!r}: {self.max_hint_prefetches} running"
            )
            return
        try:
            self._pool.submit(self._prefetch, call)
        except RuntimeError:  # the pool is shut down: the engine is stopping
            self.hints.add("prefetches_running", -1)

    def _prefetch(self, call: ControlCall) -> None:
        try:
            self._apply(call)
        except Exception:  # a pool thread: log it, never lose the running count
            logger.exception("engine_ext: a KV hint prefetch failed")
            self.hints.refuse("refused", f"{call.action_type} {call.action_id[:64]!r}: internal error")
        finally:
            self.hints.add("prefetches_running", -1)

    def _dispatch(self, method: str, path: str, raw: bytes) -> tuple[int, dict[str, Any] | str]:
        body: dict[str, Any] = {}
        if method == "POST":
            try:
                body = json.loads(raw or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                return _error(400, f"invalid JSON: {exc}", "invalid_request_error")
            if not isinstance(body, dict):
                return _error(400, "body must be a JSON object", "invalid_request_error")
        return self.route(method, path, body)

    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | str]:
        """One operation from its route and JSON body: validation, then the service (raises
        _Refuse for a bad field). The HTTP requests and the KV hint envelopes both come here."""
        svc = self.service
        if method == "GET" and path == "/v1/kv/stats":
            return 200, {**svc.stats(), "kv_hints": self.hints.snapshot()}
        if method == "GET" and path == "/metrics":
            return 200, svc.metrics()
        if method == "GET" and path.startswith("/v1/kv/sessions/"):
            return 200, svc.session(_session_id(urllib.parse.unquote(path.removeprefix("/v1/kv/sessions/"))))
        if method == "POST" and path == "/v1/kv/prefetch":
            ids = body.get("token_ids")
            if (
                not isinstance(ids, list)
                or not ids
                or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids)
            ):
                return _error(
                    400, "token_ids (non-empty list of token ids) is required", "invalid_request_error"
                )
            hint: dict[str, Any] | None = None
            if "pin_ttl_s" in body and "session_id" not in body:
                return _error(400, "pin_ttl_s needs session_id", "invalid_request_error")
            if "session_id" in body:
                hint = {"session_id": _session_id(body["session_id"])}
                if "pin_ttl_s" in body:
                    hint["pin_ttl_s"] = _ttl(body["pin_ttl_s"], "pin_ttl_s")
            try:
                return 200, svc.prefetch(ids, hint)
            except LookupError as exc:
                return _error(501, str(exc), "not_configured")
            except (urllib.error.URLError, OSError, ValueError) as exc:
                return _error(502, f"prefetch through the engine failed: {exc}", "engine_error")
        if method == "POST" and path in ("/v1/kv/pin", "/v1/kv/unpin", "/v1/kv/evict"):
            session_id = _session_id(body.get("session_id"))
            if path == "/v1/kv/pin":
                return 200, svc.pin(session_id, _ttl(body.get("ttl_s"), "ttl_s"))
            if path == "/v1/kv/evict":
                return 200, svc.evict(session_id)
            return 200, svc.unpin(session_id)
        return _error(404, f"no route {method} {path}", "not_found")


def _parse_head(raw: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Method, path, version and the headers (lower-case names) of a request head; _Refuse(400)
    for anything malformed (a repeated header keeps the first only for lookups; Content-Length
    is checked for repeats by :func:`_content_length`)."""
    try:
        text = raw[:-4].decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise _Refuse(400, "malformed request head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1") or not parts[0].isalpha():
        raise _Refuse(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    lengths = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or not name.isprintable() or line[:1] in " \t":
            raise _Refuse(400, "malformed header line")
        value = value.strip(" \t")
        if any(c in value for c in "\x00\r\n\x7f"):
            raise _Refuse(400, f"invalid character in header {name!r}")
        key = name.lower()
        if key == "content-length":
            lengths.append(value)
        headers.setdefault(key, value)
    if lengths:
        headers["content-length"] = ",".join(lengths)
    return method, target.split("?", 1)[0], version, headers


def _content_length(headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise _Refuse(501, "chunked request bodies are not supported: send Content-Length")
    value = headers.get("content-length")
    if value is None:
        return 0
    if not value.isdigit() or not value.isascii() or len(value) > 18:
        raise _Refuse(400, f"invalid Content-Length {value[:40]!r}: one non-negative integer")
    return int(value)
