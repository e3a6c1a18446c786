"""The relay never buffers: each upstream SSE chunk reaches the client when the engine sends it.

An engine's own pacing varies with machine load (vLLM coalesces deltas when its API server falls
behind), so this uses the stand-in engine with a fixed inter-token delay behind a real gateway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServedGateway, fake_engine, wait_ready

CHUNKS, ITL_MS = 16, 60


@pytest.fixture(scope="module")
def paced_engine() -> Iterator[str]:
    with fake_engine("--model", "m", "--tokens", str(CHUNKS), "--itl-ms", str(ITL_MS)) as url:
        yield url


def test_each_chunk_is_relayed_as_the_engine_sends_it(paced_engine: str) -> None:
    cfg = {
        "pools": [{"name": "p", "role": "any", "engines": [{"name": "e", "url": paced_engine, "model": "m"}]}]
    }
    with ServedGateway(cfg) as gw:
        wait_ready(gw.url)
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}
        arrivals = []
        t0 = time.perf_counter()
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrivals.append(time.perf_counter() - t0)
    assert len(arrivals) >= CHUNKS
    # the engine spaces its chunks 60 ms apart: so must their arrivals be, end to end
    span = arrivals[CHUNKS - 1] - arrivals[0]
    assert span >= 0.8 * (CHUNKS - 1) * ITL_MS / 1000, arrivals
    assert arrivals[0] < span / 2, arrivals
