"""A lean HTTP/1.1 client transport for the engines: asyncio protocols, httptools' parser, a
keep-alive pool per engine, behind httpx's transport interface (:class:`Http1Transport`).

Why not aiohttp's client: per request it builds a request object, resolves timeouts and trace
hooks, prepares cookies and default headers, goes through its connector and a stream reader,
and the gateway then wraps all that into httpx's types again; on the 220-byte request of
``benchmarks.overhead`` that was ~1/6 of the event loop's time. Here a request is one
``transport.write`` of its head and body (the bytes it arrived in), the response's head and
body come from httptools' C parser straight to the caller, and a connection whose response was
read to its end goes back to its engine's pool.

Failures come out as httpx's, as the retry logic expects (gateway/service/proxy.py): a refused
connection :class:`ConnectionRefused`; another connect failure
``httpx.ConnectError``; a connect past its limit ``httpx.ConnectTimeout``; no free connection
in time ``httpx.PoolTimeout``; a connection closed or reset before or during the response
``httpx.ReadError``; a response that falls silent past the read limit ``httpx.ReadTimeout``;
a response that does not parse ``httpx.RemoteProtocolError``.

Bounded: at most ``limit_per_host`` connections per engine (a request beyond waits for one, up
to the pool limit), idle ones closed after ``keepalive_s``; a response body is buffered up to
``HIGH_WATER`` bytes before the connection stops reading (the engine then waits for the relay).
HEAD requests are not supported (nothing sends them to engines). ``https://`` engines are reached
with the system's default TLS context.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httptools
import httpx

__all__ = ["HIGH_WATER", "ConnectionRefused", "Http1Transport", "RawResponse", "request_head"]

HIGH_WATER = 1 << 20
"""Body bytes buffered per connection before it stops reading from the socket."""


def request_head(
    method: str, target: bytes, host_header: bytes, headers: list[tuple[bytes, bytes]], length: int
) -> bytes:
    """A request's line and headers for :meth:`Http1Transport.send_raw`: ``target`` the path
    (and query), ``host_header`` the engine's ``host[:port]``, ``headers`` without ``Host`` or
    ``Content-Length`` (this adds them), the body sent whole with its length."""
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nHost: ", host_header, b"\r\n"]
    for k, v in headers:
        parts += (k, b": ", v, b"\r\n")
    parts.append(b"Content-Length: %d\r\n\r\n" % length)
    return b"".join(parts)


class ConnectionRefused(httpx.ConnectError):
    """Nothing listens at the engine's address (the connection was refused)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; one request at a time."""

    __slots__ = (
        "_waiter",
        "body",
        "buffered",
        "closed",
        "complete",
        "error",
        "headers",
        "headers_done",
        "host",
        "idle_since",
        "keep_alive",
        "key",
        "loop",
        "parser",
        "paused",
        "status",
        "transport",
    )

    def __init__(self, key: _Key, host: _Host, loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.host = host
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.headers_done = False
        self.complete = False
        self.keep_alive = True
        self.closed = False
        self.error: str | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0

    # -- the protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # bytes while no request is out: the engine broke the protocol
            self.error = "data received with no request in flight"
            self._close()
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"invalid HTTP response: {exc}"
            self._close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None and self.error is None and self.headers_done and self._ends_with_connection():
            self.complete = True
            self.keep_alive = False
        if not self.complete and self.error is None and self.parser is not None:
            self.error = "connection closed before the response ended" + (f" ({exc!r})" if exc else "")
        self._wake()

    # -- httptools' callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def _ends_with_connection(self) -> bool:
        """The response has neither a length nor chunks: its body ends with the connection
        (read only when the connection closes, not on every response)."""
        names = {k.lower() for k, _ in self.headers}
        return (
            b"content-length" not in names
            and b"transfer-encoding" not in names
            and self.status >= 200
            and self.status not in (204, 304)
        )

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- the caller's side ----------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self, timeout: float | None, request: httpx.Request | None) -> None:
        """Until a callback or the connection's end wakes this (ReadTimeout past ``timeout``).
        One future and one timer handle a wait (``asyncio.timeout`` costs several times that,
        and a streamed answer waits once a chunk)."""
        w = self._waiter = self.loop.create_future()
        timer = None if timeout is None else self.loop.call_later(timeout, _expire, w)
        try:
            await w
        except TimeoutError:
            raise httpx.ReadTimeout("read timed out", request=request) from None
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def start(self, head: bytes, body: bytes) -> None:
        """Send a request; the previous one on this connection was read to its end."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = []
        self.body.clear()
        self.buffered = 0
        self.headers_done = self.complete = False
        self.error = None
        assert self.transport is not None
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)

    async def read_head(self, timeout: float | None, request: httpx.Request | None) -> None:
        while not self.headers_done:
            if self.error is not None or self.closed:
                raise httpx.ReadError(self.error or "connection closed", request=request)
            await self._wait(timeout, request)

    async def chunks(self, timeout: float | None, request: httpx.Request | None) -> AsyncIterator[bytes]:
        body = self.body
        while True:
            if body:
                # what arrived since the last read goes on as one piece (a loaded gateway then
                # relays fewer, larger writes; stream readers take any split)
                if len(body) == 1:
                    chunk = body.popleft()
                else:
                    chunk = b"".join(body)
                    body.clear()
                self.buffered -= len(chunk)
                if self.paused and self.buffered <= HIGH_WATER // 2 and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                yield chunk
                continue
            if self.complete:
                return
            if self.error is not None or self.closed:
                raise httpx.ReadError(self.error or "connection closed", request=request)
            await self._wait(timeout, request)

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    def close(self) -> None:
        """Drop the connection (mid-response: the engine sees the client leave and aborts)."""
        if self.transport is not None:
            self.transport.abort() if not self.complete else self.transport.close()
        self.closed = True


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_exception(TimeoutError())


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; closing it gives the connection back or drops it."""

    __slots__ = ("_conn", "_done", "_release", "_request", "_timeout")

    def __init__(
        self,
        conn: _Conn,
        request: httpx.Request | None,
        timeout: float | None,
        release: Callable[[_Conn, bool], None],
    ) -> None:
        self._conn = conn
        self._request = request
        self._timeout = timeout
        self._release = release
        self._done = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._conn.chunks(self._timeout, self._request)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._release(self._conn, self._conn.reusable())


_Key = tuple[str, int, bool]
"""(host, port, TLS)"""


class _RawHeaders:
    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw


class RawResponse:
    """An engine's response on the relay's path (:meth:`Http1Transport.send_raw`): the parts of
    ``httpx.Response`` the relay reads (``status_code``, ``headers.raw``, ``stream``, ``aread``,
    ``aclose``), without building httpx's request, URL and header objects for each request."""

    __slots__ = ("headers", "status_code", "stream")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], stream: _Body) -> None:
        self.status_code = status
        self.headers = _RawHeaders(headers)
        self.stream = stream

    async def aread(self) -> bytes:
        try:
            return b"".join([chunk async for chunk in self.stream])
        finally:
            await self.stream.aclose()

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Host:
    """One engine's connections: idle ones (most recent last) and a bound on all of them."""

    __slots__ = ("idle", "slots")

    def __init__(self, limit: int) -> None:
        self.idle: list[_Conn] = []
        self.slots = asyncio.Semaphore(limit)


class Http1Transport(httpx.AsyncBaseTransport):
    """httpx's transport interface over pooled HTTP/1.1 connections (module docstring).
    Per-request timeouts come from httpx's ``timeout`` extension: ``connect`` (the socket),
    ``read`` (for the response head, then between body chunks), ``pool`` (a free connection)."""

    def __init__(self, limit_per_host: int = 1024, keepalive_s: float = 60.0) -> None:
        self.limit_per_host = limit_per_host
        self.keepalive_s = keepalive_s
        self._hosts: dict[_Key, _Host] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def _tls(self) -> ssl.SSLContext:
        """The system's default TLS context (verifying), made on first use."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _host(self, key: _Key) -> _Host:
        h = self._hosts.get(key)
        if h is None:
            if len(self._hosts) >= 4096:  # bounded: drop the pools of hosts with nothing idle
                for k in [k for k, v in self._hosts.items() if not v.idle]:
                    del self._hosts[k]
            h = self._hosts[key] = _Host(self.limit_per_host)
        return h

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.ConnectError("transport closed", request=request)
        url = request.url
        if url.scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"only http:// and https:// engines, not {url.scheme}://")
        tls = url.scheme == "https"
        if request.method == "HEAD":
            raise httpx.UnsupportedProtocol("HEAD is not supported by the engine transport")
        t = request.extensions.get("timeout", {})
        body = request.content
        key = (url.host, url.port or (443 if tls else 80), tls)
        conn = await self._exchange(key, self._head(request, len(body)), body, t, request)
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(conn, request, t.get("read"), self._release),
            request=request,
        )

    async def send_raw(
        self,
        host: str,
        port: int,
        tls: bool,
        head: bytes,
        body: bytes,
        timeout: Mapping[str, float | None],
    ) -> RawResponse:
        """The relay's path: ``head`` is the request line and headers as they go out, ending in
        the blank line (:func:`request_head`); the response as a :class:`RawResponse`. Failures
        are httpx's, as :meth:`handle_async_request`'s (without a request object)."""
        if self._closed:
            raise httpx.ConnectError("transport closed")
        conn = await self._exchange((host, port, tls), head, body, timeout, None)
        return RawResponse(conn.status, conn.headers, _Body(conn, None, timeout.get("read"), self._release))

    async def _exchange(
        self,
        key: _Key,
        head: bytes,
        body: bytes,
        t: Mapping[str, float | None],
        request: httpx.Request | None,
    ) -> _Conn:
        """Send one request on a pooled connection (or a new one) and read its response head."""
        host = self._host(key)
        if host.slots.locked():  # every connection busy: wait for one, up to the pool limit
            try:
                async with asyncio.timeout(t.get("pool")):
                    await host.slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no free connection to the engine in time", request=request) from None
        else:
            await host.slots.acquire()  # free: returns at once
        conn: _Conn | None = None
        try:
            conn = self._idle(host)
            if conn is not None:
                conn.start(head, body)
                try:
                    await conn.read_head(t.get("read"), request)
                except httpx.ReadError:
                    # an idle connection the engine closed as this request went out (uvicorn
                    # closes idle ones after 5 s): nothing of a response came, so the engine
                    # did not serve it; once more on a new connection
                    if conn.status or conn.body or not conn.closed:
                        raise
                    conn.close()
                    conn = None
            if conn is None:
                conn = await self._connect(key, host, t.get("connect"), request)
                conn.start(head, body)
                await conn.read_head(t.get("read"), request)
        except BaseException:
            if conn is not None:
                conn.close()
            host.slots.release()
            raise
        return conn

    @staticmethod
    def _head(request: httpx.Request, length: int) -> bytes:
        """An httpx request's head, as :func:`request_head` writes the relay's (the body sent
        whole, with its length)."""
        drop = (b"host", b"content-length", b"transfer-encoding")
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in drop]
        url = request.url
        return request_head(request.method, url.raw_path, url.netloc, headers, length)

    def _idle(self, host: _Host) -> _Conn | None:
        now = time.monotonic()
        while host.idle:
            conn = host.idle.pop()
            if conn.closed or now - conn.idle_since > self.keepalive_s:
                conn.close()
                continue
            return conn
        return None

    async def _connect(
        self, key: _Key, host: _Host, timeout: float | None, request: httpx.Request | None
    ) -> _Conn:
        loop = asyncio.get_running_loop()
        conn = _Conn(key, host, loop)
        try:
            async with asyncio.timeout(timeout):
                if key[2]:
                    await loop.create_connection(lambda: conn, key[0], key[1], ssl=self._tls())
                else:
                    await loop.create_connection(lambda: conn, key[0], key[1])
        except TimeoutError:
            raise httpx.ConnectTimeout("connect timed out", request=request) from None
        except ConnectionRefusedError as exc:
            raise ConnectionRefused(str(exc), request=request) from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        return conn

    def _release(self, conn: _Conn, reusable: bool) -> None:
        host = conn.host
        if reusable and not self._closed and self._hosts.get(conn.key) is host:
            conn.parser = None
            conn.idle_since = time.monotonic()
            host.idle.append(conn)
        else:
            conn.close()
        host.slots.release()

    async def aclose(self) -> None:
        self._closed = True
        for host in self._hosts.values():
            for conn in host.idle:
                conn.close()
            host.idle.clear()
