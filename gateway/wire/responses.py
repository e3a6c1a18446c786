"""OpenAI ``/v1/responses`` -> :class:`WirePrompt`.

Validation follows vLLM 0.32's ``ResponsesRequest`` for the fields that shape the prompt or the
routing (``model``, ``input``, ``instructions``, ``tools``, ``tool_choice``, ``stream``, ``store``,
``previous_response_id``, ``reasoning``, ``chat_template_kwargs``, ``cache_salt``); each failure
is a 400 naming the field (``input[3].call_id``).

The conversion follows vLLM's ``construct_input_messages`` and ``construct_tool_dicts`` (after the
request's ``input_item_parsing``) for a non-Harmony model:

- ``instructions`` (when non-empty) is a leading system message;
- a string ``input`` is one user message; in a list, ``function_call`` /
  ``custom_tool_call`` items become ``tool_calls`` (``namespace__name`` for a namespaced call; a
  custom call's ``arguments`` is ``json.dumps({"input": input}, ensure_ascii=False)``), joined to
  the assistant message just before them; ``reasoning`` items give ``reasoning`` (their first
  ``content`` text, else their first ``summary`` text); assistant ``message`` items give the text of
  their first content part, filling the content of an assistant message that has none yet;
  ``function_call_output`` / ``custom_tool_call_output`` items become ``role: tool`` messages; any
  other item with a ``role`` passes unchanged;
- tools: ``function`` tools, the function tools inside a ``namespace`` tool (named
  ``namespace__name``) and ``custom`` tools (as a one-string-argument function) become
  ``{"type": "function", "function": {name, description, parameters, [strict],
  [defer_loading]}}``; other tool types are not shown to the model; no tools -> ``None``;
- a last assistant ``message`` / ``reasoning`` item with status ``in_progress`` / ``incomplete``
  turns ``continue_final_message`` on and ``add_generation_prompt`` off;
- ``reasoning.effort`` becomes ``reasoning_effort``.

Not exact: ``previous_response_id`` (the history lives in the engine that stored that response;
``chat.messages`` then holds only this request's own part, which is not a prefix of the prompt) and
image or file input parts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.errors import BadRequest
from gateway.wire import _check as c
from gateway.wire.types import WirePrompt

NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"
TOOL_CHOICE_MODES = ("auto", "none", "required")
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio", "image_url", "input_video"})


def custom_tool_parameters() -> dict[str, Any]:
    """The schema vLLM shows the model for a ``custom`` (free-form text) tool."""
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": False,
    }


def parse_responses(
    body: Mapping[str, Any], *, exclude_tools_when_tool_choice_none: bool = False
) -> WirePrompt:
    """Validate a Responses body and convert it. Raises :class:`~gateway.errors.BadRequest` naming the field.

    ``exclude_tools_when_tool_choice_none`` mirrors the engine flag of that name."""
    if not isinstance(body, Mapping):
        raise BadRequest("request body must be a JSON object", None, "invalid_json")
    model = c.opt_str(body, "model", "model")
    stream = c.opt_bool(body, "stream", "stream")
    store = c.opt_bool(body, "store", "store")
    previous = c.opt_str(body, "previous_response_id", "previous_response_id")
    instructions = c.opt_str(body, "instructions", "instructions")
    c.opt_str(body, "prompt_cache_key", "prompt_cache_key")
    c.opt_obj(body, "metadata", "metadata")
    kwargs = c.opt_obj(body, "chat_template_kwargs", "chat_template_kwargs")
    salt = c.opt_str(body, "cache_salt", "cache_salt")
    if body.get("prompt") is not None:
        raise c.bad_value("prompt", "(a prompt template) is not supported")
    if body.get("background") and not body.get("store", True):
        raise c.bad_value("background", "can only be used when 'store' is true")
    if body.get("previous_input_messages") and previous:
        raise c.bad_value("previous_response_id", "cannot be set together with 'previous_input_messages'")
    reasoning = c.opt_obj(body, "reasoning", "reasoning")
    effort = None if reasoning is None else c.opt_str(reasoning, "effort", "reasoning.effort")
    tools = _validate_tools(body.get("tools"))
    tool_choice = _validate_tool_choice(body.get("tool_choice", "auto"), tools)

    conv = _Converter()
    if instructions:
        conv.text_chars += len(instructions)
        conv.out.append({"role": "system", "content": instructions})
    if "input" not in body or body["input"] is None:
        raise c.missing("input")
    items = body["input"]
    continue_final = False
    if isinstance(items, str):
        conv.text_chars += len(items)
        conv.out.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            conv.item(item, f"input[{i}]")
        continue_final = bool(items) and _is_partial(items[-1])
    else:
        raise c.wrong("input", "a string or an array of input items")
    if previous is not None:
        conv.inexact("history held by the engine (previous_response_id)")

    tool_dicts: list[dict[str, Any]] | None
    if not tools or (tool_choice == "none" and exclude_tools_when_tool_choice_none):
        tool_dicts = None
    else:
        tool_dicts = [d for t in tools for d in _tool_dicts(t)]
    chat: dict[str, Any] = {
        "messages": conv.out,
        "tools": tool_dicts,
        "tool_choice": tool_choice,
        "chat_template_kwargs": kwargs,
        "reasoning_effort": effort,
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "cache_salt": salt,
    }
    reason = conv.inexact_reason
    return WirePrompt(
        api="responses",
        model=model,
        stream=bool(stream),
        chat=chat,
        exact=reason is None,
        inexact_reason=reason,
        text_chars=conv.text_chars,
        previous_response_id=previous,
        store=True if store is None else store,
    )


# -- tools -----------------------------------------------------------------------------------------
def _validate_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise c.wrong("tools", "an array")
    for i, t in enumerate(tools):
        field = f"tools[{i}]"
        t = c.obj(t, field)
        kind = c.req_str(t, "type", f"{field}.type")
        if kind in ("function", "custom"):
            _validate_function(t, field)
        elif kind == "namespace":
            c.req_str(t, "name", f"{field}.name")
            c.req_str(t, "description", f"{field}.description")
            inner = t.get("tools")
            if inner is None:
                raise c.missing(f"{field}.tools")
            if not isinstance(inner, list):
                raise c.wrong(f"{field}.tools", "an array")
            for j, nt in enumerate(inner):
                nf = f"{field}.tools[{j}]"
                nt = c.obj(nt, nf)
                c.req_enum(nt, "type", f"{nf}.type", ("function", "custom"))
                _validate_function(nt, nf)
    return tools


def _validate_function(t: Mapping[str, Any], field: str) -> None:
    c.req_str(t, "name", f"{field}.name")
    c.opt_str(t, "description", f"{field}.description")
    if t["type"] == "function":
        c.opt_obj(t, "parameters", f"{field}.parameters")
        c.opt_bool(t, "strict", f"{field}.strict")
        c.opt_bool(t, "defer_loading", f"{field}.defer_loading")
    else:
        fmt = c.opt_obj(t, "format", f"{field}.format")
        if fmt is not None and fmt.get("type") == "grammar":
            raise c.bad_value(
                f"{field}.format", "(a grammar) is not supported; only free-form text custom tools are"
            )


def _function_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for t in tools:
        if t["type"] in ("function", "custom"):
            names.append(t["name"])
        elif t["type"] == "namespace":
            names += [f"{t['name']}{NAMESPACE_SEPARATOR}{nt['name']}" for nt in t["tools"]]
    return names


def _validate_tool_choice(tc: Any, tools: list[dict[str, Any]]) -> Any:
    """The tool choice as vLLM's ``check_tool_usage`` leaves it."""
    named = isinstance(tc, dict) and tc.get("type") in ("function", "custom")
    if isinstance(tc, str):
        if tc not in TOOL_CHOICE_MODES:
            raise c.bad_value("tool_choice", f"must be one of {', '.join(TOOL_CHOICE_MODES)} or an object")
    elif not isinstance(tc, dict):
        raise c.wrong("tool_choice", "a string or an object")
    if not tools:
        if tc in ("auto", "none"):
            return "none"
        if tc == "required":
            raise c.bad_value("tool_choice", "'required' needs 'tools'")
        if named:
            raise c.bad_value("tool_choice", "names a function that is not in 'tools'")
        return tc
    if named:
        name = tc.get("name")
        if not isinstance(name, str) or not name:
            raise c.missing("tool_choice.name")
        names = _function_names(tools)
        # as vLLM's pydantic model dumps it: {name, type}
        if name in names:
            return {"name": name, "type": tc["type"]}
        matches = [n for n in names if n.endswith(f"{NAMESPACE_SEPARATOR}{name}")]
        if len(matches) == 1:
            return {"name": matches[0], "type": tc["type"]}
        if len(matches) > 1:
            raise c.bad_value(
                "tool_choice.name", f"is ambiguous: defined in more than one namespace ({', '.join(matches)})"
            )
        raise c.bad_value("tool_choice.name", "names a function that is not in 'tools'")
    return tc


def _function_dict(name: str, t: Mapping[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {
        "name": name,
        "description": t.get("description"),
        "parameters": t.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        if t.get(key) is not None:
            fn[key] = c.lax_bool(t[key])
    return {"type": "function", "function": fn}


def _tool_dicts(t: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat-template tools one Responses tool becomes (vLLM's ``get_function_tools``)."""
    kind = t["type"]
    if kind == "function":
        return [_function_dict(t["name"], t)]
    if kind == "custom":
        return [
            _function_dict(
                t["name"], {"description": t.get("description"), "parameters": custom_tool_parameters()}
            )
        ]
    if kind == "namespace":
        return [
            _function_dict(f"{t['name']}{NAMESPACE_SEPARATOR}{nt['name']}", nt)
            for nt in t["tools"]
            if nt["type"] == "function"
        ]
    return []


# -- input items -----------------------------------------------------------------------------------
def _is_partial(item: Any) -> bool:
    """vLLM's ``should_continue_final_message`` for the last input item."""
    if not isinstance(item, dict) or item.get("type", "message") not in ("message", "reasoning"):
        return False
    return item.get("status") in ("in_progress", "incomplete")


class _Converter:
    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.inexact_reason: str | None = None
        self.text_chars = 0

    def inexact(self, reason: str) -> None:
        if self.inexact_reason is None:
            self.inexact_reason = reason

    def _prev_assistant(self) -> dict[str, Any] | None:
        if self.out and self.out[-1].get("role") == "assistant":
            return self.out[-1]
        return None

    def _add_call(self, call: dict[str, Any]) -> None:
        prev = self._prev_assistant()
        if prev is not None:
            calls = prev.get("tool_calls")
            if calls is None:
                prev["tool_calls"] = [call]
                return
            if isinstance(calls, list):
                calls.append(call)
                return
        self.out.append({"role": "assistant", "tool_calls": [call]})

    def _add_text(self, text: str) -> None:
        prev = self._prev_assistant()
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
            return
        self.out.append({"role": "assistant", "content": text})

    def item(self, item: Any, field: str) -> None:
        item = c.obj(item, field)
        kind = c.opt_str(item, "type", f"{field}.type")
        if kind == "function_call":
            call_id = c.req_str(item, "call_id", f"{field}.call_id")
            name = c.req_str(item, "name", f"{field}.name")
            arguments = c.req_str(item, "arguments", f"{field}.arguments")
            namespace = c.opt_str(item, "namespace", f"{field}.namespace")
            if namespace:
                name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
            self.text_chars += len(arguments)
            self._add_call(
                {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}
            )
        elif kind == "custom_tool_call":
            call_id = c.req_str(item, "call_id", f"{field}.call_id")
            name = c.req_str(item, "name", f"{field}.name")
            payload = c.opt_str(item, "input", f"{field}.input") or ""
            arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)
            self.text_chars += len(arguments)
            self._add_call(
                {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}
            )
        elif kind == "reasoning":
            self._reasoning(item, field)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out_id = c.opt_str(item, "call_id", f"{field}.call_id")  # vLLM takes a missing one as None
            if "output" not in item:
                raise c.missing(f"{field}.output")
            output = item["output"]
            if isinstance(output, str):
                self.text_chars += len(output)
            elif isinstance(output, list):
                self._parts(output, f"{field}.output")
            else:
                raise c.wrong(f"{field}.output", "a string or an array of content parts")
            self.out.append({"role": "tool", "content": output, "tool_call_id": out_id})
        elif "role" in item and (kind is None or kind == "message"):
            self._message(item, field)
        else:
            what = kind if kind is not None else "(none)"
            raise c.bad_value(f"{field}.type", f"{what!r} is not a supported input item type")

    def _reasoning(self, item: dict[str, Any], field: str) -> None:
        if item.get("encrypted_content"):
            raise c.bad_value(f"{field}.encrypted_content", "is not supported (encrypted reasoning)")
        summary = c.opt_list(item, "summary", f"{field}.summary")
        if summary is None:
            raise c.missing(f"{field}.summary")
        content = c.opt_list(item, "content", f"{field}.content")
        text = ""
        if content:
            first = c.obj(content[0], f"{field}.content[0]")
            text = c.req_str(first, "text", f"{field}.content[0].text")
        elif summary:
            first = c.obj(summary[0], f"{field}.summary[0]")
            text = c.req_str(first, "text", f"{field}.summary[0].text")
        self.text_chars += len(text)
        prev = self._prev_assistant()
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
            return
        self.out.append({"role": "assistant", "reasoning": text})

    def _message(self, item: dict[str, Any], field: str) -> None:
        role = c.req_enum(item, "role", f"{field}.role", ("user", "assistant", "system", "developer"))
        content = item.get("content")
        if content is None:
            raise c.missing(f"{field}.content")
        if isinstance(content, list):
            self._parts(content, f"{field}.content")
        elif isinstance(content, str):
            self.text_chars += len(content)
        else:
            raise c.wrong(f"{field}.content", "a string or an array of content parts")
        if role == "assistant":
            text: str | None = None
            if isinstance(content, str):
                text = content
            elif content:
                text = content[0].get("text")
            elif item.get("type") == "message":
                # vLLM reads content[0] of an output message: an empty one has nothing to read
                raise c.bad_value(f"{field}.content", "must not be empty")
            if text is not None:
                self._add_text(text)
                return
        self.out.append(dict(item))

    def _parts(self, parts: list[Any], field: str) -> None:
        for j, p in enumerate(parts):
            p = c.obj(p, f"{field}[{j}]")
            kind = c.opt_str(p, "type", f"{field}[{j}].type")
            text = c.opt_str(p, "text", f"{field}[{j}].text")
            if text is not None:
                self.text_chars += len(text)
            if kind in _MEDIA_PARTS:
                self.inexact("image or file content")
