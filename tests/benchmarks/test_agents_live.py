"""benchmarks/agents_live.py without engines: the scripted sessions it plans, the measuring
proxy (streams relayed as they come, the first output event timed, hints stripped for the
no-hints target), and its summary."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from benchmarks.agents_live import Meter, RepeatResult, plan_session, summarize, table, wait_all
from gateway.local.agent_script import find_script, messages
from testing.loopback_proxy import LoopbackProxy


def test_sessions_alternate_harnesses_grow_context_and_half_have_a_subagent(tmp_path: Path) -> None:
    plans = [plan_session(i, tmp_path, tools=5, seed=1) for i in range(4)]
    assert [p.harness for p in plans] == ["claude", "codex", "claude", "codex"]
    assert [p.subagent for p in plans] == [True, True, False, False]
    for p in plans:
        assert p.marker in (p.work / "notes.txt").read_text()
        sizes = [(p.work / f"part{k}.txt").stat().st_size for k in range(4)]
        assert all(2000 <= s < 6200 for s in sizes), sizes
        tools = [s.tool for s in p.steps if s.tool]
        assert p.steps[-1].say is not None and len(tools) == 5 + (p.subagent and (p.harness == "claude" or 2))
        # the prompt the harness sends parses back into the same script
        from gateway.local.agent_script import script_text

        text = f"<|im_start|>user\nFollow the script. {script_text(p.steps)}<|im_end|>\n"
        assert find_script(messages(text)) == (0, p.steps)
    # the same seed plans the same sessions
    again = plan_session(0, tmp_path / "again", tools=5, seed=1)
    assert again.steps[0].args["command"].split("&&")[1:] == plans[0].steps[0].args["command"].split("&&")[1:]


class Upstream:
    """A target that records what it was sent and streams two events."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                up.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                events = b"event: message_start\ndata: {}\n\nevent: content_block_start\ndata: {}\n\n"
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("content-length", str(len(events)))
                self.end_headers()
                self.wfile.write(events)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_meter_relays_times_the_first_output_and_strips_hints_when_asked() -> None:
    up = Upstream()
    body = {"model": "m", "messages": [], "metadata": {"user_id": "x"}, "prompt_cache_key": "k"}
    headers = {"x-claude-code-session-id": "s1", "thread-id": "t", "x-other": "kept"}
    for strip in (False, True):
        meter = Meter(up.url, strip_hints=strip)
        try:
            r = httpx.post(meter.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=10)
        finally:
            meter.close()
        assert r.status_code == 200 and b"content_block_start" in r.content
        (req,) = meter.requests
        assert req.path == "/v1/messages" and req.status == 200
        assert req.first_output is not None and req.started <= req.first_output <= req.ended
    (h1, b1), (h2, b2) = up.seen
    assert h1["x-claude-code-session-id"] == "s1" and b1 == body
    assert "x-claude-code-session-id" not in h2 and "thread-id" not in h2 and h2["x-other"] == "kept"
    assert b2 == {"model": "m", "messages": []}
    up.server.shutdown()


def test_the_plain_loopback_proxy_relays_the_whole_answer_without_hop_headers() -> None:
    up = Upstream()
    proxy = LoopbackProxy(up.url, 10)
    try:
        r = httpx.post(proxy.url + "/v1/messages", json={"a": 1}, headers={"x-keep": "1", "keep-alive": "5"})
    finally:
        proxy.close()
        up.server.shutdown()
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert r.content.endswith(b"content_block_start\ndata: {}\n\n")
    assert r.headers["content-length"] == str(len(r.content)) and "transfer-encoding" not in r.headers
    ((headers, body),) = up.seen
    assert body == {"a": 1} and headers["x-keep"] == "1" and "keep-alive" not in headers


def test_summary_takes_medians_and_spreads_over_repeats() -> None:
    def run(r: int, done: list[float]) -> RepeatResult:
        return RepeatResult(
            target="t", repeat=r, completion_s=done, completed=2, sessions=2, ttft_s=[0.1, 0.3],
            requests=4, errors=0, prompt_tokens=1000, cached_tokens=800 + r, recomputed_tokens=200,
            engine_prompt_tokens={"a": 600, "b": 400}, pins=3, moves=0,
        )  # fmt: skip

    summary = summarize([run(0, [10, 20, 30]), run(1, [30, 40, 50]), run(2, [50, 60, 70])])
    assert summary["t"]["completion_p90_s"] == (50, 30, 70)
    assert summary["t"]["balance"] == (1.2, 1.2, 1.2)
    text = table(summary)
    assert "| t | 40.0 (20.0-60.0) | 50.0 (30.0-70.0) |" in text and "0.801 (0.800-0.802)" in text


def test_each_session_ends_when_its_own_process_exits_not_when_an_earlier_one_is_waited_for() -> None:
    slow = subprocess.Popen(["sleep", "1"])
    fast = subprocess.Popen(["sleep", "0.05"])
    stuck = subprocess.Popen(["sleep", "60"])
    ended = wait_all([slow, fast, stuck], timeout_s=3)
    assert ended[0] is not None and ended[1] is not None and ended[1] < ended[0]
    assert ended[2] is None and stuck.returncode is not None
