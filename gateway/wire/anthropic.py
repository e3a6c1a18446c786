"""Anthropic ``/v1/messages`` (and ``/v1/messages/count_tokens``) -> :class:`WirePrompt`.

Validation follows vLLM 0.32's ``AnthropicMessagesRequest`` / ``AnthropicCountTokensRequest``
pydantic models (unknown keys such as ``cache_control`` or ``context_management`` are ignored, as
there); each failure is a 400 naming the field (``messages[2].content[0].type``).

The conversion follows ``AnthropicServingMessages.to_chat_completion_request``:

- ``system`` (a string, or text blocks joined with ``""``; a block starting with
  ``x-anthropic-billing-header`` is dropped, as Claude Code's carries a per-build hash) becomes one
  leading system message; with ``merge_inline_system`` the text of every ``role: system`` message
  in ``messages`` is appended to it, else each becomes its own system message in place;
- ``text`` blocks (non-empty) are content parts, a single text part collapses to a string;
  ``image`` blocks become ``image_url`` parts; ``thinking`` blocks join into ``reasoning``;
  ``tool_use`` blocks become ``tool_calls`` with ``arguments = json.dumps(input or {})``;
  a user ``tool_result`` becomes a ``role: tool`` message placed before the user's own message
  (text items joined with newlines; images follow as a user message; ``tool_reference`` items as a
  second tool message); an assistant ``tool_result`` becomes the text part ``Tool result: ...``;
  a user message left with no content is dropped;
- ``tool_addition`` / ``tool_removal`` blocks (system messages only) edit ``tools`` in order;
  each tool becomes ``{"type": "function", "function": {name, description, parameters,
  [strict], [defer_loading]}}`` with ``parameters.type`` defaulting to ``"object"``;
- ``tool_choice``: auto -> ``"auto"``, any -> ``"required"``, none -> ``"none"``, tool -> named;
  absent with tools -> ``"auto"``;
- ``thinking.type == "disabled"`` sets ``reasoning_effort`` to ``disabled_thinking_effort``
  (vLLM probes its renderer for it: ``"low"`` when the template renders ``"none"`` like another
  effort, e.g. a template that ignores ``reasoning_effort``; else ``"none"``), and
  ``output_config.effort`` sets ``reasoning_effort`` (the later one wins, as in vLLM).

Not exact: a ``tool_use`` block without an ``id`` (vLLM makes one from its clock) and image
content (the engine's media processing decides its tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from gateway.errors import BadRequest
from gateway.wire import _check as c
from gateway.wire.types import WirePrompt

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
ROLES = ("user", "assistant", "system")
TOOL_CHOICE_TYPES = ("auto", "any", "tool", "none")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
DISABLED_EFFORTS = ("none", *EFFORTS)
THINKING_DISPLAYS = ("summarized", "omitted", "updates")
#: A stand-in for the id vLLM makes from its clock for a ``tool_use`` block without one.
CLOCK_ID_PLACEHOLDER = "call_<clock>"


def requires_system_first(chat_template: str | None) -> bool:
    """vLLM's ``_detect_merge_inline_system``: True when the template fails to render
    [system, user, system, user] (or there is no template); then inline system messages are
    merged into the leading one. Pass the template the engine renders with."""
    if not chat_template:
        return True
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    try:
        env.from_string(chat_template).render(
            messages=[
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
            ],
            add_generation_prompt=False,
        )
    except TemplateError:
        return True
    return False


def probe_disabled_thinking_effort(render: Callable[[str], object | None]) -> str:
    """vLLM's ``_probe_disabled_thinking_effort``: the ``reasoning_effort`` that
    ``thinking: {"type": "disabled"}`` becomes on this engine.

    ``render(effort)`` renders ``[{"role": "user", "content": "Hi"}]`` with that
    ``reasoning_effort`` (vLLM's chat kwargs: ``enable_thinking = effort != "none"`` too) and returns
    the prompt, or None when the template refuses it. ``"low"`` when ``"none"`` is refused or renders
    like a real effort (a template that ignores efforts, or treats unknown ones as the maximum);
    else ``"none"``. vLLM probes once per engine and keeps the answer."""
    none_prompt = render("none")
    if none_prompt is None:
        return "low"
    if any(render(effort) == none_prompt for effort in EFFORTS):
        return "low"
    return "none"


def parse_messages(
    body: Mapping[str, Any],
    *,
    count_tokens: bool = False,
    merge_inline_system: bool = False,
    disabled_thinking_effort: str = "none",
) -> WirePrompt:
    """Validate a Messages (or, with ``count_tokens``, a count_tokens) body and convert it.

    Raises :class:`~gateway.errors.BadRequest` naming the first bad field."""
    _validate(body, count_tokens)
    conv = _Converter(merge_inline_system)
    conv.system(body.get("system"), body["messages"])
    conv.messages(body["messages"])
    chat: dict[str, Any] = {
        "messages": conv.out,
        "tools": None,
        "tool_choice": None,
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        "reasoning_effort": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "cache_salt": None if count_tokens else body.get("cache_salt"),
    }
    output_config = body.get("output_config") or {}
    if output_config.get("effort") is not None:
        chat["reasoning_effort"] = output_config["effort"]
    thinking = body.get("thinking")
    if thinking is not None and thinking["type"] == "disabled":
        chat["reasoning_effort"] = disabled_thinking_effort
    tool_choice = body.get("tool_choice")
    if tool_choice is not None:
        kind = tool_choice["type"]
        if kind == "tool":
            chat["tool_choice"] = {"function": {"name": tool_choice["name"]}, "type": "function"}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    tools = _resolve_tools(body)
    if tools is not None:
        chat["tools"] = [_tool_dict(t) for t in tools]
        if chat["tool_choice"] is None:
            chat["tool_choice"] = "auto"
    reason = conv.inexact_reason
    return WirePrompt(
        api="count_tokens" if count_tokens else "messages",
        model=body["model"],
        stream=False if count_tokens else bool(c.lax_bool(body.get("stream"))),
        chat=chat,
        exact=reason is None,
        inexact_reason=reason,
        text_chars=conv.text_chars,
    )


# -- validation ----------------------------------------------------------------------------------
def _validate(body: Mapping[str, Any], count_tokens: bool) -> None:
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object", None, "invalid_json")
    model = c.req_str(body, "model", "model")
    if not model:
        raise c.bad_value("model", "must not be empty")
    messages = body.get("messages")
    if messages is None:
        raise c.missing("messages")
    if not isinstance(messages, list):
        raise c.wrong("messages", "an array")
    for i, m in enumerate(messages):
        _validate_message(m, f"messages[{i}]")
    max_tokens: int | None = None
    if not count_tokens:
        if body.get("max_tokens") is None:
            raise c.missing("max_tokens")
        max_tokens = c.opt_int(body, "max_tokens", "max_tokens")
        assert max_tokens is not None
        if max_tokens <= 0:
            raise c.bad_value("max_tokens", "must be positive")
        c.opt_bool(body, "stream", "stream")
        for key in ("temperature", "top_p"):
            c.opt_num(body, key, key)
        c.opt_int(body, "top_k", "top_k")
        c.opt_obj(body, "metadata", "metadata")
        stops = c.opt_list(body, "stop_sequences", "stop_sequences")
        for j, s in enumerate(stops or ()):
            if not isinstance(s, str):
                raise c.wrong(f"stop_sequences[{j}]", "a string")
        salt = c.opt_str(body, "cache_salt", "cache_salt")
        if salt is not None and not 1 <= len(salt) <= 1024:
            raise c.bad_value("cache_salt", "must be 1-1024 characters")
        for key in ("kv_transfer_params", "ec_transfer_params", "vllm_xargs"):
            c.opt_obj(body, key, key)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        if not isinstance(system, list):
            raise c.wrong("system", "a string or an array of content blocks")
        for j, b in enumerate(system):
            block = _validate_block(b, f"system[{j}]", "")
            if block["type"] in ("tool_addition", "tool_removal"):
                raise c.bad_value(f"system[{j}].type", 'is only allowed in messages with role "system"')
    c.opt_obj(body, "chat_template_kwargs", "chat_template_kwargs")
    _validate_tools(body.get("tools"), "tools")
    tc = c.opt_obj(body, "tool_choice", "tool_choice")
    if tc is not None:
        kind = c.req_enum(tc, "type", "tool_choice.type", TOOL_CHOICE_TYPES)
        name = c.opt_str(tc, "name", "tool_choice.name")
        c.opt_bool(tc, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")
        if kind == "tool" and not name:
            raise c.missing("tool_choice.name")
    oc = c.opt_obj(body, "output_config", "output_config")
    if oc is not None:
        c.opt_enum(oc, "effort", "output_config.effort", EFFORTS)
        fmt = c.opt_obj(oc, "format", "output_config.format")
        if fmt is not None:
            c.opt_obj(fmt, "schema", "output_config.format.schema")
            c.opt_enum(fmt, "type", "output_config.format.type", ("json_schema",))
    th = c.opt_obj(body, "thinking", "thinking")
    if th is not None:
        kind = c.req_enum(th, "type", "thinking.type", ("enabled", "disabled", "adaptive"))
        if kind != "disabled":
            c.opt_enum(th, "display", "thinking.display", THINKING_DISPLAYS)
        if kind == "enabled":
            if th.get("budget_tokens") is None:
                raise c.missing("thinking.budget_tokens")
            budget = c.opt_int(th, "budget_tokens", "thinking.budget_tokens")
            assert budget is not None
            if budget < 1024:
                raise c.bad_value("thinking.budget_tokens", "must be at least 1024")
            kv = body.get("kv_transfer_params")
            remote = isinstance(kv, dict) and kv.get("do_remote_decode")
            # the parsed max_tokens: the body's may be a numeric string ("4096" >= int was a 500)
            if max_tokens is not None and not remote and budget >= max_tokens:
                raise c.bad_value("thinking.budget_tokens", "must be less than max_tokens")


def _validate_message(m: Any, field: str) -> None:
    m = c.obj(m, field)
    role = c.req_enum(m, "role", f"{field}.role", ROLES)
    content = m.get("content")
    if content is None:
        raise c.missing(f"{field}.content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise c.wrong(f"{field}.content", "a string or an array of content blocks")
    for j, b in enumerate(content):
        _validate_block(b, f"{field}.content[{j}]", role)


def _validate_block(b: Any, field: str, role: str) -> dict[str, Any]:
    b = c.obj(b, field)
    block: dict[str, Any] = b
    kind = c.req_enum(b, "type", f"{field}.type", BLOCK_TYPES)
    for key in ("text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data"):
        c.opt_str(b, key, f"{field}.{key}")
    c.opt_obj(b, "source", f"{field}.source")
    c.opt_obj(b, "input", f"{field}.input")
    c.opt_bool(b, "is_error", f"{field}.is_error")
    content = b.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            raise c.wrong(f"{field}.content", "a string or an array of objects")
        for k, item in enumerate(content):
            c.obj(item, f"{field}.content[{k}]")
    tool = b.get("tool")
    if tool is not None:
        tool = c.obj(tool, f"{field}.tool")
        tkind = c.req_enum(tool, "type", f"{field}.tool.type", ("tool_reference", "tool_definition"))
        if tkind == "tool_reference":
            c.req_str(tool, "name", f"{field}.tool.name")
        else:
            if tool.get("definition") is None:
                raise c.missing(f"{field}.tool.definition")
            _validate_tool(tool["definition"], f"{field}.tool.definition")
    if kind in ("tool_addition", "tool_removal"):
        if tool is None:
            raise c.missing(f"{field}.tool")
        if kind == "tool_removal" and tool["type"] != "tool_reference":
            raise c.bad_value(f"{field}.tool.type", "must be 'tool_reference' in a tool_removal block")
        if role != "system":
            raise c.bad_value(f"{field}.type", 'is only allowed in messages with role "system"')
    return block


def _validate_tools(tools: Any, field: str) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise c.wrong(field, "an array")
    for i, t in enumerate(tools):
        _validate_tool(t, f"{field}[{i}]")


def _validate_tool(t: Any, field: str) -> None:
    t = c.obj(t, field)
    c.req_str(t, "name", f"{field}.name")
    c.opt_str(t, "description", f"{field}.description")
    if t.get("input_schema") is None:
        raise c.missing(f"{field}.input_schema")
    c.opt_obj(t, "input_schema", f"{field}.input_schema")
    c.opt_bool(t, "strict", f"{field}.strict")
    c.opt_bool(t, "defer_loading", f"{field}.defer_loading")


# -- conversion ----------------------------------------------------------------------------------
def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _is_billing(text: str) -> bool:
    return text.startswith(BILLING_HEADER_PREFIX)


def _system_text(content: str | list[dict[str, Any]]) -> str | None:
    if isinstance(content, str):
        return None if _is_billing(content) else content
    parts = [
        b["text"] for b in content if b["type"] == "text" and b.get("text") and not _is_billing(b["text"])
    ]
    return "".join(parts) if parts else None


class _Converter:
    def __init__(self, merge_inline_system: bool) -> None:
        self.merge = merge_inline_system
        self.out: list[dict[str, Any]] = []
        self.inexact_reason: str | None = None
        self.text_chars = 0

    def _inexact(self, reason: str) -> None:
        if self.inexact_reason is None:
            self.inexact_reason = reason

    def system(self, system: Any, messages: list[dict[str, Any]]) -> None:
        parts: list[str] = []
        if system:
            if isinstance(system, str):
                parts.append(system)
            else:
                parts += [
                    b["text"]
                    for b in system
                    if b["type"] == "text" and b.get("text") and not _is_billing(b["text"])
                ]
        if self.merge:
            for m in messages:
                if m["role"] == "system":
                    text = _system_text(m["content"])
                    if text:
                        parts.append(text)
        if parts:
            text = "".join(parts)
            self.text_chars += len(text)
            self.out.append({"role": "system", "content": text})

    def messages(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            role, content = m["role"], m["content"]
            if role == "system":
                if not self.merge:
                    text = _system_text(content)
                    if text:
                        self.text_chars += len(text)
                        self.out.append({"role": "system", "content": text})
                continue
            msg: dict[str, Any] = {"role": role}
            if isinstance(content, str):
                self.text_chars += len(content)
                msg["content"] = content
            else:
                self._content(content, role, msg)
            if not (role == "user" and "content" not in msg):
                self.out.append(msg)

    def _content(self, blocks: list[dict[str, Any]], role: str, msg: dict[str, Any]) -> None:
        parts: list[dict[str, Any]] = []
        tool_calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in blocks:
            kind = b["type"]
            if kind == "text" and b.get("text"):
                self.text_chars += len(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and b.get("source"):
                self._inexact("image content")
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
            elif kind == "thinking" and b.get("thinking") is not None:
                self.text_chars += len(b["thinking"])
                reasoning.append(b["thinking"])
            elif kind == "tool_use":
                call_id = b.get("id")
                if not call_id:
                    self._inexact("a tool_use block without an id (vLLM makes one from its clock)")
                    call_id = CLOCK_ID_PLACEHOLDER
                arguments = json.dumps(b.get("input") or {})
                self.text_chars += len(arguments)
                # key order as vLLM's pydantic validation of the chat request leaves it
                tool_calls.append(
                    {
                        "id": call_id,
                        "function": {"arguments": arguments, "name": b.get("name") or ""},
                        "type": "function",
                    }
                )
            elif kind == "tool_result":
                if role == "user":
                    self._user_tool_result(b)
                else:
                    text = str(b["content"]) if b.get("content") else ""
                    self.text_chars += len(text)
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if tool_calls:
            msg["tool_calls"] = tool_calls
        if parts:
            msg["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts

    def _user_tool_result(self, b: dict[str, Any]) -> None:
        text = ""
        images: list[str] = []
        refs: list[dict[str, Any]] = []
        content = b.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            texts: list[str] = []
            for item in content:
                kind = item.get("type")
                if kind == "text":
                    texts.append(item.get("text", ""))
                elif kind == "image":
                    url = _image_url(item.get("source", {}))
                    if url:
                        images.append(url)
                elif kind == "tool_reference":
                    name = item.get("tool_name") or item.get("name")
                    if name:
                        refs.append({"type": "tool_reference", "name": name})
            text = "\n".join(texts)
        self.text_chars += len(text)
        call_id = b.get("tool_use_id") or ""
        self.out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
        if images:
            self._inexact("image content")
            self.out.append(
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]}
            )
        if refs:
            self.out.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _resolve_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Apply the tool_addition / tool_removal blocks of ``messages`` to ``tools`` in order."""
    changes = [
        (f"messages[{i}].content[{j}]", b)
        for i, m in enumerate(body["messages"])
        if not isinstance(m["content"], str)
        for j, b in enumerate(m["content"])
        if b["type"] in ("tool_addition", "tool_removal")
    ]
    tools: list[dict[str, Any]] | None = body.get("tools")
    if not changes:
        return tools
    by_name = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for field, b in changes:
        change = b["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            by_name[name] = change["definition"]
        else:
            name = change["name"]
            if name not in by_name:
                raise c.bad_value(
                    f"{field}.tool.name", f"references tool {name!r}, which is not declared in tools"
                )
            if b["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if b["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in by_name.items() if name not in removed]


def _tool_dict(t: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam(...).model_dump()`` gives it to the template."""
    schema = t["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    fn: dict[str, Any] = {"name": t["name"], "description": t.get("description"), "parameters": schema}
    for key in ("strict", "defer_loading"):
        if t.get(key) is not None:
            fn[key] = c.lax_bool(t[key])
    return {"type": "function", "function": fn}
