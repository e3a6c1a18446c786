"""The Responses converter gives what vLLM 0.32's own conversion gives (vLLM run in the test as the
oracle), for captured Codex requests and synthetic function-call conversations; bad input is a 400
naming the field, for input vLLM rejects too."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.api.errors import to_api_error
from gateway.errors import BadRequest
from gateway.wire.responses import parse_responses
from tests.wire.oracle import template_view, vllm_responses

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "captures"
CODEX_CAPTURES = sorted(CAPTURES.glob("codex_*.json"))

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
_CONVERSATION: dict[str, Any] = {
    "model": "tiny-llama",
    "stream": True,
    "store": False,
    "instructions": "You are Codex.",
    "prompt_cache_key": "thread-1",
    "tools": [
        EXEC,
        {"type": "function", "name": "later", "parameters": {"type": "object"}, "defer_loading": True},
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "description": "Sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn_agent",
                    "description": "Spawn",
                    "strict": True,
                    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
                },
                {"type": "custom", "name": "note", "description": "free text"},
                {"type": "function", "name": "wait_agent", "parameters": {"type": "object"}},
            ],
        },
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch"},
        {"type": "web_search", "external_web_access": False},
    ],
    "input": [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Sandbox: read-only."}],
        },
        {
            "type": "message",
            "role": "user",
            "id": "msg_1",
            "content": [
                {"type": "input_text", "text": "<environment_context>date</environment_context>"},
                {"type": "input_text", "text": "Fix the test."},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look first."}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_2",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Looking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd":"ls"}',
            "status": "completed",
        },
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "spawn_agent",
            "namespace": "multi_agent_v1",
            "arguments": '{"task":"grep"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "agent done"}],
        },
        {
            "type": "custom_tool_call",
            "call_id": "call_3",
            "name": "apply_patch",
            "input": "*** Begin Patch é",
        },
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "patched"},
        {
            "type": "reasoning",
            "id": "rs_2",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Now test."}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        {"role": "assistant", "content": "Plain text reply."},
        {"role": "user", "content": "Thanks."},
    ],
}


def conversation() -> dict[str, Any]:
    return copy.deepcopy(_CONVERSATION)


def _with(path: str, value: Any) -> dict[str, Any]:
    body = conversation()
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    target: Any = body
    for k in keys[:-1]:
        target = target[k]
    if value == "...DEL":
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return body


def variants() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    base = conversation()
    out: list[tuple[str, dict[str, Any], dict[str, Any]]] = [("conversation", base, {})]
    for choice in (
        "auto",
        "none",
        "required",
        {"type": "function", "name": "exec_command"},
        {"type": "function", "name": "wait_agent"},
    ):
        out.append((f"tool_choice {choice}", {**base, "tool_choice": choice}, {}))
    out.append(
        (
            "tool_choice none, tools excluded",
            {**base, "tool_choice": "none"},
            {"exclude_tools_when_tool_choice_none": True},
        )
    )
    out.append(("no tools", {k: v for k, v in base.items() if k != "tools"}, {}))
    out.append(("only non-function tools", {**base, "tools": [{"type": "web_search"}]}, {}))
    out.append(("string input", {**base, "input": "Say hi."}, {}))
    out.append(("no instructions", {k: v for k, v in base.items() if k != "instructions"}, {}))
    out.append(("empty instructions", {**base, "instructions": ""}, {}))
    out.append(("reasoning effort", {**base, "reasoning": {"effort": "low", "summary": "auto"}}, {}))
    out.append(
        (
            "kwargs and salt",
            {**base, "chat_template_kwargs": {"enable_thinking": False}, "cache_salt": "s"},
            {},
        )
    )
    partial = conversation()
    partial["input"].append(
        {
            "type": "message",
            "role": "assistant",
            "status": "incomplete",
            "content": [{"type": "output_text", "text": "Partial"}],
        }
    )
    out.append(("partial assistant message", partial, {}))
    calls_first = conversation()
    calls_first["input"] = [
        calls_first["input"][1],
        calls_first["input"][4],
        calls_first["input"][2],
        calls_first["input"][3],
        calls_first["input"][6],
    ]
    out.append(("call, then reasoning and text join it", calls_first, {}))
    out.append(("tool output without call_id", _with("input.6.call_id", "...DEL"), {}))
    return out


def assert_same(body: dict[str, Any], **options: Any) -> None:
    mine = parse_responses(copy.deepcopy(body), **options)
    theirs = vllm_responses(body, **options)
    assert json.loads(template_view(mine.chat)) == json.loads(template_view(theirs))
    assert template_view(mine.chat) == template_view(theirs)


@pytest.mark.parametrize("path", CODEX_CAPTURES, ids=[p.stem for p in CODEX_CAPTURES])
def test_codex_captures_convert_like_vllm(path: Path) -> None:
    capture = json.loads(path.read_text())
    assert capture["path"] == "/v1/responses"
    assert_same(capture["body"])
    wp = parse_responses(capture["body"])
    assert wp.exact and wp.stream and wp.model == "tiny-llama" and wp.api == "responses"
    assert wp.store is False and wp.previous_response_id is None


def test_captures_exist() -> None:
    assert len(CODEX_CAPTURES) == 2


@pytest.mark.parametrize(("name", "body", "options"), variants(), ids=[v[0] for v in variants()])
def test_synthetic_conversations_convert_like_vllm(
    name: str, body: dict[str, Any], options: dict[str, Any]
) -> None:
    assert_same(body, **options)


def test_conversion_details() -> None:
    wp = parse_responses(conversation())
    msgs = wp.chat["messages"]
    assert msgs[0] == {"role": "system", "content": "You are Codex."}
    assistant = msgs[3]
    assert assistant["reasoning"] == "Look first." and assistant["content"] == "Looking."
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == [
        "exec_command",
        "multi_agent_v1__spawn_agent",
    ]
    names = [t["function"]["name"] for t in wp.chat["tools"]]
    assert names == [
        "exec_command",
        "later",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__wait_agent",
        "apply_patch",
    ]
    assert wp.store is False and wp.exact


def test_previous_response_id_is_not_exact() -> None:
    body = {**conversation(), "previous_response_id": "resp_1", "store": True}
    wp = parse_responses(body)
    assert not wp.exact and wp.previous_response_id == "resp_1" and wp.store
    assert "previous_response_id" in (wp.inexact_reason or "")
    # this request's own part is what vLLM builds from it before the stored history is added
    body.pop("previous_response_id")
    assert template_view(wp.chat) == template_view(vllm_responses(body))


def test_store_defaults_to_true_and_model_may_be_absent() -> None:
    wp = parse_responses({"input": "hi"})
    assert wp.store is True and wp.model is None and not wp.stream


def test_images_are_not_exact() -> None:
    body = conversation()
    body["input"][1]["content"].append({"type": "input_image", "image_url": "data:image/png;base64,AAAA"})
    wp = parse_responses(body)
    assert not wp.exact and wp.inexact_reason == "image or file content"


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no input", _with("input", "...DEL"), "input"),
    ("input number", _with("input", 5), "input"),
    ("item not object", _with("input.0", "hi"), "input[0]"),
    ("call without call_id", _with("input.4.call_id", "...DEL"), "input[4].call_id"),
    ("call without name", _with("input.4.name", "...DEL"), "input[4].name"),
    ("call arguments object", _with("input.4.arguments", {"cmd": "ls"}), "input[4].arguments"),
    ("output call_id number", _with("input.6.call_id", 6), "input[6].call_id"),
    ("unsupported item", _with("input.2", {"type": "teleport"}), "input[2].type"),
    ("bad role", _with("input.0.role", "robot"), "input[0].role"),
    ("encrypted reasoning", _with("input.2.encrypted_content", "gAAA"), "input[2].encrypted_content"),
    ("model number", _with("model", 1), "model"),
    ("stream", _with("stream", "maybe"), "stream"),
    ("store", _with("store", "often"), "store"),
    ("instructions list", _with("instructions", ["a"]), "instructions"),
    ("tools object", _with("tools", {}), "tools"),
    ("tool without name", _with("tools.0.name", "...DEL"), "tools[0].name"),
    ("tool parameters list", _with("tools.0.parameters", [1]), "tools[0].parameters"),
    ("namespace without tools", _with("tools.2.tools", "...DEL"), "tools[2].tools"),
    ("tool_choice word", _with("tool_choice", "sometimes"), "tool_choice"),
    ("required without tools", {**_with("tools", "...DEL"), "tool_choice": "required"}, "tool_choice"),
    ("named, not in tools", _with("tool_choice", {"type": "function", "name": "nope"}), "tool_choice.name"),
    ("prompt template", _with("prompt", {"id": "p"}), "prompt"),
    ("background without store", {**conversation(), "background": True}, "background"),
    ("kwargs", _with("chat_template_kwargs", "x"), "chat_template_kwargs"),
]


@pytest.mark.parametrize(("name", "body", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_field(name: str, body: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_responses(body)
    assert to_api_error(err.value).status == 400
    assert err.value.field == field
    assert field in err.value.message
    with pytest.raises(Exception):  # noqa: B017 - vLLM refuses it too (pydantic or its converter)
        vllm_responses(body)
