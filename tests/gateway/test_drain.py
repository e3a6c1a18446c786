"""SIGTERM drain, against real processes: `agentgw serve` as a subprocess in front of a paced
stand-in engine (testing/fake_engine.py, 50 ms between tokens). With two streams in flight at
SIGTERM, the short one (40 tokens) finishes inside the drain deadline and ends with its last token
and ``[DONE]``; the long one (2,000 tokens) is cut at the deadline with an error chunk then
``[DONE]``; a non-streamed request its (slow) engine has not answered by then gets a 503
``shutting_down``; a request sent after SIGTERM gets a 503 ``shutting_down`` with ``Retry-After`` (or a
refused connection once the listener is closed); ``/ready`` says draining; the process exits 0.
Assertions are on events, never on durations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.local.engines import free_ports
from tests.conftest import fake_engine

ROOT = Path(__file__).resolve().parents[2]
MODEL = "drain-model"
SLOW_MODEL = "drain-slow"
"""Served by an engine that answers a minute after the request: unanswered at the deadline."""


class Pending(threading.Thread):
    """A non-streamed request whose engine has not answered when the deadline passes."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.response: httpx.Response | None = None

    def run(self) -> None:
        body = {"model": SLOW_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        self.response = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)


class Stream(threading.Thread):
    """One streamed chat completion, its SSE data payloads collected as they arrive."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.max_tokens = max_tokens
        self.events: list[str] = []
        self.first = threading.Event()
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def _serve(
    tmp_path: Path, engine_url: str, slow_url: str, port: int, deadline_s: float
) -> subprocess.Popen[bytes]:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "pools": [
                    {"name": "p", "engines": [{"name": "e0", "url": engine_url, "model": MODEL}]},
                    {"name": "q", "engines": [{"name": "slow", "url": slow_url, "model": SLOW_MODEL}]},
                ],
                "drain": {"deadline_s": deadline_s},
            }
        )
    )
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_engine_running(engine_url: str) -> None:
    """Until the slow engine holds the pending request (its vllm:num_requests_running is 1)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "vllm:num_requests_running{" in (text := httpx.get(engine_url + "/metrics", timeout=5).text):
            line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running{"))
            if float(line.rsplit(" ", 1)[1]) >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("the slow engine never received the pending request")


def _wait_ready(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("gateway not ready")


def test_sigterm_drains_in_flight_streams_then_cuts_with_an_error_and_exits_0(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with (
        fake_engine("--model", MODEL, "--tokens", "2000", "--itl-ms", "50") as engine_url,
        fake_engine("--model", SLOW_MODEL, "--ttft-ms", "60000") as slow_url,
    ):
        proc = _serve(tmp_path, engine_url, slow_url, port, deadline_s=8)
        try:
            _wait_ready(proc, url)
            short, long, pending = Stream(url, 40), Stream(url, 2000), Pending(url)
            long.start()
            short.start()
            pending.start()
            assert long.first.wait(60) and short.first.wait(60)
            assert short.events and long.events, (short.error, long.error)
            _wait_engine_running(slow_url)
            proc.send_signal(signal.SIGTERM)

            # after the signal: new work is refused, readiness says draining
            late: httpx.Response | None = None
            ready: httpx.Response | None = None
            refused = False
            deadline = time.monotonic() + 30
            while late is None and time.monotonic() < deadline and proc.poll() is None:
                try:
                    r = httpx.get(url + "/ready", timeout=5)
                    if r.status_code == 503:
                        ready = r
                        late = httpx.post(
                            url + "/v1/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "user", "content": "late"}]},
                            timeout=5,
                        )
                except httpx.ConnectError:
                    refused = True  # the listener is closed: an accepted answer too
                    break
                time.sleep(0.05)
            assert late is not None or refused
            if late is not None:
                assert late.status_code == 503
                assert late.headers["retry-after"]
                assert late.json()["error"]["code"] == "shutting_down"
                assert ready is not None and ready.json()["draining"] is True

            short.join(120)
            long.join(120)
            pending.join(120)
            assert proc.wait(60) == 0
            out = proc.stdout.read().decode() if proc.stdout else ""
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    # the short stream finished inside the deadline: its last token, then [DONE], no error
    assert short.error is None and short.status == 200
    assert short.events[-1] == "[DONE]"
    chunks = short.payloads()
    assert not any("error" in c for c in chunks), out
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # the long one was cut at the deadline: an error chunk naming the shutdown, then [DONE]
    assert long.error is None and long.status == 200, long.error
    assert long.events[-1] == "[DONE]"
    last = long.payloads()[-1]
    assert last["error"]["message"].startswith("the gateway is shutting down"), last
    assert not any(c.get("choices", [{}])[0].get("finish_reason") for c in long.payloads()[:-1])
    # the request its engine had not answered yet: the drain's 503, in the OpenAI shape
    assert pending.response is not None and pending.response.status_code == 503
    assert pending.response.json()["error"]["code"] == "shutting_down"
    assert pending.response.headers["retry-after"]
    assert "1 request(s) finished, 2 cut at the deadline" in out, out
