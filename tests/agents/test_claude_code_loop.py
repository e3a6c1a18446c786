"""Claude Code (`claude -p`, as root: `--allowedTools` with `--permission-mode dontAsk`) runs a
scripted agent loop through the gateway on the default stack's `tiny-agent`: Bash with real tool
gaps (commands that sleep), Read, and its `Agent` subagent inline (`run_in_background: false`),
then an answer that quotes a marker only the file it read holds. Every command is harmless and
runs inside the test's scratch folder (Claude Code's Bash is not confined to one).

From the gateway's session API: one session for the run (Claude Code's session id) with one turn
per step, and the subagent as a child session of it, from the `x-claude-code-agent-id` header
Claude Code really sends. Every turn after a gap served where its prefix is, with vLLM's cached
tokens the block-aligned prefix it shares with what the previous turn left cached, and the
session pinned on that engine through the gap (engine_ext's control API)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.local.agent_script import AGENT_MODEL, Step, script_text
from gateway.local.embedded import LocalStack
from gateway.local.harness import claude_argv, claude_env, harness_clients
from tests.agents.conftest import handles
from tests.agents.loop_support import TIMEOUT_S, LoopRecorder, Renderer, check_session
from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

MARKER = "MARKER-c1a0de42"
SUB_MARKER = "SUB-7411"


def task(work: Path) -> tuple[list[Step], list[Step]]:
    sub = [
        Step(tool="Bash", args={"command": f"cat {work}/sub.txt", "description": "Show the sub file"}),
        Step(say="The sub file says {{find:SUB-[0-9]+}}."),
    ]
    steps = [
        Step(tool="Bash", args={"command": f"cd {work} && sleep 2 && ls", "description": "List the files"}),
        Step(tool="Read", args={"file_path": f"{work}/notes.txt"}, text="Reading the notes."),
        Step(
            tool="Agent",
            args={
                "description": "Check the sub file",
                "prompt": script_text(sub),
                "subagent_type": "general-purpose",
                "run_in_background": False,
            },
        ),
        Step(
            tool="Bash", args={"command": f"cd {work} && sleep 2 && wc -l notes.txt", "description": "Count"}
        ),
        Step(
            tool="Bash",
            args={"command": f"cd {work} && sleep 1 && echo done > done.txt", "description": "Mark"},
        ),
        Step(say="The marker is {{find:MARKER-[0-9a-f]+}}; the subagent found {{find:SUB-[0-9]+}}."),
    ]
    return steps, sub


def test_claude_code_runs_a_scripted_agent_loop_with_a_subagent(
    gateway: ServedGateway, stack: LocalStack, tiny_llama: Path, tmp_path: Path
) -> None:
    clients = harness_clients()
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(f"the marker: {MARKER}\n")
    (work / "sub.txt").write_text(f"{SUB_MARKER}\n")
    steps, sub = task(work)
    recorder = LoopRecorder(gateway.url, handles(stack))
    try:
        env = claude_env(recorder.url, tmp_path / "home", small_model=AGENT_MODEL)
        prompt = "Follow the script. " + script_text(steps)
        argv = claude_argv(
            clients,
            prompt,
            AGENT_MODEL,
            "--allowedTools",
            "Bash",
            "Read",
            "Agent",
            "--permission-mode",
            "dontAsk",
        )
        done = subprocess.run(
            argv,
            env=env,
            cwd=work,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    finally:
        recorder.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"The marker is {MARKER}; the subagent found {SUB_MARKER}." in done.stdout, done.stdout[-2000:]
    assert (work / "done.txt").read_text() == "done\n"

    assert [(e.route, e.status) for e in recorder.exchanges] == [("/v1/messages", 200)] * (
        len(steps) + len(sub)
    )
    assert recorder.queued == 0  # one request at a time, subagent included
    main_id = recorder.exchanges[0].headers["x-claude-code-session-id"]
    agent_id = next(
        e.headers["x-claude-code-agent-id"]
        for e in recorder.exchanges
        if "x-claude-code-agent-id" in e.headers
    )
    child_id = f"{main_id}#{agent_id}"
    sessions = recorder.sessions()
    assert set(sessions) == {main_id, child_id}
    main, child = sessions[main_id], sessions[child_id]
    assert len(main) == len(steps) and len(child) == len(sub)
    assert main[-1].state is not None and main[-1].state["turns"] == len(steps)
    assert main[-1].state["children"] == [child_id]
    assert child[-1].state is not None and child[-1].state["turns"] == len(sub)
    assert child[-1].state["parent_session_id"] == main_id

    renderer = Renderer(tiny_llama)
    checks = check_session("claude", main, renderer) + check_session("claude subagent", child, renderer)
    assert all(c.pinned_during_gap for c in checks), checks
