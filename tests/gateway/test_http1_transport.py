"""The engines' HTTP/1.1 transport (gateway/service/http1.py) against raw asyncio servers on
loopback that answer as an engine would, or break as one can: keep-alive reuse, chunked
streams read as they arrive, an idle connection the engine closed, resets, silence, a refused
port, the per-engine bound."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from gateway.service.http1 import ConnectionRefused, Http1Transport, request_head

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free loopback port; yields its base URL and a list that counts its
    connections (one entry per accepted connection)."""
    conns: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", conns
    finally:
        server.close()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by its Content-Length)."""
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await r.readexactly(length)


def req(url: str, body: bytes = b"{}", **timeout: float) -> httpx.Request:
    t = {"connect": 2.0, "read": 2.0, "pool": 2.0, **timeout}
    return httpx.Request(
        "POST",
        url + "/v1/chat/completions",
        content=body,
        headers=[(b"x-t", b"1")],
        extensions={"timeout": t},
    )


async def body_of(resp: httpx.Response) -> bytes:
    out = b"".join([c async for c in resp.stream])  # type: ignore[union-attr]
    await resp.aclose()
    return out


async def test_keep_alive_reuses_one_connection_and_sends_the_body_as_given() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            seen.append((head, body))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nx-engine: e\r\n\r\nhello")
            await w.drain()

    async with serve(engine) as (url, conns):
        t = Http1Transport()
        for i in range(3):
            resp = await t.handle_async_request(req(url, b'{"n": %d}' % i))
            assert resp.status_code == 200 and resp.headers["x-engine"] == "e"
            assert await body_of(resp) == b"hello"
        await t.aclose()
    assert len(conns) == 1
    assert [b for _, b in seen] == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    head = seen[0][0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"x-t: 1\r\n" in head and b"Content-Length: 8\r\n" in head


async def test_a_chunked_stream_is_read_as_it_arrives() -> None:
    go = asyncio.Event()

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            w.write(b"6\r\ndata 1\r\n")
            await w.drain()
            await go.wait()
            w.write(b"6\r\ndata 2\r\n0\r\n\r\n")
            await w.drain()

    async with serve(engine) as (url, conns):
        t = Http1Transport()
        resp = await t.handle_async_request(req(url))
        it = aiter(resp.stream)  # type: ignore[arg-type]
        assert await anext(it) == b"data 1"  # before the rest was even written
        go.set()
        assert b"".join([c async for c in it]) == b"data 2"
        await resp.aclose()
        again = await t.handle_async_request(req(url))  # read to its end: back in the pool
        again_it = aiter(again.stream)  # type: ignore[arg-type]
        assert len(conns) == 1
        await again.aclose()  # mid-response: dropped
        del again_it
        await t.aclose()


async def test_a_refused_port_is_connection_refused() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t = Http1Transport()
    with pytest.raises(ConnectionRefused):
        await t.handle_async_request(req(f"http://127.0.0.1:{port}"))
    await t.aclose()


async def test_an_idle_connection_the_engine_closed_is_replaced_without_an_error() -> None:
    """uvicorn closes a keep-alive connection idle for 5 s: the next request goes out on it,
    meets the close before any response, and is sent again on a new connection."""

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        # then close it, as an idle timeout would (the client does not see it before it writes)

    async with serve(engine) as (url, conns):
        t = Http1Transport()
        assert await body_of(await t.handle_async_request(req(url))) == b"ok"
        assert await body_of(await t.handle_async_request(req(url))) == b"ok"
        await t.aclose()
    assert len(conns) == 2


async def test_a_reset_mid_response_is_a_read_error() -> None:
    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await w.drain()
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        w.transport.abort()

    async with serve(engine) as (url, _):
        t = Http1Transport()
        resp = await t.handle_async_request(req(url))
        with pytest.raises(httpx.ReadError):
            await body_of(resp)
        await resp.aclose()
        await t.aclose()


async def test_silence_past_the_read_limit_is_a_read_timeout() -> None:
    answered: list[int] = []

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        if not answered:  # the first connection: a head and a chunk, then silence
            answered.append(1)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
            await w.drain()
        await asyncio.sleep(5)

    async with serve(engine) as (url, _):
        t = Http1Transport()
        resp = await t.handle_async_request(req(url, read=0.2))
        it = aiter(resp.stream)  # type: ignore[arg-type]
        assert await anext(it) == b"hi"
        with pytest.raises(httpx.ReadTimeout):
            await anext(it)
        await resp.aclose()
        with pytest.raises(httpx.ReadTimeout):  # no head at all in time
            await t.handle_async_request(req(url, read=0.2))
        await t.aclose()


async def test_a_body_that_ends_with_the_connection_is_read_whole() -> None:
    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await w.drain()

    async with serve(engine) as (url, _):
        t = Http1Transport()
        assert await body_of(await t.handle_async_request(req(url))) == b"until the end"
        await t.aclose()


async def test_the_per_engine_bound_makes_a_request_wait_then_a_pool_timeout() -> None:
    release = asyncio.Event()

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            await release.wait()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx")
            await w.drain()

    async with serve(engine) as (url, conns):
        t = Http1Transport(limit_per_host=1)
        first = asyncio.create_task(t.handle_async_request(req(url)))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await t.handle_async_request(req(url, pool=0.1))
        second = asyncio.create_task(t.handle_async_request(req(url)))
        await asyncio.sleep(0.05)
        assert not second.done()  # waits for the one connection
        release.set()
        assert await body_of(await first) == b"x"
        assert await body_of(await second) == b"x"
        assert len(conns) == 1
        await t.aclose()


async def test_a_response_that_does_not_parse_is_a_protocol_failure_not_a_hang() -> None:
    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()
        await asyncio.sleep(5)

    async with serve(engine) as (url, _):
        t = Http1Transport()
        with pytest.raises(httpx.TransportError):
            await t.handle_async_request(req(url, read=2.0))
        await t.aclose()


async def test_the_relays_raw_path_sends_the_head_it_is_given_and_reads_the_same_response() -> None:
    seen: list[bytes] = []

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            seen.append(head + body)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
            await w.drain()

    async with serve(engine) as (url, conns):
        t = Http1Transport()
        port = int(url.rsplit(":", 1)[1])
        host_header = f"127.0.0.1:{port}".encode()
        for _ in range(2):
            head = request_head(
                "POST", b"/v1/x?y=1", host_header, [(b"content-type", b"application/json")], 2
            )
            resp = await t.send_raw("127.0.0.1", port, False, head, b"{}", {"read": 2.0})
            assert resp.status_code == 200 and (b"Transfer-Encoding", b"chunked") in resp.headers.raw
            assert await resp.aread() == b"abc"
        await t.aclose()
    assert len(conns) == 1
    assert seen[0] == (
        b"POST /v1/x?y=1 HTTP/1.1\r\nHost: " + host_header + b"\r\ncontent-type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )


async def test_an_https_engine_is_reached_over_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def engine(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecure")
        await w.drain()

    server = await asyncio.start_server(engine, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        t = Http1Transport()
        t._ssl = ssl.create_default_context(cafile=str(cert))  # trust the test's own certificate
        assert await body_of(await t.handle_async_request(req(f"https://127.0.0.1:{port}"))) == b"secure"
        t2 = Http1Transport()  # the system's trust store does not know it: a connect error
        with pytest.raises(httpx.ConnectError):
            await t2.handle_async_request(req(f"https://127.0.0.1:{port}"))
        await t.aclose()
        await t2.aclose()
    finally:
        server.close()
