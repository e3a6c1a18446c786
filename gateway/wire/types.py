"""The value every wire converter returns: an API request reduced to routing fields and the
Chat-Completions-shaped fields that decide the engine's prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

WireApi = Literal["messages", "count_tokens", "responses"]


@dataclass(frozen=True, slots=True)
class WirePrompt:
    """A ``/v1/messages`` (Anthropic) or ``/v1/responses`` (OpenAI) request, parsed once.

    ``chat`` holds the fields of the Chat Completions request vLLM 0.32 builds internally for the
    same request, with the names and value shapes of ``ChatCompletionRequest`` after its pydantic
    validation: ``messages`` (list of message dicts, tool-call ``arguments`` still JSON strings),
    ``tools`` (``None`` or the list vLLM hands the chat template: each tool already dumped through
    vLLM's pydantic models), ``tool_choice`` (``None``, ``"auto"``, ``"none"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``), ``chat_template_kwargs`` (``None`` or
    the request's own dict), ``reasoning_effort`` (``None`` or a string), ``add_generation_prompt``,
    ``continue_final_message`` and ``cache_salt``. Rendering it the way vLLM renders a chat
    request (its ``build_chat_params`` merge, then ``parse_chat_messages`` and the template) gives
    the prompt the engine will see, when ``exact`` is true.
    """

    api: WireApi
    model: str | None
    """``None`` only for a Responses request that names no model (the engine then uses its own)."""
    stream: bool
    chat: dict[str, Any]
    exact: bool
    """False when the prompt depends on something the gateway cannot know (history stored in the
    engine, a tool-call id vLLM makes from its clock, media): use the approximate index."""
    inexact_reason: str | None
    text_chars: int
    """Characters of prompt text: the token estimate when no tokenizer is configured."""
    previous_response_id: str | None = None
    """Responses only: the stored response this one continues (a routing constraint: only the
    engine that stored it has its history)."""
    store: bool = False
    """Responses only: whether the engine is asked to keep this response (vLLM's default: true)."""
