"""Template kwargs equal vLLM 0.32's ``build_chat_params`` for chat bodies and for the converted
Messages and Responses requests; the engine probes (inline system merge, disabled-thinking effort)
decide as vLLM's do."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.local.tiny_model import chat_template
from gateway.wire.anthropic import parse_messages, probe_disabled_thinking_effort, requires_system_first
from gateway.wire.chat_params import chat_template_kwargs, chat_tools, merge_kwargs
from gateway.wire.responses import parse_responses
from tests.wire.test_anthropic import conversation as anthropic_conversation
from tests.wire.test_responses import conversation as responses_conversation

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_BODIES: list[dict[str, Any]] = [
    {},
    {"reasoning_effort": "high"},
    {"reasoning_effort": "none"},
    {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False, "x": 1}},
    {"chat_template_kwargs": {"add_generation_prompt": False, "custom": None}},
    {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [*MESSAGES, {"role": "assistant", "content": "par"}],
    },
    {"documents": [{"title": "t", "text": "d"}]},
]


def _vllm_chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **copy.deepcopy(body)})
    return req.build_chat_params(None, "auto").chat_template_kwargs


@pytest.mark.parametrize("body", CHAT_BODIES, ids=[str(b) for b in CHAT_BODIES])
def test_chat_bodies(body: dict[str, Any]) -> None:
    assert chat_template_kwargs(body) == _vllm_chat_kwargs(body)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"thinking": {"type": "disabled"}},
        {"output_config": {"effort": "medium"}},
        {"chat_template_kwargs": {"enable_thinking": True}, "output_config": {"effort": "low"}},
    ],
    ids=str,
)
def test_messages_requests(extra: dict[str, Any]) -> None:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    body = {**anthropic_conversation(), **extra}
    req = AnthropicServingMessages.to_chat_completion_request(
        AnthropicMessagesRequest.model_validate(copy.deepcopy(body)), disabled_thinking_effort="low"
    )
    theirs = req.build_chat_params(None, "auto").chat_template_kwargs
    assert chat_template_kwargs(parse_messages(body, disabled_thinking_effort="low").chat) == theirs


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"reasoning": {"effort": "high"}},
        {"chat_template_kwargs": {"k": "v"}, "reasoning": {"effort": "none"}},
    ],
    ids=str,
)
def test_responses_requests(extra: dict[str, Any]) -> None:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    body = {**responses_conversation(), **extra}
    theirs = (
        ResponsesRequest.model_validate(copy.deepcopy(body))
        .build_chat_params(None, "auto")
        .chat_template_kwargs
    )
    assert chat_template_kwargs(parse_responses(body).chat) == theirs


def test_partial_responses_message_continues() -> None:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    body = responses_conversation()
    body["input"].append(
        {
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [{"type": "output_text", "text": "Par"}],
        }
    )
    theirs = (
        ResponsesRequest.model_validate(copy.deepcopy(body))
        .build_chat_params(None, "auto")
        .chat_template_kwargs
    )
    mine = chat_template_kwargs(parse_responses(body).chat)
    assert mine == theirs and mine["continue_final_message"] and not mine["add_generation_prompt"]


def test_engine_defaults_go_under_the_request() -> None:
    from vllm.renderers.params import merge_kwargs as vllm_merge

    defaults = {"enable_thinking": False, "a": 1}
    body = {"reasoning_effort": "high", "chat_template_kwargs": {"a": 2, "b": "auto"}}
    assert chat_template_kwargs(body, defaults) == vllm_merge(defaults, _vllm_chat_kwargs(body))
    assert merge_kwargs({"x": 1}, {"x": None, "y": "auto", "z": 0}) == vllm_merge(
        {"x": 1}, {"x": None, "y": "auto", "z": 0}
    )


def test_tiny_template_takes_inline_system_messages() -> None:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    template = chat_template()
    assert requires_system_first(template) is False
    assert AnthropicServingMessages._detect_merge_inline_system(template) is False


def _render_with(template: str) -> Any:
    t = ImmutableSandboxedEnvironment().from_string(template)

    def render(effort: str) -> str | None:
        return t.render(
            messages=[{"role": "user", "content": "Hi"}],
            reasoning_effort=effort,
            enable_thinking=effort != "none",
        )

    return render


def test_disabled_thinking_effort_probe() -> None:
    # the tiny template ignores efforts: "none" renders like "low" -> vLLM picks "low"
    assert probe_disabled_thinking_effort(_render_with(chat_template())) == "low"
    # a template that honours enable_thinking -> "none"
    honours = "{{ messages[0].content }}{% if enable_thinking %}<think>{{ reasoning_effort }}{% endif %}"
    assert probe_disabled_thinking_effort(_render_with(honours)) == "none"
    # a template that refuses "none" -> "low"
    assert probe_disabled_thinking_effort(lambda effort: None if effort == "none" else effort) == "low"


TOOL_LISTS: list[Any] = [
    None,
    [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}, "extra": 1}, "x": 2}],
    [{"function": {"parameters": {"type": "object"}, "name": "g", "description": "d", "strict": True}}],
    [{"type": "function", "defer_loading": True, "function": {"name": "h"}}],
    [
        {
            "type": "function",
            "defer_loading": False,
            "function": {"name": "h", "defer_loading": True, "strict": "yes"},
        }
    ],
]


@pytest.mark.parametrize("tools", TOOL_LISTS, ids=str)
def test_chat_tools_dump_like_vllm(tools: Any) -> None:
    import json

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MESSAGES, "tools": copy.deepcopy(tools)}
    )
    theirs = None if req.tools is None else [t.model_dump() for t in req.tools]
    assert json.dumps(chat_tools(tools)) == json.dumps(theirs)


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ({}, "tools"),
        ([], "tools"),
        ([1], "tools[0]"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"function": {"name": 3}}], "tools[0].function.name"),
        ([{"function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
        ([{"type": "custom", "function": {"name": "f"}}], "tools[0].type"),
    ],
    ids=str,
)
def test_chat_tools_bad_input_names_the_field(tools: Any, field: str) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from gateway.errors import BadRequest

    with pytest.raises(BadRequest) as err:
        chat_tools(tools)
    assert err.value.field == field
    with pytest.raises(Exception):  # noqa: B017 - vLLM refuses it too
        ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "tools": tools})
