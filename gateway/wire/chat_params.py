"""The keyword arguments vLLM 0.32 passes to the chat template for a chat-shaped request.

Mirrors ``ChatCompletionRequest.build_chat_params`` (and ``ResponsesRequest``'s, which differs only
in where ``add_generation_prompt`` / ``continue_final_message`` come from, already resolved in a
:class:`~gateway.wire.types.WirePrompt`'s ``chat``): the request's ``chat_template_kwargs``, then
``add_generation_prompt``, ``continue_final_message``, ``documents`` and ``reasoning_effort`` over
them unless ``None`` or ``"auto"``; with a ``reasoning_effort`` and no ``enable_thinking`` of the
request's own, ``enable_thinking = reasoning_effort != "none"``. The engine's
``--default-chat-template-kwargs`` go under these (``merge_kwargs(defaults, these)``), and vLLM
then keeps only the names the template uses.

Also :func:`chat_tools`: a Chat Completions ``tools`` list the way vLLM dumps it for the template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.wire import _check as c

_UNSET = (None, "auto")


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``overrides`` win, except their ``None`` and ``"auto"`` values."""
    return {**(defaults or {}), **{k: v for k, v in (overrides or {}).items() if not _is_unset(v)}}


def _is_unset(v: Any) -> bool:
    return any(v is u or (isinstance(v, str) and v == u) for u in _UNSET)


def chat_template_kwargs(
    chat: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Template kwargs for a chat body (a Chat Completions body or a ``WirePrompt.chat``)."""
    effort = chat.get("reasoning_effort")
    extra: dict[str, Any] = {
        "add_generation_prompt": chat.get("add_generation_prompt", True),
        "continue_final_message": chat.get("continue_final_message", False),
        "documents": chat.get("documents"),
        "reasoning_effort": effort,
    }
    user = chat.get("chat_template_kwargs") or {}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    kwargs = merge_kwargs(user, extra)
    # vLLM's ChatParams.with_defaults leaves the kwargs untouched when the engine has no defaults
    return merge_kwargs(defaults, kwargs) if defaults else kwargs


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A Chat Completions ``tools`` list as vLLM hands it to the template: each tool through
    ``ChatCompletionToolsParam(...).model_dump()`` (``description: None`` added, keys in model
    order, unknown keys dropped, ``strict`` / ``defer_loading`` only when set, a tool-level
    ``defer_loading`` copied into the function). Raises :class:`~gateway.errors.BadRequest` naming the field."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise c.wrong("tools", "an array")
    if not tools:
        raise c.bad_value("tools", "must not be an empty array: give at least one tool or omit the field")
    out = []
    for i, t in enumerate(tools):
        field = f"tools[{i}]"
        t = c.obj(t, field)
        c.opt_enum(t, "type", f"{field}.type", ("function",))
        if t.get("function") is None:
            raise c.missing(f"{field}.function")
        fn = c.obj(t["function"], f"{field}.function")
        name = c.req_str(fn, "name", f"{field}.function.name")
        desc = c.opt_str(fn, "description", f"{field}.function.description")
        params = c.opt_obj(fn, "parameters", f"{field}.function.parameters")
        strict = c.opt_bool(fn, "strict", f"{field}.function.strict")
        fn_defer = c.opt_bool(fn, "defer_loading", f"{field}.function.defer_loading")
        defer = c.opt_bool(t, "defer_loading", f"{field}.defer_loading")
        if defer is not None and fn_defer is None:
            fn_defer = defer
        d: dict[str, Any] = {"name": name, "description": desc, "parameters": params}
        if strict is not None:
            d["strict"] = strict
        if fn_defer is not None:
            d["defer_loading"] = fn_defer
        tool: dict[str, Any] = {"type": "function", "function": d}
        if defer is not None:
            tool["defer_loading"] = defer
        out.append(tool)
    return out
