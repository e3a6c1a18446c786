"""`agentgw serve` with no config: builds the tiny model, starts local engines, serves, and on
SIGTERM stops everything it started. An invalid config fails with one message naming the key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.local.engines import free_ports

pytestmark = pytest.mark.engine


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def alive(pids: set[int]) -> set[int]:
    live = set()
    for p in pids:
        try:
            os.kill(p, 0)
            live.add(p)
        except ProcessLookupError:
            pass
    return live


def test_embedded_default_serves_and_sigterm_leaves_no_orphans(tmp_path: Path) -> None:
    """The gateway listens while its engine starts: /health 200, /ready 503 naming the engine
    and its log, a chat 503 with Retry-After; progress on stderr, then where to point clients."""
    port = free_ports(1)[0]
    env = {**os.environ, "AGENTGW_HOME": str(tmp_path / "home")}
    out = tmp_path / "serve.out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--first-turn", "0", "--warm", "1", "--port", str(port)],
        env=env,
        stdout=out.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    early: list[tuple[int, dict, int, str | None]] = []  # answers while the engine was starting
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, out.read_text()
            try:
                ready = httpx.get(url + "/ready", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if ready.status_code == 200:
                break
            if not early:
                health = httpx.get(url + "/health", timeout=5).status_code
                c = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
                early.append((health, ready.json(), c.status_code, c.headers.get("retry-after")))
                early_chat = c.json()
            time.sleep(0.2)
        assert early, "the gateway did not answer before its engine was up"
        health, ready_body, chat_status, retry_after = early[0]
        assert (health, chat_status, retry_after) == (200, 503, "2"), early
        assert ready_body["ready"] is False and ready_body["pools"] == {"default": False}, ready_body
        assert ready_body["waiting_for"]["engine0"].startswith("starting (log "), ready_body
        assert early_chat["error"]["code"] == "no_healthy_engine", early_chat
        assert "engines starting (engine0)" in early_chat["error"]["message"], early_chat
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(**chat)  # type: ignore[call-overload]
        assert reply.choices[0].message.content is not None
        assert httpx.get(url + "/ready", timeout=5).json()["waiting_for"] == {}
        # The startup thread polls the engine every 0.5 s on its own, so its "is up" and
        # "ready in" lines can follow the health check that opened /ready by a moment.
        deadline = time.monotonic() + 30
        while "agentgw: ready in " not in (text := out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "agentgw: engine0 is up (" in text, text
        ready_in = int(text.split("agentgw: ready in ", 1)[1].split(" s", 1)[0])
        assert f'OpenAI(base_url="{url}/v1"' in text and "agentgw claude" in text and "agentgw codex" in text
        if ready_in >= 11:  # a line at least every 10 s while the engine starts
            assert "agentgw: engines starting (" in text and f"{tmp_path / 'home' / 'logs'}" in text, text
        started = descendants(proc.pid)
        assert started, "the engines should be children of the gateway process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(started) == set()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_invalid_config_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        "pools:\n  - name: p\n    role: boss\n    engines: [{name: e, url: 'http://x:1', model: m}]\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "invalid config key 'pools.0.role'" in r.stderr


def test_missing_key_environment_variable_fails_at_start(tmp_path: Path) -> None:
    cfg = tmp_path / "keys.yaml"
    cfg.write_text(
        "pools:\n  - name: p\n    engines: [{name: e, url: 'http://127.0.0.1:1', model: m}]\n"
        "auth:\n  tenants: [{name: acme, key_env: [AGENTGW_TEST_UNSET_KEY]}]\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "AGENTGW_TEST_UNSET_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2
    assert "'auth.tenants.0.key_env': environment variable AGENTGW_TEST_UNSET_KEY is not set" in r.stderr


def test_an_engine_that_fails_to_start_stops_the_gateway_with_its_log(tmp_path: Path) -> None:
    """A model folder vLLM cannot load (a complete build whose config.json is then broken: its
    marker still says complete): the gateway, already listening, says which engine failed and
    where its log is, and exits 1."""
    from gateway.local.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "home" / "models" / "tiny-llama")
    (model / "config.json").write_text("{not json")
    port = free_ports(1)[0]
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--first-turn", "0", "--warm", "1", "--port", str(port)],
        env={**os.environ, "AGENTGW_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    log = tmp_path / "home" / "logs" / "engine0.log"
    assert f"gateway on http://127.0.0.1:{port}" in r.stderr
    assert "an engine failed to start: engine engine0 exited with code" in r.stderr, r.stderr[-3000:]
    assert f"log {log}" in r.stderr and "ready in" not in r.stderr
