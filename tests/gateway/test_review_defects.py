"""Defects found in the review of issue 10, each with the test that failed before its fix:
approximate hashes that differed per process, a ``/debug/route`` dry run that advanced the
request counter, and a non-streamed request whose client left while the engine was working
(the engine kept generating)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from gateway.core.turn import approx_hashes
from tests.conftest import ServedGateway, fake_engine, wait_ready
from tests.gateway.test_streaming import streams_cut

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "fix the bug " * 200}], "max_tokens": 4}


def test_approximate_hashes_are_the_same_in_every_process() -> None:
    text = "the same prompt on two replicas " * 100
    code = "import sys; from gateway.core.turn import approx_hashes; print(approx_hashes(sys.argv[1], 512))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code, text],
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
            cwd=".",
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert outs == {str(approx_hashes(text, 512))} and len(approx_hashes(text, 512)) == 6


def _config(*urls: str) -> dict[str, object]:
    return {
        "pools": [
            {
                "name": "p",
                "role": "any",
                "engines": [{"name": f"e{i}", "url": u, "model": MODEL} for i, u in enumerate(urls)],
            }
        ],
        "routing": {"profile": "round_robin"},
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
    }


def _decisions(gw: ServedGateway) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("agentgw_route_decisions_total{")
    )


def test_debug_route_is_a_dry_run() -> None:
    with (
        fake_engine("--model", MODEL) as a,
        fake_engine("--model", MODEL) as b,
        ServedGateway(_config(a, b)) as gw,
    ):
        wait_ready(gw.url)
        before = _decisions(gw)
        predicted = {
            httpx.post(gw.url + "/debug/route", json=CHAT, timeout=10).json()["decision"]["engine"]
            for _ in range(3)
        }
        assert len(predicted) == 1  # round-robin's counter did not move
        assert _decisions(gw) == before  # nothing counted
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.headers["x-agentgw-engine"] == predicted.pop()
        assert _decisions(gw) == before + 1


def test_a_client_leaving_a_non_streamed_request_aborts_it_on_the_engine() -> None:
    with fake_engine("--model", MODEL, "--ttft-ms", "30000") as slow, ServedGateway(_config(slow)) as gw:
        wait_ready(gw.url)
        assert streams_cut(slow) == 0
        try:
            httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(10, read=0.5))
        except httpx.ReadTimeout:
            pass  # the client gave up and closed its connection
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and streams_cut(slow) == 0:
            time.sleep(0.05)
        assert streams_cut(slow) == 1
