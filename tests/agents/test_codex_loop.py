"""Codex (`codex exec -s workspace-write` in a scratch folder, its v1 multi-agent tools pinned
on) runs a scripted agent loop through the gateway on the default stack's `tiny-agent`: its shell
tool with real tool gaps (commands that sleep), a subagent (`spawn_agent`, then `wait_agent` on
the id it returned), then an answer that quotes a marker only a file it read holds.

From the gateway's session API: one session for the run (Codex's thread id) with one turn per
step, and the subagent's thread as a child session of it, from the `x-codex-parent-thread-id`
header Codex really sends. Every turn after a gap served where its prefix is, with vLLM's cached
tokens the block-aligned prefix it shares with what the previous turn left cached, and the
session pinned on that engine through the gap (engine_ext's control API)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.local.agent_script import AGENT_MODEL, Step, script_text
from gateway.local.embedded import LocalStack
from gateway.local.harness import MULTI_AGENT_V1, codex_argv, codex_env, harness_clients
from tests.agents.conftest import handles
from tests.agents.loop_support import TIMEOUT_S, LoopRecorder, Renderer, check_session
from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

MARKER = "MARKER-c0dec0de"
SUB_MARKER = "SUB-9120"
SPAWN = "multi_agent_v1__spawn_agent"  # vLLM's flat name of a namespaced Responses tool
WAIT = "multi_agent_v1__wait_agent"


def task(work: Path) -> tuple[list[Step], list[Step]]:
    def shell(cmd: str) -> Step:
        return Step(tool="exec_command", args={"cmd": cmd, "workdir": str(work)})

    sub = [shell("cat sub.txt"), Step(say="The sub file says {{find:SUB-[0-9]+}}.")]
    steps = [
        shell("sleep 2 && ls"),
        shell("cat notes.txt"),
        Step(tool=SPAWN, args={"message": script_text(sub)}),
        Step(
            tool=WAIT, args={"targets": ['{{find:"agent_id":\\s*"([^"]+)"}}'], "timeout_ms": TIMEOUT_S * 1000}
        ),
        shell("sleep 2 && echo done > done.txt && wc -l notes.txt"),
        Step(say="The marker is {{find:MARKER-[0-9a-f]+}}; the subagent found {{find:SUB-[0-9]+}}."),
    ]
    return steps, sub


def test_codex_runs_a_scripted_agent_loop_with_a_subagent(
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
        env = codex_env(recorder.url + "/v1", tmp_path / "home", features=MULTI_AGENT_V1)
        argv = codex_argv(
            clients, "Follow the script. " + script_text(steps), AGENT_MODEL, "-s", "workspace-write"
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
    assert (work / "done.txt").read_text() == "done\n"  # the sandbox let it write in its folder

    assert [(e.route, e.status) for e in recorder.exchanges] == [("/v1/responses", 200)] * (
        len(steps) + len(sub)
    )
    main_id = recorder.exchanges[0].headers["thread-id"]
    child = [e for e in recorder.exchanges if e.headers.get("x-codex-parent-thread-id") == main_id]
    assert len(child) == len(sub)
    child_id = child[0].headers["thread-id"]
    sessions = recorder.sessions()
    assert set(sessions) == {main_id, child_id}
    main = sessions[main_id]
    assert len(main) == len(steps) and sessions[child_id] == child
    assert main[-1].state is not None and main[-1].state["turns"] == len(steps)
    assert main[-1].state["children"] == [child_id]
    assert child[-1].state is not None and child[-1].state["turns"] == len(sub)
    assert child[-1].state["parent_session_id"] == main_id

    renderer = Renderer(tiny_llama)
    checks = check_session("codex", main, renderer) + check_session("codex subagent", child, renderer)
    assert all(c.pinned_during_gap for c in checks), checks
