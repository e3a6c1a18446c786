"""Every wire format the gateway speaks, reduced to what it routes and hashes on: OpenAI's Chat
Completions and Completions (:mod:`gateway.wire.openai`), Anthropic's Messages, OpenAI's Responses.

Pure (no I/O): each converter of a non-chat API validates a parsed JSON body (a
:class:`~gateway.errors.BadRequest` naming the field) and returns a :class:`WirePrompt` whose
``chat`` is the Chat Completions request vLLM 0.32 builds internally for it, so one chat renderer
gives every API's prompt.
"""

from gateway.wire._check import load_object
from gateway.wire.anthropic import parse_messages, probe_disabled_thinking_effort, requires_system_first
from gateway.wire.chat_params import chat_template_kwargs, chat_tools, merge_kwargs
from gateway.wire.responses import parse_responses
from gateway.wire.types import WireApi, WirePrompt

__all__ = [
    "WireApi",
    "WirePrompt",
    "chat_template_kwargs",
    "chat_tools",
    "load_object",
    "merge_kwargs",
    "parse_messages",
    "parse_responses",
    "probe_disabled_thinking_effort",
    "requires_system_first",
]
