"""Many concurrent streams through one gateway, against the stand-in engines (testing/fake_engine.py).

Issue 10's target is 2,000 concurrent streams within the admission limits with no error; CI sends
a smaller burst through the same path (tokenizer on: the small body analysed on the loop, exact
block hashes, routing, two engines). What is asserted is counters, never durations:

- a burst of N streams, all sent before any answer is read, completes: N 200s ending in
  ``[DONE]`` with no error event, the gateway's 200 counter moves by N, no upstream error, no
  engine ejected, nothing left in flight;
- a burst beyond the admission limits (``max_inflight`` + ``max_queue``) while the engine holds
  every stream: exactly the excess gets the 503 ``gateway_busy`` with ``Retry-After``, and once
  the engine lets go, every admitted or queued stream completes.
"""

from __future__ import annotations

import asyncio
import re
import resource
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from tests.conftest import ServedGateway, fake_engine

MODEL = "bench-model"
BODY = orjson.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello in one short sentence, please."}],
        "max_tokens": 16,
        "stream": True,
    }
)


def _config(urls: list[str], tokenizer: Path, **extra: Any) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "p",
                "role": "any",
                "engines": [{"name": f"e{i}", "url": u, "model": MODEL} for i, u in enumerate(urls)],
            }
        ],
        "models": [{"name": MODEL, "tokenizer": str(tokenizer)}],
        "analysis": {"mode": "thread"},  # small bodies are analysed on the loop in every mode
        **extra,
    }


async def _burst(url: str, n: int) -> list[tuple[int, bytes, str]]:
    """N streamed requests on N connections, all sent at once: (status, body, Retry-After)."""
    out: list[tuple[int, bytes, str]] = []
    connector = aiohttp.TCPConnector(limit=n, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            async with session.post(
                url + "/v1/chat/completions", data=BODY, headers={"content-type": "application/json"}
            ) as r:
                out.append((r.status, await r.read(), r.headers.get("retry-after", "")))

        await asyncio.gather(*(one() for _ in range(n)))
    return out


def _counter(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _completed(body: bytes) -> bool:
    data = re.findall(rb"^data: (.*)$", body, re.M)
    return bool(data) and data[-1] == b"[DONE]" and not any(b'"error"' in d for d in data)


def _room_for(n: int) -> int:
    """``n``, or fewer when the file-descriptor limit cannot hold 3 sockets per stream here
    (client, server, upstream): the soft limit is raised to the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return min(n, (hard - 256) // 3)


def test_a_burst_of_streams_completes_with_no_error(tiny_llama: Path) -> None:
    n = _room_for(600)
    assert n >= 200, "the file-descriptor limit is too low for this test"
    with (
        fake_engine("--model", MODEL) as u0,
        fake_engine("--model", MODEL) as u1,
        ServedGateway(_config([u0, u1], tiny_llama)) as gw,
    ):
        before = httpx.get(gw.url + "/metrics").text
        results = asyncio.run(_burst(gw.url, n))
        after = httpx.get(gw.url + "/metrics").text
        svc = gw.service
        assert [s for s, _, _ in results].count(200) == n, sorted({s for s, _, _ in results})
        assert all(_completed(b) for _, b, _ in results)
        ok = "agentgw_requests_total"
        assert _counter(after, ok, status="200") - _counter(before, ok, status="200") == n
        # no upstream error; a connect the gateway's own lag timed out was retried (connect_lag)
        errors = _counter(after, "agentgw_upstream_errors_total")
        assert errors == _counter(after, "agentgw_upstream_errors_total", kind="connect_lag")
        assert all(s.healthy for s in svc.cluster.engines.values())
        assert svc.admission.inflight == 0 and svc.admission.waiting == 0


def test_streams_beyond_the_admission_limits_get_503_and_the_rest_complete(tiny_llama: Path) -> None:
    n, inflight, queue = 120, 40, 30
    admission = {"max_inflight": inflight, "max_queue": queue, "queue_timeout_s": 300}
    with (
        fake_engine("--model", MODEL, "--hold") as u0,
        ServedGateway(_config([u0], tiny_llama, admission=admission)) as gw,
    ):
        svc = gw.service

        async def run() -> list[tuple[int, bytes, str]]:
            task = asyncio.create_task(_burst(gw.url, n))
            # every request has been answered 503 or is admitted or waiting (events, no clock)
            while not task.done():
                rejected = svc.admission.stats.rejected.get("gateway_busy", 0)
                if svc.admission.inflight + svc.admission.waiting + rejected == n:
                    break
                await asyncio.sleep(0.05)
            assert svc.admission.inflight == inflight and svc.admission.waiting == queue
            async with httpx.AsyncClient() as c:
                assert (await c.post(u0 + "/release")).status_code == 200
            return await task

        results = asyncio.run(run())
        statuses = [s for s, _, _ in results]
        assert statuses.count(503) == n - inflight - queue
        assert statuses.count(200) == inflight + queue
        for status, body, retry_after in results:
            if status == 503:
                assert orjson.loads(body)["error"]["code"] == "gateway_busy" and retry_after == "1"
            else:
                assert _completed(body)
        assert svc.admission.stats.rejected == {"gateway_busy": n - inflight - queue}
        assert all(s.healthy for s in svc.cluster.engines.values())
