"""A Chat Completions harness (the OpenAI SDK, tools run here) runs a scripted agent loop through
the gateway on the default stack's `tiny-agent`: the scripted decoder makes the engine call the
tools, vLLM's `hermes` parser returns them as `tool_calls`, and the answer quotes a marker that
only a file a tool read holds. One session, one turn per step; every turn after a tool's gap
served where the session's prefix is, with vLLM's cached tokens the block-aligned prefix it
shares with what the previous turn left cached; the session pinned on that engine through each gap."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from openai import OpenAI

from gateway.local.agent_script import AGENT_MODEL, Step, script_text
from gateway.local.embedded import LocalStack
from tests.agents.conftest import handles
from tests.agents.loop_support import LoopRecorder, Renderer, check_session
from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": what,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]},
        },
    }
    for name, what, arg in (("run", "Run a shell command", "command"), ("read_file", "Read a file", "path"))
]


def run_tool(name: str, args: dict[str, str], cwd: Path) -> str:
    if name == "run":
        done = subprocess.run(
            args["command"], shell=True, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        return done.stdout + done.stderr
    assert name == "read_file", name
    return (cwd / args["path"]).read_text()


def test_chat_completions_harness_runs_a_scripted_loop(
    gateway: ServedGateway, stack: LocalStack, tiny_llama: Path, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the marker: MARKER-c4a7f00d\n")
    steps = [
        Step(tool="run", args={"command": "sleep 1 && ls"}),
        Step(tool="read_file", args={"path": "notes.txt"}),
        Step(tool="run", args={"command": "sleep 1 && wc -l notes.txt"}),
        Step(say="The marker is {{find:MARKER-[0-9a-f]+}}."),
    ]
    recorder = LoopRecorder(gateway.url, handles(stack))
    client = OpenAI(base_url=recorder.url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, object]] = [{"role": "user", "content": "Do this. " + script_text(steps)}]
    calls = []
    try:
        for _ in range(10):
            reply = client.chat.completions.create(
                model=AGENT_MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=512,
                extra_headers={"X-Session-ID": "chat-loop-1"},
            ).choices[0]
            message = reply.message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            assert reply.finish_reason == "tool_calls", reply
            for tc in message.tool_calls:
                args = json.loads(tc.function.arguments)
                calls.append((tc.function.name, args))
                messages.append(
                    {"role": "tool", "tool_call_id": tc.id, "content": run_tool(tc.function.name, args, work)}
                )
    finally:
        recorder.close()

    assert calls == [(s.tool, s.args) for s in steps[:-1]]
    assert message.content == "The marker is MARKER-c4a7f00d."
    assert recorder.queued == 0
    sessions = recorder.sessions()
    assert list(sessions) == ["chat-loop-1"]
    turns = sessions["chat-loop-1"]
    assert len(turns) == len(steps) and turns[-1].state is not None
    assert turns[-1].state["turns"] == len(steps)
    checks = check_session("chat", turns, Renderer(tiny_llama))
    # engine_ext held the session's KV on its engine through every tool gap
    assert all(c.pinned_during_gap for c in checks), checks
