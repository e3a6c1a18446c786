"""vLLM 0.32's own conversions, run in-process: the oracle the wire converters are compared with."""

from __future__ import annotations

import copy
import json
from typing import Any

# Keys of a chat message that vLLM's ``parse_chat_messages`` reads; others never reach a template.
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "reasoning", "name", "task")


def _tool_choice(tc: Any) -> Any:
    return tc if tc is None or isinstance(tc, str | dict) else tc.model_dump()


def _chat_view(messages: list[Any], tools: Any, **rest: Any) -> dict[str, Any]:
    return {"messages": [dict(m) for m in messages], "tools": tools, **rest}


def vllm_messages(
    body: dict[str, Any],
    *,
    count_tokens: bool = False,
    merge_inline_system: bool = False,
    disabled_thinking_effort: str = "none",
) -> dict[str, Any]:
    """What ``AnthropicServingMessages.to_chat_completion_request`` makes of ``body``."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    cls = AnthropicCountTokensRequest if count_tokens else AnthropicMessagesRequest
    req = cls.model_validate(copy.deepcopy(body))
    chat = AnthropicServingMessages.to_chat_completion_request(
        req,
        merge_inline_system=merge_inline_system,
        disabled_thinking_effort=disabled_thinking_effort,  # type: ignore[arg-type]
    )
    return _chat_view(
        chat.messages,
        None if chat.tools is None else [t.model_dump() for t in chat.tools],
        tool_choice=_tool_choice(chat.tool_choice),
        chat_template_kwargs=chat.chat_template_kwargs,
        reasoning_effort=chat.reasoning_effort,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        cache_salt=chat.cache_salt,
    )


def vllm_responses(
    body: dict[str, Any], *, exclude_tools_when_tool_choice_none: bool = False
) -> dict[str, Any]:
    """What vLLM's ``construct_input_messages`` / ``construct_tool_dicts`` and
    ``ResponsesRequest.build_chat_params`` make of ``body`` (no stored history)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    req = ResponsesRequest.model_validate(copy.deepcopy(body))
    messages = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
    tools = construct_tool_dicts(
        req.tools, req.tool_choice, exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none
    )
    params = req.build_chat_params(None, "auto").chat_template_kwargs
    return _chat_view(
        messages,
        tools,
        tool_choice=_tool_choice(req.tool_choice),
        chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=None if req.reasoning is None else req.reasoning.effort,
        add_generation_prompt=params["add_generation_prompt"],
        continue_final_message=params["continue_final_message"],
        cache_salt=req.cache_salt,
    )


def _view_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: m[k] for k in MESSAGE_KEYS if k in m}
    if isinstance(out.get("content"), list):
        # vLLM's parse_chat_messages rebuilds each part: the order of a part's keys is lost there
        out["content"] = [dict(sorted(p.items())) if isinstance(p, dict) else p for p in out["content"]]
    return out


def template_view(chat: dict[str, Any]) -> str:
    """``chat`` as the chat template can see it, as canonical text: per message only the keys
    vLLM reads, and content parts with sorted keys (vLLM rebuilds messages and parts, so their key
    order never reaches a template); tool calls and tools compared in order, as a template that
    dumps them with ``tojson`` sees them."""
    messages = [_view_message(dict(m)) for m in chat["messages"]]
    return json.dumps({**chat, "messages": messages}, default=str)
