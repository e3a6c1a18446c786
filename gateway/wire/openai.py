"""OpenAI's Chat Completions and Completions bodies, parsed once into typed values
(:class:`ParsedRequest`, what every API's adapter produces), with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import BadRequest


@dataclass(slots=True)
class ParsedRequest:
    kind: str
    """``chat`` or ``completions``."""
    body: dict[str, Any]
    model: str
    stream: bool
    text_chars: int
    """Characters of prompt text: the token estimate when no tokenizer is configured."""
    prompt: dict[str, Any] | None = None
    """For an API whose body is not a chat request (Messages, Responses): the chat request the
    engine builds from it (``gateway.wire``), which decides the prompt; None: ``body`` is it."""
    exact: bool = True
    """False when the prompt depends on state the gateway cannot see (history stored in the
    engine, ids the engine makes up): route on the approximate index."""
    previous_response_id: str | None = None
    """Responses: the stored response this request continues (only its engine has it)."""
    store: bool = False
    """Responses: the engine is asked to keep the answer (the gateway records where)."""
    raw: bytes | None = None
    """The JSON bytes ``body`` was parsed from (what an analysis worker process is sent)."""


def _content_len(content: Any, i: int) -> int:
    """Characters of text in ``messages[i].content``; a shape vLLM would refuse (or the gateway
    could not read) is a 400 naming the field."""
    if isinstance(content, str):
        return len(content)
    if content is None:
        return 0
    if not isinstance(content, list):
        raise BadRequest(
            f"'messages[{i}].content' must be a string, an array of content parts or null",
            f"messages[{i}].content",
            "invalid_type",
        )
    n = 0
    for j, part in enumerate(content):
        if isinstance(part, dict):
            t = part.get("text")
            if isinstance(t, str):
                n += len(t)
                continue
            kind = part.get("type")
            if t is None and (kind is None or (isinstance(kind, str) and kind != "text")):
                continue  # an image, audio, file... part
        raise _bad_part(part, i, j)
    return n


def _bad_part(part: Any, i: int, j: int) -> BadRequest:
    """The error for a content part the fast path in ``_content_len`` did not accept."""
    field = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict):
        return BadRequest(f"'{field}' must be an object (a content part)", field, "invalid_type")
    if not isinstance(part.get("type", ""), str):
        return BadRequest(f"'{field}.type' must be a string", f"{field}.type", "invalid_type")
    if part.get("text") is None:
        return BadRequest(f"'{field}.text' is required", f"{field}.text", "missing_required_parameter")
    return BadRequest(f"'{field}.text' must be a string", f"{field}.text", "invalid_type")


def parse_body(kind: str, raw: bytes) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", None, "invalid_json")
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("'model' must be a non-empty string", "model", "invalid_type")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream", "invalid_type")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    if kind == "chat":
        chars = _parse_messages(body)
        for key, typ, what in (("tools", list, "an array"), ("chat_template_kwargs", dict, "an object")):
            v = body.get(key)
            if v is not None and not isinstance(v, typ):
                raise BadRequest(f"'{key}' must be {what}", key, "invalid_type")
    else:
        chars = _parse_prompt(body)
    return ParsedRequest(kind, body, model, stream, chars, raw=raw)


def _parse_messages(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages", "invalid_type")
    chars = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"'messages[{i}].role' is required", f"messages[{i}].role", "invalid_type")
        chars += _content_len(m.get("content"), i)
    return chars


def _parse_prompt(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return 4 * len(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return 4 * sum(len(p) for p in prompt)
    raise BadRequest(
        "'prompt' must be a string, an array of strings or an array of token ids",
        "prompt",
        "invalid_type",
    )


def dumps(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)
