"""The HTTP server (uvicorn + httptools) and the limits it enforces on clients before a request
reaches the app; `agentgw serve` and the test gateways both build it with :func:`uvicorn_config`.

Limits (``server.*`` in config), each answered in the OpenAI error shape and the connection closed:

- ``max_connections``: open client connections; the one past it gets a 503 with ``Retry-After``.
  Capped at half the process's descriptor limit (``RLIMIT_NOFILE``; the other half is for
  upstream connections, one per stream), so idle sockets can never starve ``/health``; past it,
  ``probe_reserve`` more connections may ask ``/health`` or ``/ready`` only (headers within 2 s,
  closed after the answer), so liveness probes pass during a socket flood.
- ``max_header_count`` / ``max_header_bytes``: request line plus headers -> 431 (414 when the
  request line alone is too long). Bytes are counted as they arrive, so an endless header is cut
  at the limit rather than buffered.
- ``header_timeout_s``: from the connection (or the first byte of a keep-alive request) to the
  end of its headers -> 408 (slowloris).
- ``body_timeout_s``: from the end of the headers to the end of the body -> 408, and the app sees
  the client as disconnected.
- ``keep_alive_s``: an idle keep-alive connection is closed (uvicorn's own timer).

:class:`GatewayServer` is uvicorn's server with the drain of gateway/api/drain.py run on SIGTERM
before uvicorn's own shutdown (close the listener, close idle connections, the lifespan's end).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.api.drain import Drain
from gateway.api.errors import error_body
from gateway.config import GatewayConfig, ServerConfig

_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    503: "Service Unavailable",
}


PROBE_PATHS = frozenset({b"/health", b"/ready"})
"""What a connection of the probes' reserve may ask (``server.probe_reserve``)."""
PROBE_HEADER_TIMEOUT_S = 2.0

ABORT_EXTENSION = "agentgw.abort"
"""The ASGI scope extension (a callable) that cuts the client connection mid-response."""


class _Refused(Exception):
    """Stops the parser after a limit was hit (the answer is already written)."""


def error_response(status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-shaped body that closes the connection."""
    body = error_body(status, message, None, code)
    head = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


log = logging.getLogger("agentgw.server")


def connection_cap(configured: int) -> int:
    """``configured``, or half the soft descriptor limit when that is lower (at least 64)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return min(configured, max(64, soft // 2))


def raise_fd_limit(target: int = 65536) -> int:
    """Raise the soft descriptor limit towards the hard one (at most ``target``); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


def guarded_protocol(limits: ServerConfig) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the limits above."""
    max_connections = connection_cap(limits.max_connections)
    if max_connections < limits.max_connections:
        log.warning(
            "server.max_connections %d capped at %d (half the descriptor limit)",
            limits.max_connections,
            max_connections,
        )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refused = False
            self._probe_only = False
            """A connection of the probes' reserve (past ``max_connections``)."""
            self._in_headers = True
            self._header_bytes = 0
            """Request line and header bytes parsed so far (the limit, exactly)."""
            self._bytes_in_head = 0
            """Bytes read while inside the headers (an endless header is cut at the limit)."""
            self._header_count = 0
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None

        # -- connection --------------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            n = len(self.connections)
            if n > max_connections + limits.probe_reserve:
                self._refuse(503, "the gateway has too many open connections", "too_many_connections", 1)
                return
            if n > max_connections:  # the probes' reserve: /health and /ready only, quickly
                self._probe_only = True
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_headers:
                self._bytes_in_head += len(data)
            # uvicorn's data_received, with every parser error answered in the OpenAI shape
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserInvalidMethodError:
                self._refuse(501, "the request method is not implemented", "method_not_implemented")
                return
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            except httptools.HttpParserError as exc:
                if not self._refused:  # else a limit already answered; the parser error is ours
                    why = str(exc.__context__ or exc) or "malformed"
                    self._refuse(400, f"invalid HTTP request: {why}", "invalid_http_request")
                return
            # still inside the headers after all that: the headers alone are that long
            if not self._refused and self._in_headers and self._bytes_in_head > limits.max_header_bytes:
                self._refuse(
                    431, f"request headers exceed {limits.max_header_bytes} bytes", "headers_too_large"
                )

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # a limit already answered; the parser error is ours
                self._refuse(400, f"invalid HTTP request: {msg}", "invalid_http_request")

        # -- parser callbacks --------------------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_count = 0
            self._header_bytes = 0
            if self._header_timer is None:
                self._arm_header_timer()

        def on_url(self, url: bytes) -> None:
            if len(self.url) + len(url) > limits.max_header_bytes:
                self._refuse(414, f"request line exceeds {limits.max_header_bytes} bytes", "url_too_long")
                raise _Refused
            if not self.url and self.parser.get_method() == b"CONNECT":
                self._refuse(501, "CONNECT is not implemented: this is not a proxy", "method_not_implemented")
                raise _Refused
            self._header_bytes += len(url)
            if self._probe_only and (self.url + url).split(b"?", 1)[0] not in PROBE_PATHS:
                self._refuse(503, "the gateway has too many open connections", "too_many_connections", 1)
                raise _Refused
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > limits.max_header_count:
                self._refuse(431, f"more than {limits.max_header_count} request headers", "too_many_headers")
                raise _Refused
            # counted as parsed, not only per read: a head that arrives whole in one read
            # (the whole request at once) is held to the same limit
            self._header_bytes += len(name) + len(value) + 4
            if self._header_bytes > limits.max_header_bytes:
                self._refuse(
                    431, f"request headers exceed {limits.max_header_bytes} bytes", "headers_too_large"
                )
                raise _Refused
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._bytes_in_head = 0
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            # Any: ASGI types extension values as dicts; this one is the abort callable
            extensions: dict[str, Any] = dict(self.scope.get("extensions") or {})
            extensions[ABORT_EXTENSION] = self._abort_response
            self.scope["extensions"] = extensions
            super().on_headers_complete()
            if self._probe_only and self.cycle is not None:
                self.cycle.keep_alive = False  # answered, then closed: the reserve stays free
            self._body_timer = self.loop.call_later(limits.body_timeout_s, self._body_timeout)

        def on_message_complete(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            self._in_headers = True  # what follows on this connection is the next request's head
            super().on_message_complete()

        # -- limits ------------------------------------------------------------------------
        def _arm_header_timer(self) -> None:
            timeout = (
                min(limits.header_timeout_s, PROBE_HEADER_TIMEOUT_S)
                if self._probe_only
                else limits.header_timeout_s
            )
            self._header_timer = self.loop.call_later(timeout, self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._in_headers and not self.transport.is_closing():
                self._refuse(
                    408,
                    f"request headers not received within {limits.header_timeout_s:g} s",
                    "header_timeout",
                )

        def _body_timeout(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if cycle is None or self.transport.is_closing():
                return
            if not cycle.response_started:
                self._refuse(
                    408, f"request body not received within {limits.body_timeout_s:g} s", "body_timeout"
                )
            else:
                self._refused = True
                self.transport.close()

        def _abort_response(self) -> None:
            """Cut the connection mid-response: what was sent is flushed, the terminating chunk
            never is, so the client sees a failed response, not a short complete one."""
            cycle = self.cycle
            if cycle is not None:
                cycle.disconnected = True  # later sends are dropped, and nothing is logged
            self._refused = True
            self._cancel_timers()
            if not self.transport.is_closing():
                self.transport.close()

        def _refuse(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
            self._refused = True
            self._cancel_timers()
            if not self.transport.is_closing():
                self.transport.write(error_response(status, message, code, retry_after))
                self.transport.close()

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._body_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._body_timer = None

    return GuardedHttpToolsProtocol


SHUTDOWN_GRACE_S = 5
"""uvicorn's wait for connections after the drain (they are done or cut by then)."""


class GatewayServer(uvicorn.Server):
    """uvicorn's server; on SIGTERM (or SIGINT) the drain runs first, with the listener still
    open so new requests get their 503 and ``/ready`` says draining; a second signal cuts at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.drain.begin()  # from the signal itself: requests arriving from now on get the 503
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        await self.drain.run()
        await super().shutdown(sockets)


def uvicorn_config(app: Any, config: GatewayConfig, **overrides: Any) -> uvicorn.Config:
    """The uvicorn settings `agentgw serve` runs with (``overrides`` for tests: log level...)."""
    s = config.server
    kwargs: dict[str, Any] = {
        "host": config.listen.host,
        "port": config.listen.port,
        "log_level": "warning",
        "access_log": False,
        "loop": "uvloop",
        "http": guarded_protocol(s),
        "lifespan": "on",
        "proxy_headers": False,  # a measurable per-request cost; the gateway is not behind a proxy
        "server_header": False,
        "timeout_keep_alive": s.keep_alive_s,
        "backlog": s.backlog,
        "timeout_graceful_shutdown": SHUTDOWN_GRACE_S,
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)
