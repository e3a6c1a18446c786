"""The naive Python proxy: the reference row the gateway must beat by 10x (docs/benchmarks.md).

What a first attempt looks like: FastAPI + uvicorn, one shared ``httpx.AsyncClient``, a
``StreamingResponse`` that forwards each upstream chunk, round-robin over the backends. Nothing
here is tuned on purpose; it is a yardstick, not a design.

    python -m benchmarks.naive_proxy --port 24120 --backend http://127.0.0.1:24001 --backend http://127.0.0.1:24002
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

__all__ = ["create_app", "main"]

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


def create_app(backends: list[str]) -> FastAPI:
    if not backends:
        raise ValueError("at least one backend is needed")
    next_backend = itertools.cycle(backends).__next__

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as client:
            app.state.client = client
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    @app.get("/ready")
    async def health() -> Response:
        return Response(status_code=200)

    async def forward(request: Request, path: str) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        body = await request.body()
        upstream = client.build_request(
            "POST", next_backend() + path, content=body, headers={"content-type": "application/json"}
        )
        resp = await client.send(upstream, stream=True)
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.naive_proxy", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--backend", action="append", required=True, help="backend base URL (repeatable)")
    args = ap.parse_args(argv)
    app = create_app([b.rstrip("/") for b in args.backend])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
