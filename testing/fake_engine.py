"""A fast OpenAI-compatible stand-in engine: no model, no framework, a few microseconds per request.

It answers what a gateway sends to a vLLM engine, so that a benchmark measures the gateway and not
the engine behind it:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: ``stream: true`` gives ``--tokens``
  SSE chunks (16 by default, capped by the request's ``max_tokens``), a usage chunk when
  ``stream_options.include_usage`` is set, then ``data: [DONE]``; otherwise one JSON body.
  ``prompt_tokens`` is estimated as body bytes / 4 (no tokenizer).
- ``POST /v1/messages`` (Anthropic) and ``POST /v1/responses`` (OpenAI Responses), as vLLM serves
  them: ``stream: true`` gives their typed SSE events (``message_start`` ... ``content_block_delta``
  per token ... ``message_stop``; ``response.created``, ``response.output_text.delta`` per token,
  ``response.completed``), paced like the chat stream; otherwise one JSON body. ``max_tokens`` /
  ``max_output_tokens`` cap the tokens as above.
- ``POST /v1/messages/count_tokens``: ``{"input_tokens": body bytes / 4}``.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, labelled ``model_name``).

HTTP/1.1 with keep-alive, chunked streaming and TCP_NODELAY, on a raw asyncio protocol (uvloop and
httptools when installed). With ``--ttft-ms`` / ``--itl-ms`` at 0 (the default) a whole stream
leaves in one write; otherwise the chunks are spaced out in time.

    python -m testing.fake_engine --port 24001 --model bench-model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools
import orjson

__all__ = ["EngineState", "FakeEngineProtocol", "main", "serve"]

_ID_WIDTH = 16
_ID_SLOT = b"@" * _ID_WIDTH
_STATUS_TEXT = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_ROUTES = (
    b"/v1/chat/completions",
    b"/v1/completions",
    b"/v1/messages",
    b"/v1/messages/count_tokens",
    b"/v1/responses",
    b"/health",
    b"/v1/models",
    b"/metrics",
)
_LAST_CHUNK = b"0\r\n\r\n"
_DONE_CHUNK = _chunk(_DONE) + _LAST_CHUNK


class EngineState:
    """Per-process settings, canned response parts and counters, shared by every connection."""

    def __init__(self, model: str, tokens: int = 16, ttft_s: float = 0.0, itl_s: float = 0.0) -> None:
        self.model = model
        self.tokens = tokens
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.created = int(time.time())
        self.num_requests = 0
        self.instance = os.urandom(3).hex().encode()
        """Leads every id, so ids differ between stand-ins and across a restart (as vLLM's random
        ones do: the gateway keys a stored response's owner by its id)."""
        self.num_running = 0
        self.num_waiting = 0
        self.slots: asyncio.Semaphore | None = None
        """``--max-running``: streams past it wait (their time to first token grows), as requests
        wait in a full vLLM batch; None: no limit."""
        self.num_unknown_paths = 0
        self.num_count_tokens = 0
        self.num_connections = 0
        self.num_streams_cut = 0  # paced streams whose client left before the last chunk
        self.hold: asyncio.Event | None = None
        """``--hold``: streams send their headers, then wait for ``POST /release``."""
        self.cut_after: int | None = None
        """``--cut-after-bytes``: non-streamed answers announce their whole length, send this
        many body bytes and close the connection (an engine dying mid-answer)."""
        self._stream_events: dict[tuple[bool, int], list[bytes]] = {}
        self._framed: dict[tuple[bool, int], bytes] = {}
        self.models_body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "fake-engine",
                        "root": model,
                        "max_model_len": 262144,
                    }
                ],
            }
        )

    def next_id(self) -> bytes:
        self.num_requests += 1
        return b"%s%010x" % (self.instance, self.num_requests)

    def stream_events(self, chat: bool, n: int) -> list[bytes]:
        """The ``n`` token events of a stream, SSE-framed, with ``_ID_SLOT`` where the id goes."""
        key = (chat, n)
        events = self._stream_events.get(key)
        if events is None:
            events = [_sse(self._token_chunk(chat, i, n)) for i in range(n)]
            self._stream_events[key] = events
        return events

    def framed_stream(self, chat: bool, n: int) -> bytes:
        """The token events already framed as HTTP chunks, for a stream sent in one write."""
        key = (chat, n)
        framed = self._framed.get(key)
        if framed is None:
            framed = b"".join(_chunk(ev) for ev in self.stream_events(chat, n))
            self._framed[key] = framed
        return framed

    def _token_chunk(self, chat: bool, i: int, n: int) -> dict[str, object]:
        finish = "length" if i == n - 1 else None
        text = f" word{i}"
        if chat:
            delta: dict[str, str] = {"content": text}
            if i == 0:
                delta = {"role": "assistant", "content": text}
            choice: dict[str, object] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            obj = "text_completion"
        return {
            "id": self._id_prefix(chat) + _ID_SLOT.decode(),
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    @staticmethod
    def _id_prefix(chat: bool) -> str:
        return "chatcmpl-" if chat else "cmpl-"

    def usage_event(self, chat: bool, rid: bytes, prompt_tokens: int, completion_tokens: int) -> bytes:
        return _sse(
            {
                "id": self._id_prefix(chat) + rid.decode(),
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    def full_body(self, chat: bool, rid: bytes, prompt_tokens: int, n: int) -> bytes:
        text = "".join(f" word{i}" for i in range(n))
        if chat:
            choice: dict[str, object] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "text_completion"
        return orjson.dumps(
            {
                "id": self._id_prefix(chat) + rid.decode(),
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": _usage(prompt_tokens, n),
            }
        )

    def metrics_body(self) -> bytes:
        label = f'{{model_name="{self.model}"}}'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(self.num_running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {float(self.num_waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, self.num_running / 256):.4f}",
            "# HELP fake_engine_requests_total Requests answered since start.",
            "# TYPE fake_engine_requests_total counter",
            f"fake_engine_requests_total{label} {float(self.num_requests)}",
            "# HELP fake_engine_count_tokens_total Token-counting calls answered since start.",
            "# TYPE fake_engine_count_tokens_total counter",
            f"fake_engine_count_tokens_total{label} {float(self.num_count_tokens)}",
            "# HELP fake_engine_connections_total TCP connections accepted since start.",
            "# TYPE fake_engine_connections_total counter",
            f"fake_engine_connections_total{label} {float(self.num_connections)}",
            "# HELP fake_engine_streams_cut_total Paced streams whose connection closed mid-stream.",
            "# TYPE fake_engine_streams_cut_total counter",
            f"fake_engine_streams_cut_total{label} {float(self.num_streams_cut)}",
        ]
        return ("\n".join(lines) + "\n").encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _typed(event: str, obj: dict[str, object]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps({"type": event, **obj}) + b"\n\n"


def _messages(
    model: str, rid: str, prompt_tokens: int, n: int, created: int, capped: bool
) -> tuple[bytes, list[bytes]]:
    """Anthropic Messages: the whole message, and its stream's events (a text delta per token).
    ``capped``: ``max_tokens`` ended it (``stop_reason: max_tokens``), else ``end_turn``."""
    del created
    stop = "max_tokens" if capped else "end_turn"
    words = [f" word{i}" for i in range(n)]
    message: dict[str, object] = {
        "id": "msg_" + rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }
    full = {
        **message,
        "content": [{"type": "text", "text": "".join(words)}],
        "stop_reason": stop,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": n},
    }
    events = [
        _typed("message_start", {"message": message}),
        _typed("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        *(
            _typed("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": w}})
            for w in words
        ),
        _typed("content_block_stop", {"index": 0}),
        _typed(
            "message_delta",
            {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": n}},
        ),
        _typed("message_stop", {}),
    ]
    return orjson.dumps(full), events


def _responses(
    model: str, rid: str, prompt_tokens: int, n: int, created: int, capped: bool
) -> tuple[bytes, list[bytes]]:
    """OpenAI Responses: the whole response, and its stream's events (a text delta per token).
    ``capped``: ``max_output_tokens`` ended it (``incomplete``), else ``completed``."""
    status = "incomplete" if capped else "completed"
    words = [f" word{i}" for i in range(n)]
    item_id = "msg_" + rid
    response: dict[str, object] = {
        "id": "resp_" + rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "model": model,
        "output": [],
        "usage": None,
    }
    done = {
        **response,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if capped else None,
        "output": [
            {
                "type": "message",
                "id": item_id,
                "role": "assistant",
                "status": status,
                "content": [{"type": "output_text", "text": "".join(words), "annotations": []}],
            }
        ],
        "usage": {"input_tokens": prompt_tokens, "output_tokens": n, "total_tokens": prompt_tokens + n},
    }
    events = [_typed("response.created", {"sequence_number": 0, "response": response})]
    events += [
        _typed(
            "response.output_text.delta",
            {"sequence_number": i + 1, "item_id": item_id, "output_index": 0, "content_index": 0, "delta": w},
        )
        for i, w in enumerate(words)
    ]
    events.append(_typed(f"response.{status}", {"sequence_number": n + 1, "response": done}))
    return orjson.dumps(done), events


def _error_body(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": param, "code": status}})


class FakeEngineProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection. Requests are answered in order; a delayed stream pauses reading."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._expect_continue = False
        self._keep_alive = True
        self._delayed: asyncio.Task[None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.state.num_connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._reply(400, _error_body(400, "malformed HTTP request", "BadRequestError"), close=True)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._delayed is not None:
            self.state.num_streams_cut += 1
            self._delayed.cancel()
        self.transport = None

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()
        if self._expect_continue and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self._url.split(b"?", 1)[0]
        body = b"".join(self._body)
        self._body = []
        if method == b"POST" and path == b"/v1/chat/completions":
            self._generate(body, chat=True)
        elif method == b"POST" and path == b"/v1/completions":
            self._generate(body, chat=False)
        elif method == b"POST" and path == b"/release" and self.state.hold is not None:
            self.state.hold.set()  # every held stream goes on, and later ones are not held
            self._reply(200, b"{}")
        elif method == b"POST" and path == b"/v1/messages/count_tokens":
            self.state.num_count_tokens += 1
            self._reply(200, orjson.dumps({"input_tokens": len(body) // 4}))
        elif method == b"POST" and path in (b"/v1/messages", b"/v1/responses"):
            self._generate_typed(body, path.decode())
        elif method == b"GET" and path == b"/health":
            self._reply(200, b"", content_type=b"text/plain")
        elif method == b"GET" and path == b"/v1/models":
            self._reply(200, self.state.models_body)
        elif method == b"GET" and path == b"/metrics":
            self._reply(200, self.state.metrics_body(), content_type=b"text/plain; version=0.0.4")
        elif path in _ROUTES:
            self._reply(405, _error_body(405, "method not allowed", "MethodNotAllowed"))
        else:
            self.state.num_unknown_paths += 1
            self._reply(404, _error_body(404, f"no route {path.decode(errors='replace')}", "NotFoundError"))

    # responses

    def _request(self, body: bytes) -> dict[str, object] | None:
        """The request's JSON object for the served model, or None after answering 400 / 404."""
        try:
            req = orjson.loads(body)
            if not isinstance(req, dict):
                raise ValueError("the body must be a JSON object")
        except (orjson.JSONDecodeError, ValueError) as exc:
            self._reply(400, _error_body(400, f"invalid JSON body: {exc}", "BadRequestError"))
            return None
        model = req.get("model")
        if model is not None and model != self.state.model:
            msg = f"The model `{model}` does not exist."
            self._reply(404, _error_body(404, msg, "NotFoundError", "model"))
            return None
        return req

    def _generate(self, body: bytes, chat: bool) -> None:
        state = self.state
        req = self._request(body)
        if req is None:
            return
        n = state.tokens
        max_tokens = req.get("max_tokens") or req.get("max_completion_tokens")
        if isinstance(max_tokens, int) and 0 < max_tokens < n:
            n = max_tokens
        rid = state.next_id()
        prompt_tokens = max(1, len(body) // 4)
        if not req.get("stream"):
            if state.ttft_s > 0:  # the whole answer after the delay (a cut connection is counted:
                # reading stays on, so the client's leaving is seen while the answer is pending)
                full = state.full_body(chat, rid, prompt_tokens, n)
                self._delayed = asyncio.get_running_loop().create_task(self._late(full))
                return
            self._whole(state.full_body(chat, rid, prompt_tokens, n))
            return
        opts = req.get("stream_options")
        usage = None
        if isinstance(opts, dict) and opts.get("include_usage"):
            usage = state.usage_event(chat, rid, prompt_tokens, n)
        head = self._head(200, b"text/event-stream", None)
        if state.ttft_s <= 0 and state.itl_s <= 0 and state.hold is None:
            framed = state.framed_stream(chat, n).replace(_ID_SLOT, rid)
            tail = _DONE_CHUNK if usage is None else _chunk(usage) + _DONE_CHUNK
            self._write(head + framed + tail)
            return
        events = [ev.replace(_ID_SLOT, rid) for ev in state.stream_events(chat, n)]
        if usage is not None:
            events.append(usage)
        events.append(_DONE)
        assert self.transport is not None
        self.transport.pause_reading()
        self._delayed = asyncio.get_running_loop().create_task(self._paced(head, events))

    def _generate_typed(self, body: bytes, route: str) -> None:
        """``/v1/messages`` or ``/v1/responses``: their own events and bodies (not a hot path)."""
        state = self.state
        req = self._request(body)
        if req is None:
            return
        n = state.tokens
        cap = req.get("max_tokens" if route == "/v1/messages" else "max_output_tokens")
        if isinstance(cap, int) and 0 < cap < n:
            n = cap
        rid = state.next_id().decode()
        prompt_tokens = max(1, len(body) // 4)
        make = _messages if route == "/v1/messages" else _responses
        full, events = make(state.model, rid, prompt_tokens, n, state.created, n < state.tokens)
        if not req.get("stream"):
            if state.ttft_s > 0:
                self._delayed = asyncio.get_running_loop().create_task(self._late(full))
                return
            self._whole(full)
            return
        head = self._head(200, b"text/event-stream", None)
        if state.ttft_s <= 0 and state.itl_s <= 0:
            self._write(head + b"".join(_chunk(ev) for ev in events) + _LAST_CHUNK)
            return
        assert self.transport is not None
        self.transport.pause_reading()
        self._delayed = asyncio.get_running_loop().create_task(self._paced(head, events))

    async def _late(self, body: bytes) -> None:
        """A non-streamed answer sent after ``ttft_s`` (the time a real engine takes to finish)."""
        state = self.state
        async with self._running():
            try:
                await asyncio.sleep(state.ttft_s)
                self._delayed = None
                self._reply(200, body)
            finally:
                self._delayed = None

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        """Hold one of the engine's ``--max-running`` places (waiting for one when all are taken)."""
        state = self.state
        if state.slots is not None:
            state.num_waiting += 1
            try:
                await state.slots.acquire()
            finally:
                state.num_waiting -= 1
        state.num_running += 1
        try:
            yield
        finally:
            state.num_running -= 1
            if state.slots is not None:
                state.slots.release()

    async def _paced(self, head: bytes, events: list[bytes]) -> None:
        state = self.state
        try:
            self._write(head, end=False)
            async with self._running():
                if state.hold is not None:
                    await state.hold.wait()
                await asyncio.sleep(state.ttft_s)
                for i, ev in enumerate(events):
                    if i and state.itl_s > 0:
                        await asyncio.sleep(state.itl_s)
                    self._write(_chunk(ev), end=False)
                self._write(_LAST_CHUNK)
        finally:
            self._delayed = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def _head(self, status: int, content_type: bytes, length: int | None) -> bytes:
        lines = [
            b"HTTP/1.1 %d %b" % (status, _STATUS_TEXT.get(status, b"Error")),
            b"content-type: " + content_type,
            b"content-length: %d" % length if length is not None else b"transfer-encoding: chunked",
        ]
        if not self._keep_alive:
            lines.append(b"connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _whole(self, body: bytes) -> None:
        """A non-streamed 200, cut after ``cut_after`` body bytes when that is set."""
        cut = self.state.cut_after
        if cut is None:
            self._reply(200, body)
            return
        self._write(self._head(200, b"application/json", len(body)) + body[:cut], end=False)
        if self.transport is not None:
            self.transport.close()

    def _reply(
        self, status: int, body: bytes, content_type: bytes = b"application/json", close: bool = False
    ) -> None:
        if close:
            self._keep_alive = False
        self._write(self._head(status, content_type, len(body)) + body)

    def _write(self, data: bytes, end: bool = True) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        if end and not self._keep_alive:
            transport.close()


async def serve(
    host: str,
    port: int,
    state: EngineState,
    started: Callable[[asyncio.Server], None] | None = None,
) -> None:
    """Serve until cancelled. ``started`` is called once the socket listens."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FakeEngineProtocol(state), host, port, backlog=4096)
    if started is not None:
        started(server)
    async with server:
        await server.serve_forever()


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m testing.fake_engine", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="bench-model", help="the served model name (others get 404)")
    ap.add_argument("--tokens", type=int, default=16, help="SSE token chunks per stream")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token chunk")
    ap.add_argument("--itl-ms", type=float, default=0.0, help="delay between token chunks")
    ap.add_argument(
        "--hold", action="store_true", help="streams wait after their headers until POST /release"
    )
    ap.add_argument(
        "--cut-after-bytes",
        type=int,
        default=None,
        help="non-streamed answers send this many body bytes, then the connection closes",
    )
    ap.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="streams generating at once; later ones wait for a place (a fixed capacity)",
    )
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error("--tokens must be >= 1")
    state = EngineState(args.model, args.tokens, args.ttft_ms / 1000, args.itl_ms / 1000)
    if args.hold:
        state.hold = asyncio.Event()
    state.cut_after = args.cut_after_bytes
    if args.max_running is not None:
        if args.max_running < 1:
            ap.error("--max-running must be >= 1")
        state.slots = asyncio.Semaphore(args.max_running)

    def started(server: asyncio.Server) -> None:
        print(f"fake engine {args.model!r} listening on http://{args.host}:{args.port}", flush=True)

    _install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, state, started))


if __name__ == "__main__":
    main()
