"""The Messages converter gives what vLLM 0.32's own conversion gives (vLLM run in the test as the
oracle), for captured Claude Code requests and synthetic tool conversations; bad input is a 400
naming the field, for input vLLM rejects too."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.api.errors import to_api_error
from gateway.errors import BadRequest
from gateway.wire.anthropic import CLOCK_ID_PLACEHOLDER, parse_messages, requires_system_first
from tests.wire.oracle import template_view, vllm_messages

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "captures"
CLAUDE_CAPTURES = sorted(CAPTURES.glob("claude_code_*.json"))

READ_TOOL = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
GREP_TOOL = {"name": "Grep", "input_schema": {"properties": {"pattern": {"type": "string"}}}, "strict": True}
LATE_TOOL = {
    "name": "Late",
    "description": "deferred",
    "input_schema": {"type": "object"},
    "defer_loading": True,
}


def conversation() -> dict[str, Any]:
    """Three turns of a coding agent: tool calls, tool results (text, parts, an error), thinking,
    inline system reminders, empty blocks and a billing header."""
    return copy.deepcopy(_CONVERSATION)


_CONVERSATION: dict[str, Any] = {
    "model": "tiny-llama",
    "max_tokens": 256,
    "stream": True,
    "system": [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.328.b7f; cc_entrypoint=sdk-cli;",
        },
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "\nBe brief."},
    ],
    "tools": [READ_TOOL, GREP_TOOL, LATE_TOOL],
    "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s-1"})},
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>git status</system-reminder>"},
                {"type": "text", "text": "Fix the test."},
            ],
        },
        {"role": "system", "content": "Today's date is 2026-12-01."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.py", "n": [1, 2]}},
                {"type": "tool_use", "id": "toolu_2", "name": "Grep", "input": {"pattern": "é"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print('hi')"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "is_error": True,
                    "content": [{"type": "text", "text": "no match"}, {"type": "text", "text": "exit 1"}],
                },
                {"type": "text", "text": ""},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need to edit.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "toolu_3", "name": "Read", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_3",
                    "content": [
                        {"type": "text", "text": "x = 1"},
                        {"type": "tool_reference", "tool_name": "Late"},
                    ],
                },
                {"type": "text", "text": "Now run it.", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {
            "role": "system",
            "content": [{"type": "text", "text": "<system-reminder>tokens left</system-reminder>"}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "odd"}]}
            ],
        },
        {"role": "user", "content": "Thanks."},
    ],
}


def variants() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, body, converter options)."""
    base = conversation()
    out: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("conversation", base, {}),
        ("conversation, inline system merged", base, {"merge_inline_system": True}),
    ]
    for choice in (
        {"type": "auto"},
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "none"},
        {"type": "tool", "name": "Read"},
    ):
        out.append((f"tool_choice {choice['type']}", {**base, "tool_choice": choice}, {}))
    out.append(("no tools", {k: v for k, v in base.items() if k != "tools"}, {}))
    out.append(
        ("thinking disabled", {**base, "thinking": {"type": "disabled"}}, {"disabled_thinking_effort": "low"})
    )
    out.append(
        (
            "effort",
            {
                **base,
                "output_config": {"effort": "high"},
                "thinking": {"type": "adaptive", "display": "omitted"},
            },
            {},
        )
    )
    out.append(
        (
            "effort then disabled",
            {**base, "output_config": {"effort": "max"}, "thinking": {"type": "disabled"}},
            {},
        )
    )
    out.append(
        (
            "thinking enabled",
            {**base, "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
            {},
        )
    )
    out.append(
        (
            "kwargs and salt",
            {**base, "chat_template_kwargs": {"enable_thinking": False}, "cache_salt": "salt"},
            {},
        )
    )
    out.append(("string system", {**base, "system": "Plain system."}, {"merge_inline_system": True}))
    out.append(("empty system", {**base, "system": []}, {}))
    changes = copy.deepcopy(base)
    changes["messages"].insert(
        1,
        {
            "role": "system",
            "content": [
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Grep"}},
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Late"}},
                {
                    "type": "tool_addition",
                    "tool": {
                        "type": "tool_definition",
                        "definition": {
                            "name": "Bash",
                            "description": "run",
                            "input_schema": {"type": "object"},
                        },
                    },
                },
                {
                    "type": "tool_addition",
                    "tool": {
                        "type": "tool_definition",
                        "definition": {"name": "Read", "input_schema": {"type": "object", "properties": {}}},
                    },
                },
            ],
        },
    )
    out.append(("tool changes", changes, {}))
    image = copy.deepcopy(base)
    image["messages"][0]["content"].append(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    )
    image["messages"][3]["content"][0]["content"] = [
        {"type": "text", "text": "see"},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
    ]
    out.append(("images", image, {}))
    return out


def assert_same(body: dict[str, Any], **options: Any) -> None:
    mine = parse_messages(copy.deepcopy(body), **options)
    theirs = vllm_messages(body, **options)
    assert json.loads(template_view(mine.chat)) == json.loads(template_view(theirs))
    assert template_view(mine.chat) == template_view(theirs)  # tools and tool calls in vLLM's key order


@pytest.mark.parametrize("path", CLAUDE_CAPTURES, ids=[p.stem for p in CLAUDE_CAPTURES])
@pytest.mark.parametrize("merge", [False, True])
def test_claude_code_captures_convert_like_vllm(path: Path, merge: bool) -> None:
    capture = json.loads(path.read_text())
    assert capture["path"] == "/v1/messages"
    assert_same(capture["body"], merge_inline_system=merge)
    wp = parse_messages(capture["body"], merge_inline_system=merge)
    assert wp.exact and wp.stream and wp.model == "tiny-llama" and wp.api == "messages"
    assert len(wp.chat["tools"]) == len(capture["body"]["tools"])


def test_captures_exist() -> None:
    assert len(CLAUDE_CAPTURES) == 5  # two turns; a compaction, resumed; a turn resumed


@pytest.mark.parametrize(("name", "body", "options"), variants(), ids=[v[0] for v in variants()])
def test_synthetic_conversations_convert_like_vllm(
    name: str, body: dict[str, Any], options: dict[str, Any]
) -> None:
    assert_same(body, **options)


def test_count_tokens_converts_like_vllm() -> None:
    body = {k: v for k, v in conversation().items() if k not in ("max_tokens", "stream", "metadata")}
    assert_same(body, count_tokens=True)
    wp = parse_messages(body, count_tokens=True)
    assert wp.api == "count_tokens" and not wp.stream


def test_conversion_details() -> None:
    wp = parse_messages(conversation())
    msgs = wp.chat["messages"]
    assert msgs[0] == {"role": "system", "content": "You are an agent.\nBe brief."}
    assert msgs[2] == {"role": "system", "content": "Today's date is 2026-12-01."}
    assert msgs[3]["tool_calls"][0]["function"] == {
        "name": "Read",
        "arguments": '{"path": "a.py", "n": [1, 2]}',
    }
    assert msgs[4] == {"role": "tool", "tool_call_id": "toolu_1", "content": "print('hi')"}
    assert wp.chat["tool_choice"] == "auto"
    assert wp.chat["tools"][1]["function"]["parameters"]["type"] == "object"  # defaulted
    assert wp.exact and wp.text_chars > 0


def test_images_are_not_exact() -> None:
    _, body, _ = next(v for v in variants() if v[0] == "images")
    wp = parse_messages(body)
    assert not wp.exact and wp.inexact_reason == "image content"


def test_tool_use_without_id_is_not_exact() -> None:
    body = conversation()
    del body["messages"][2]["content"][1]["id"]
    wp = parse_messages(body)
    assert not wp.exact and "clock" in (wp.inexact_reason or "")
    theirs = vllm_messages(body)
    # vLLM makes the id from its clock: all else agrees
    their_id = theirs["messages"][3]["tool_calls"][0]["id"]
    assert their_id.startswith("call_")
    assert wp.chat["messages"][3]["tool_calls"][0]["id"] == CLOCK_ID_PLACEHOLDER
    wp.chat["messages"][3]["tool_calls"][0]["id"] = their_id
    assert template_view(wp.chat) == template_view(theirs)


def test_requires_system_first() -> None:
    strict = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('x') }}{% endif %}{{ m.content }}{% endfor %}"
    assert requires_system_first(None)
    assert requires_system_first(strict)
    assert not requires_system_first("{% for m in messages %}{{ m.content }}{% endfor %}")


def _with(path: str, value: Any) -> dict[str, Any]:
    """conversation() with the value at dotted ``path`` replaced (``...DEL`` removes it)."""
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


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no model", _with("model", "...DEL"), "model"),
    ("model number", _with("model", 3), "model"),
    ("empty model", _with("model", ""), "model"),
    ("no max_tokens", _with("max_tokens", "...DEL"), "max_tokens"),
    ("max_tokens zero", _with("max_tokens", 0), "max_tokens"),
    ("max_tokens text", _with("max_tokens", "many"), "max_tokens"),
    ("no messages", _with("messages", "...DEL"), "messages"),
    ("messages object", _with("messages", {}), "messages"),
    ("message not object", _with("messages.1", "hi"), "messages[1]"),
    ("bad role", _with("messages.0.role", "tool"), "messages[0].role"),
    ("no content", _with("messages.0.content", "...DEL"), "messages[0].content"),
    ("content number", _with("messages.0.content", 7), "messages[0].content"),
    ("block type", _with("messages.2.content.1.type", "video"), "messages[2].content[1].type"),
    ("block no type", _with("messages.2.content.1.type", "...DEL"), "messages[2].content[1].type"),
    ("text not string", _with("messages.0.content.0.text", 5), "messages[0].content[0].text"),
    ("input not object", _with("messages.2.content.1.input", [1]), "messages[2].content[1].input"),
    ("tool_result content", _with("messages.3.content.0.content", 3), "messages[3].content[0].content"),
    ("is_error", _with("messages.3.content.1.is_error", "nope"), "messages[3].content[1].is_error"),
    ("stream", _with("stream", "maybe"), "stream"),
    ("system number", _with("system", 1), "system"),
    ("system block", _with("system.1.type", "image_url"), "system[1].type"),
    ("tools object", _with("tools", {}), "tools"),
    ("tool name", _with("tools.0.name", "...DEL"), "tools[0].name"),
    ("tool schema", _with("tools.0.input_schema", "...DEL"), "tools[0].input_schema"),
    ("tool schema list", _with("tools.1.input_schema", []), "tools[1].input_schema"),
    ("tool strict", _with("tools.1.strict", "sure"), "tools[1].strict"),
    ("max_tokens fraction", _with("max_tokens", 2.5), "max_tokens"),
    ("tool_choice type", {**conversation(), "tool_choice": {"type": "some"}}, "tool_choice.type"),
    ("tool_choice name", {**conversation(), "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ("thinking type", {**conversation(), "thinking": {"type": "on"}}, "thinking.type"),
    (
        "thinking budget",
        {**conversation(), "thinking": {"type": "enabled", "budget_tokens": 10}},
        "thinking.budget_tokens",
    ),
    (
        "thinking budget > max",
        {**conversation(), "thinking": {"type": "enabled", "budget_tokens": 4096}},
        "thinking.budget_tokens",
    ),
    ("effort", {**conversation(), "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ("cache_salt empty", {**conversation(), "cache_salt": ""}, "cache_salt"),
    ("kwargs", {**conversation(), "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("stop", {**conversation(), "stop_sequences": [1]}, "stop_sequences[0]"),
    (
        "tool change outside system",
        _with(
            "messages.0.content.0",
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Read"}},
        ),
        "messages[0].content[0].type",
    ),
    (
        "tool change without tool",
        _with("messages.1.content", [{"type": "tool_addition"}]),
        "messages[1].content[0].tool",
    ),
    (
        "removal by definition",
        _with(
            "messages.1.content",
            [{"type": "tool_removal", "tool": {"type": "tool_definition", "definition": READ_TOOL}}],
        ),
        "messages[1].content[0].tool.type",
    ),
    (
        "unknown tool reference",
        _with(
            "messages.1.content",
            [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Nope"}}],
        ),
        "messages[1].content[0].tool.name",
    ),
]


@pytest.mark.parametrize(("name", "body", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_field(name: str, body: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_messages(body)
    assert to_api_error(err.value).status == 400
    assert err.value.field == field
    assert field in err.value.message
    with pytest.raises(Exception):  # noqa: B017 - vLLM refuses it too (pydantic or its converter)
        vllm_messages(body)


def test_body_must_be_an_object() -> None:
    with pytest.raises(BadRequest) as err:
        parse_messages([])  # type: ignore[arg-type]
    assert to_api_error(err.value).status == 400


def test_lax_values_read_as_vllm_reads_them() -> None:
    body = {**conversation(), "stream": "true", "max_tokens": "64"}
    body["tools"][1]["strict"] = "yes"
    assert_same(body)
    assert parse_messages(body).stream is True
