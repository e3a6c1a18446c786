"""Agent scripts: what the scripted decoder (`gateway/local/scripted_decoder.py`) makes the tiny
model say, step by step, so a real harness runs a real agent loop against random weights.

A script is a JSON object after the word `AGENT-SCRIPT` in a user message of the conversation:

    AGENT-SCRIPT {"steps": [
      {"tool": "Bash", "args": {"command": "sleep 2 && ls"}},
      {"tool": "Read", "args": {"file_path": "/tmp/work/notes.txt"}},
      {"say": "The marker is {{find:MARKER-[0-9a-f]+}}."}]}

Each step is one assistant turn: a tool call (`tool`, `args`; optional `text` said before it) or
an answer (`say`). The step the conversation is at is the number of tool calls the assistant made
after the message that holds the script: the harness sends each tool's result back and asks
again, and the next step comes out. Once the answer is in the conversation (an assistant message
after the last tool call), or past the last step, the answer is `DONE_TEXT`. Strings in
`args` and `say` may hold `{{find:REGEX}}`: the last match of REGEX (its first group, when it has
one) in the conversation after the script, i.e. in what the tools returned; `NOT_FOUND` when
nothing matches (a string that holds a script, a subagent's task, is left as it is: its own
conversation fills it). So an answer can quote a marker that only a file read by a tool contains, and a
call can name an id that an earlier tool returned (a subagent's id).

The script in force is the one in the LAST user message that holds one: a subagent's task (the
`prompt` of Claude Code's `Agent`, the `message` of Codex's `spawn_agent`) carries its own
script, JSON-escaped inside the parent's; the child sees it as its own user message.

The conversation is read from the prompt as the tiny models' ChatML template renders it
(`<|im_start|>role\\n...<|im_end|>`, tool calls as `<tool_call>` JSON: vLLM's `hermes` tool
parser reads them back). Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AGENT_MODEL",
    "DONE_TEXT",
    "NOT_FOUND",
    "SCRIPTED_DECODER",
    "SENTINEL",
    "Message",
    "ScriptError",
    "Step",
    "find_script",
    "messages",
    "next_output",
    "script_text",
    "tool_call_text",
]

SENTINEL = "AGENT-SCRIPT"
SCRIPTED_DECODER = "gateway.local.scripted_decoder:ScriptedDecoder"
"""vLLM's `--logits-processors` value that loads the scripted decoder into an engine."""
AGENT_MODEL = "tiny-agent"
"""The name local engines serve scripted agent sessions under, beside the tiny model's own: the
same engine and weights; the name tells a user's (and the dashboard's) scripted traffic apart."""
DONE_TEXT = "Done."
NOT_FOUND = "NOT-FOUND"
_START = "<|im_start|>"
_END = "<|im_end|>"
_CALL = "<tool_call>"
_FIND = re.compile(r"\{\{find:(.+?)\}\}")
_DECODER = json.JSONDecoder()


class ScriptError(ValueError):
    """A script that does not parse: the decoder then leaves the request alone."""


@dataclass(frozen=True)
class Step:
    tool: str | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    say: str | None = None
    text: str = ""

    def __post_init__(self) -> None:
        if (self.tool is None) == (self.say is None):
            raise ScriptError(f"a step is a tool call or an answer, one of them: {self}")

    def as_json(self) -> dict[str, Any]:
        if self.tool is not None:
            out: dict[str, Any] = {"tool": self.tool, "args": dict(self.args)}
            if self.text:
                out["text"] = self.text
            return out
        return {"say": self.say}


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def script_text(steps: Sequence[Step]) -> str:
    """The script as it goes in a prompt (`AGENT-SCRIPT {...}`)."""
    return f"{SENTINEL} " + json.dumps({"steps": [s.as_json() for s in steps]}, ensure_ascii=False)


def _step(raw: Any) -> Step:
    if not isinstance(raw, dict):
        raise ScriptError(f"a step must be an object, got {raw!r}")
    unknown = set(raw) - {"tool", "args", "say", "text"}
    if unknown:
        raise ScriptError(f"unknown step keys {sorted(unknown)}")
    args = raw.get("args", {})
    if not isinstance(args, dict):
        raise ScriptError(f"a step's args must be an object, got {args!r}")
    tool, say, text = raw.get("tool"), raw.get("say"), raw.get("text", "")
    if not (tool is None or isinstance(tool, str)) or not (say is None or isinstance(say, str)):
        raise ScriptError(f"tool and say must be strings: {raw!r}")
    if not isinstance(text, str):
        raise ScriptError(f"text must be a string: {raw!r}")
    return Step(tool=tool, args=args, say=say, text=text)


def parse_script(text: str, at: int) -> list[Step]:
    """The script whose sentinel starts at `at` in `text`."""
    start = at + len(SENTINEL)
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        doc, _ = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"the script is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list) or not doc["steps"]:
        raise ScriptError('a script is {"steps": [...]} with at least one step')
    steps = [_step(s) for s in doc["steps"]]
    if any(s.say is not None for s in steps[:-1]):
        raise ScriptError("an answer ends the task: only the last step may be a `say`")
    return steps


def messages(rendered: str) -> list[Message]:
    """The messages of a ChatML prompt, the open generation prompt at its end left out."""
    out = []
    for chunk in rendered.split(_START)[1:]:
        role, _, rest = chunk.partition("\n")
        content, closed, _ = rest.partition(_END)
        if closed:
            out.append(Message(role.strip(), content))
    return out


def find_script(msgs: Sequence[Message]) -> tuple[int, list[Step]] | None:
    """(index of the message that holds the script in force, its steps), or None."""
    for i in range(len(msgs) - 1, -1, -1):
        m = msgs[i]
        if m.role != "user":
            continue
        at = m.content.rfind(SENTINEL)
        while at >= 0:
            try:
                return i, parse_script(m.content, at)
            except ScriptError:
                at = m.content.rfind(SENTINEL, 0, at)
    return None


def _fill(value: Any, after: str) -> Any:
    if isinstance(value, str) and SENTINEL in value:
        return value  # a subagent's script: filled in the subagent's own conversation
    if isinstance(value, str):

        def one(match: re.Match[str]) -> str:
            try:
                found = list(re.finditer(match.group(1), after))
            except re.error:
                return NOT_FOUND
            if not found:
                return NOT_FOUND
            last = found[-1]
            return last.group(1) if last.re.groups else last.group(0)

        return _FIND.sub(one, value)
    if isinstance(value, dict):
        return {k: _fill(v, after) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, after) for v in value]
    return value


def tool_call_text(name: str, args: Mapping[str, Any]) -> str:
    """A tool call as the `hermes` parser reads it (and the tiny template renders it back)."""
    call = json.dumps({"name": name, "arguments": dict(args)}, ensure_ascii=False)
    return f"{_CALL}\n{call}\n</tool_call>"


def next_output(rendered: str) -> str | None:
    """What the assistant says next in the conversation `rendered`, or None without a script."""
    msgs = messages(rendered)
    found = find_script(msgs)
    if found is None:
        return None
    at, steps = found
    later = msgs[at + 1 :]
    calls = [i for i, m in enumerate(later) if m.role == "assistant" and _CALL in m.content]
    done = sum(later[i].content.count(_CALL) for i in calls)
    answered = any(m.role == "assistant" for m in later[calls[-1] + 1 if calls else 0 :])
    if done >= len(steps) or (steps[done].say is not None and answered):
        return DONE_TEXT
    step = steps[done]
    after = "\n".join(m.content for m in later)
    if step.say is not None:
        return str(_fill(step.say, after))
    assert step.tool is not None
    call = tool_call_text(step.tool, _fill(dict(step.args), after))
    return f"{step.text}\n{call}" if step.text else call
