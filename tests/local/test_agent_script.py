"""Agent scripts (what the scripted decoder says next), on conversations rendered by the tiny
models' own chat template, as vLLM renders them for the engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.analysis.chat_render import ChatRenderer
from gateway.local.agent_script import (
    DONE_TEXT,
    NOT_FOUND,
    ScriptError,
    Step,
    find_script,
    messages,
    next_output,
    parse_script,
    script_text,
    tool_call_text,
)
from gateway.local.tiny_model import SPECIAL_TOKENS, chat_template

# the gateway's renderer of chat bodies (equal to vLLM's: tests/gateway/test_tokenize_vllm_e2e.py)
RENDERER = ChatRenderer(chat_template(), {"eos_token": SPECIAL_TOKENS[2]})


def render(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    body: dict[str, Any] = {"model": "tiny-agent", "messages": msgs}
    if tools:
        body["tools"] = tools
    return RENDERER.render(body)


def call(name: str, args: dict[str, Any], text: str | None = None) -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args)}
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": [{"id": "c", "type": "function", "function": fn}],
    }


SUB = script_text([Step(tool="Bash", args={"command": "cat sub.txt"}), Step(say="sub {{find:SUB-[0-9]+}}")])
STEPS = [
    Step(tool="Bash", args={"command": "sleep 1 && ls"}),
    Step(tool="Read", args={"file_path": "/w/notes.txt"}, text="Reading the notes."),
    Step(tool="Agent", args={"prompt": SUB, "run_in_background": False}),
    Step(tool="wait", args={"targets": ['{{find:"agent_id":\\s*"([^"]+)"}}']}),
    Step(say="The marker is {{find:MARKER-[0-9a-f]+}}."),
]
TASK = {"role": "user", "content": "Follow the script. " + script_text(STEPS)}
SYSTEM = {"role": "system", "content": "You are a coding agent. AGENT-SCRIPT is a word here."}
TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]


def test_each_tool_result_moves_the_conversation_one_step() -> None:
    history: list[dict[str, Any]] = [SYSTEM, TASK]
    said = []
    results = ["a.txt\nnotes.txt", "1\tthe marker: MARKER-5eed1234", '{"agent_id":"th-7"}', "sub SUB-1"]
    for result in results:
        out = next_output(render(history, TOOLS))
        assert out is not None
        said.append(out)
        body = json.loads(out[out.index("{") : out.rindex("}") + 1])
        history += [call(body["name"], body["arguments"]), {"role": "tool", "content": result}]
    said.append(next_output(render(history, TOOLS)))  # type: ignore[arg-type]
    assert said[0] == tool_call_text("Bash", {"command": "sleep 1 && ls"})
    assert said[1] == "Reading the notes.\n" + tool_call_text("Read", {"file_path": "/w/notes.txt"})
    # a subagent's script goes to it untouched (its {{find:...}} is its own conversation's)
    assert said[2] == tool_call_text("Agent", {"prompt": SUB, "run_in_background": False})
    # an argument filled from what a tool returned (a subagent's id)
    assert said[3] == tool_call_text("wait", {"targets": ["th-7"]})
    assert said[4] == "The marker is MARKER-5eed1234."
    # past the last step, and with nothing to find
    history += [{"role": "assistant", "content": said[4]}, {"role": "user", "content": "and?"}]
    assert next_output(render(history)) == DONE_TEXT


def test_the_subagent_follows_the_script_of_its_own_task() -> None:
    child = [SYSTEM, {"role": "user", "content": SUB}]
    assert next_output(render(child)) == tool_call_text("Bash", {"command": "cat sub.txt"})
    child += [call("Bash", {"command": "cat sub.txt"}), {"role": "tool", "content": "SUB-42\n"}]
    assert next_output(render(child)) == "sub SUB-42"
    # a child that starts from its parent's history (Codex's fork_context) reads the last script
    forked = [
        SYSTEM,
        TASK,
        call("Bash", {}),
        {"role": "tool", "content": "x"},
        {"role": "user", "content": SUB},
    ]
    assert next_output(render(forked)) == tool_call_text("Bash", {"command": "cat sub.txt"})


def test_a_marker_that_no_tool_returned_is_not_found() -> None:
    history = [TASK]
    for _ in range(4):
        history += [call("Bash", {}), {"role": "tool", "content": "nothing here"}]
    assert next_output(render(history)) == f"The marker is {NOT_FOUND}."


def test_no_script_leaves_the_request_alone() -> None:
    assert next_output(render([SYSTEM, {"role": "user", "content": "say hello"}])) is None
    # the word alone, or a script in a tool's output or the system prompt, is not a task
    assert next_output(render([{"role": "user", "content": "AGENT-SCRIPT {broken"}])) is None
    tool_says = [{"role": "user", "content": "hi"}, call("Bash", {}), {"role": "tool", "content": SUB}]
    assert next_output(render(tool_says)) is None
    assert next_output(render([{"role": "system", "content": SUB}, {"role": "user", "content": "x"}])) is None


def test_messages_split_a_chatml_prompt_and_drop_the_open_generation_prompt() -> None:
    got = messages(render([SYSTEM, TASK], TOOLS))
    assert [m.role for m in got] == ["system", "system", "user"]
    assert got[2].content == TASK["content"]
    assert find_script(got) == (2, STEPS)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("AGENT-SCRIPT []", "steps"),
        ('AGENT-SCRIPT {"steps": []}', "at least one step"),
        ('AGENT-SCRIPT {"steps": [{"tool": "x", "say": "y"}]}', "one of them"),
        ('AGENT-SCRIPT {"steps": [{}]}', "one of them"),
        ('AGENT-SCRIPT {"steps": [{"tool": "x", "args": []}]}', "args must be an object"),
        ('AGENT-SCRIPT {"steps": [{"tool": "x", "wait": 1}]}', "unknown step keys"),
        ('AGENT-SCRIPT {"steps": [{"say": "a"}, {"tool": "x"}]}', "only the last step"),
        ("AGENT-SCRIPT {", "not JSON"),
    ],
)
def test_bad_scripts_are_refused_with_the_reason(text: str, error: str) -> None:
    with pytest.raises(ScriptError, match=error):
        parse_script(text, 0)


def test_script_text_round_trips() -> None:
    text = "x " + script_text(STEPS) + " trailing words"
    assert parse_script(text, 2) == STEPS
