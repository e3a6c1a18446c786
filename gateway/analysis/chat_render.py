"""Chat requests rendered into prompt text the way vLLM 0.32 renders them.

A chat body goes through the same normalisation as vLLM's chat-completions path
(``ChatCompletionRequest`` validation, ``parse_chat_messages``, the tools' pydantic dump) before
the model's chat template sees it: each tool is dumped as ``{"type", "function": {"name",
"description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}``
(``description: null`` added, extra keys dropped); each message is rebuilt as ``role, content[,
tool_calls, reasoning, reasoning_content | tool_call_id][, name][, task]`` (other keys dropped);
text parts are joined with newlines (or kept as ``{"type": "text", ...}`` parts when the template
iterates over ``message.content``, detected from its AST by vLLM's rule); tool-call items are
reordered ``id, function{arguments, name, ...}, type, ...`` and their ``arguments`` JSON-decoded
to an object (``{}`` when empty, malformed or not an object); an empty ``tool_calls`` list is
dropped; ``developer`` turns become ``system`` when the template does not know that role.
``chat_template_kwargs`` are merged as vLLM merges them (the request's ``add_generation_prompt``
wins, ``None`` values are dropped), then transformers' named special tokens are added. The
template runs in a sandboxed Jinja environment configured as transformers configures it. Inputs
whose tokens depend on the engine (media parts, a request chat template,
``continue_final_message``, truncation) raise :class:`Unsupported`; shapes vLLM refuses are an
:class:`~gateway.errors.BadRequest` naming the field. The body is never modified.
"""

from __future__ import annotations

import json
from collections import deque
from datetime import datetime
from typing import Any

import jinja2.nodes as jn
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import BadRequest

__all__ = ["SPECIAL_TOKEN_NAMES", "ChatRenderer", "Unsupported", "content_format"]

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# parameters of transformers' apply_chat_template that it consumes instead of the template
_HF_CONSUMED = frozenset(
    {
        "conversation",
        "chat_template",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_MEDIA_KEYS = frozenset(
    {
        "image_url",
        "image_pil",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "audio_url",
        "input_audio",
        "video_url",
        "input_image",
        "file",
    }
)
# every key of vLLM's content-part TypedDicts (vllm.renderers.chat_utils._KNOWN_CONTENT_PART_FIELDS)
_KNOWN_PART_KEYS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_BILLING_HEADER = "x-anthropic-billing-header"


class Unsupported(Exception):
    """The request's tokens depend on something the gateway cannot reproduce exactly."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _is_name(node: jn.Node, name: str) -> bool:
    return isinstance(node, jn.Name) and node.ctx == "load" and node.name == name


def _is_access(node: jn.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key`` / ``name['key']``), through filters, tests and slices."""
    if isinstance(node, (jn.Filter, jn.Test)):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
        return _is_access(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, jn.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, jn.Const) and node.arg.value == key
    if isinstance(node, jn.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def content_format(env: ImmutableSandboxedEnvironment, source: str) -> str:
    """``openai`` when the template loops over a message's content (parts stay structured),
    else ``string`` (text parts are joined): the rule of vLLM's ``_detect_content_format``."""
    try:
        ast = env.parse(source)
    except TemplateError:
        return "string"
    aliases, queue = ["messages"], deque(["messages"])
    while queue:  # variables assigned from `messages` (or its elements)
        var = queue.popleft()
        for a in ast.find_all(jn.Assign):
            name = a.target.name if isinstance(a.target, jn.Name) else None
            if name is not None and name not in aliases and _is_access(a.node, var):
                aliases.append(name)
                queue.append(name)
    msg_vars = [
        loop.target.name
        for loop in ast.find_all(jn.For)
        if isinstance(loop.target, jn.Name) and any(_is_access(loop.iter, v) for v in aliases)
    ]
    in_macro: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in ast.find_all(jn.Macro):
        names = [a.name for a in macro.args]
        params: set[str] = set()
        for call in ast.find_all(jn.Call):
            if not _is_name(call.node, macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(names) and any(_is_access(arg, v, "content") for v in msg_vars):
                    params.add(names[i])
            for kw in call.kwargs:
                if kw.key in names and any(_is_access(kw.value, v, "content") for v in msg_vars):
                    params.add(kw.key)
        for loop in macro.find_all(jn.For):
            in_macro.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in ast.find_all(jn.For):
        it = loop.iter
        if any(_is_access(it, v, "content") for v in msg_vars):
            return "openai"
        if isinstance(it, jn.Name) and it.name in macro_params.get(id(loop), ()):
            return "openai"
        if id(loop) not in in_macro and isinstance(it, jn.Name) and it.name == "content":
            return "openai"
    return "string"


# -- vLLM's request normalisation -------------------------------------------------------------------


def _bad(param: str, message: str) -> BadRequest:
    return BadRequest(message, param, "invalid_value")


def _opt_bool(v: Any, param: str) -> bool | None:
    """pydantic's lax bool."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in (
        "true",
        "false",
        "1",
        "0",
        "yes",
        "no",
        "on",
        "off",
        "t",
        "f",
        "y",
        "n",
    ):
        return v.lower() in ("true", "1", "yes", "on", "t", "y")
    raise _bad(param, f"'{param}' must be a boolean")


def _tool_dict(tool: Any, i: int) -> dict[str, Any]:
    """``ChatCompletionToolsParam(**tool).model_dump()``."""
    p = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _bad(p, f"'{p}' must be an object")
    if tool.get("type", "function") != "function":
        raise _bad(f"{p}.type", f"'{p}.type' must be 'function'")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{p}.function", f"'{p}.function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str):
        raise _bad(f"{p}.function.name", f"'{p}.function.name' must be a string")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise _bad(f"{p}.function.description", f"'{p}.function.description' must be a string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _bad(f"{p}.function.parameters", f"'{p}.function.parameters' must be an object")
    strict = _opt_bool(fn.get("strict"), f"{p}.function.strict")
    defer = _opt_bool(tool.get("defer_loading"), f"{p}.defer_loading")
    fn_defer = _opt_bool(fn.get("defer_loading"), f"{p}.function.defer_loading")
    if defer is not None and fn_defer is None:
        fn_defer = defer
    out_fn: dict[str, Any] = {"name": name, "description": desc, "parameters": params}
    if strict is not None:
        out_fn["strict"] = strict
    if fn_defer is not None:
        out_fn["defer_loading"] = fn_defer
    out: dict[str, Any] = {"type": "function", "function": out_fn}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _tool_call(item: Any, param: str) -> dict[str, Any]:
    """A tool-call item as pydantic hands it on (fields in TypedDict order, then the rest), with
    ``arguments`` decoded as vLLM's ``_postprocess_messages`` decodes it."""
    if not isinstance(item, dict):
        raise _bad(param, "assistant tool_calls entries must be objects.")
    fn = item.get("function")
    if item.get("type", "function") != "function" or not isinstance(fn, dict):
        raise _bad(param, "chat completions only support assistant tool_calls of type 'function'.")
    new_fn = {k: fn[k] for k in ("arguments", "name") if k in fn}
    new_fn.update((k, v) for k, v in fn.items() if k not in new_fn)
    args = new_fn.get("arguments")
    if not args:
        parsed: Any = {}
    elif isinstance(args, dict):
        parsed = args
    else:
        parsed = args
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                parsed = {}
        if not isinstance(parsed, dict):
            parsed = {}
    new_fn["arguments"] = parsed
    out = {k: item[k] for k in ("id", "function", "type") if k in item}
    out.update((k, v) for k, v in item.items() if k not in out)
    out["function"] = new_fn
    return out


class ChatRenderer:
    """One model's chat template and vLLM's normalisation in front of it."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template)
        self.content_format = content_format(env, template)
        self.knows_developer = '"developer"' in template or "'developer'" in template
        self.special = special

    def _content(self, role: str, content: Any, i: int) -> Any:
        param = f"messages[{i}].content"
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = content
        else:
            raise _bad(param, f"'{param}' must be a string, an array of content parts or null")
        openai = self.content_format == "openai"
        out: list[Any] = []
        for j, part in enumerate(parts):
            if isinstance(part, str):
                if role == "system" and part.startswith(_BILLING_HEADER):
                    part = part.partition("\n")[2]
                    if not part:
                        continue
                out.append({"type": "text", "text": part} if openai else part)
                continue
            if not isinstance(part, dict):
                raise _bad(f"{param}[{j}]", f"'{param}[{j}]' must be an object (a content part)")
            kind = part.get("type")
            if kind is None or part.get("uuid") is not None or kind not in (*_TEXT_PART_KEYS, "thinking"):
                if kind in _MEDIA_KEYS or any(k in part for k in _MEDIA_KEYS):
                    raise Unsupported("media content")
                if kind == "tool_reference" or (kind is None and "tool_reference" in part):
                    name = part.get("name")
                    if openai:
                        out.append({"type": "tool_reference", "name": name})
                    elif name:
                        out.append(name)
                    continue
                if kind is None:
                    raise _bad(f"{param}[{j}].type", "Missing 'type' field in multimodal part.")
                raise _bad(f"{param}[{j}].type", f"Unsupported chat content part type: {kind!r}.")
            text = part.get("thinking" if kind == "thinking" else _TEXT_PART_KEYS[kind])
            if text is None and kind != "thinking":
                continue
            if (
                role == "system"
                and kind == "text"
                and isinstance(text, str)
                and text.startswith(_BILLING_HEADER)
            ):
                text = text.partition("\n")[2]
                if not text:
                    continue
            if openai:
                extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}
                out.append({"type": "text", "text": text, **extra})
            elif text:
                if not isinstance(text, str):
                    raise _bad(f"{param}[{j}].text", f"'{param}[{j}].text' must be a string")
                out.append(text)
        if not openai:
            return "\n".join(out)
        if role == "tool" and not any(p.get("type") != "text" for p in out):
            return "\n".join(p.get("text") or "" for p in out)
        return out

    def normalize(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """vLLM's conversation and tool dicts for a chat body (the body is not modified)."""
        if body.get("chat_template") is not None:
            raise Unsupported("request chat_template")
        if body.get("continue_final_message"):
            raise Unsupported("continue_final_message")
        if body.get("add_special_tokens") or body.get("truncate_prompt_tokens") is not None:
            raise Unsupported("add_special_tokens / truncate_prompt_tokens")
        tools_in = body.get("tools")
        tools = None if tools_in is None else [_tool_dict(t, i) for i, t in enumerate(tools_in)]
        conv: list[dict[str, Any]] = []
        for i, m in enumerate(body["messages"]):
            role = m["role"]
            msg: dict[str, Any] = {"role": role, "content": self._content(role, m.get("content"), i)}
            if role == "assistant":
                calls = m.get("tool_calls")
                if calls is not None:
                    if not isinstance(calls, list):
                        raise _bad(
                            f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' must be an array"
                        )
                    if calls:
                        msg["tool_calls"] = [
                            _tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)
                        ]
                reasoning = m.get("reasoning")
                if reasoning is None:
                    reasoning = m.get("reasoning_content")
                if reasoning is not None:
                    msg["reasoning"] = msg["reasoning_content"] = reasoning
            elif role == "tool" and "tool_call_id" in m:
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            if isinstance(m.get("task"), str):
                msg["task"] = m["task"]
            if role == "developer":
                msg["tools"] = m.get("tools")
            conv.append(msg)
        if not self.knows_developer and any(m["role"] == "developer" for m in conv):
            conv = _developer_as_system(conv)
        return conv, tools

    def template_kwargs(self, body: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """What the template receives besides ``messages`` (vLLM's merge of defaults, the request's
        ``chat_template_kwargs`` and its own fields, then transformers' special tokens)."""
        user = body.get("chat_template_kwargs") or {}
        if "chat_template" in user or "tokenize" in user:
            raise _bad("chat_template_kwargs", "Found unexpected chat template kwargs from request")
        kw: dict[str, Any] = {"tools": tools}
        kw.update(
            (k, v) for k, v in user.items() if v is not None and not (isinstance(v, str) and v == "auto")
        )
        effort = body.get("reasoning_effort")
        extra: dict[str, Any] = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "documents": body.get("documents"),
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
        kw.update(
            (k, v) for k, v in extra.items() if v is not None and not (isinstance(v, str) and v == "auto")
        )
        out = {**self.special, **{k: v for k, v in kw.items() if k not in _HF_CONSUMED}}
        out.setdefault("documents", None)
        out.setdefault("add_generation_prompt", False)
        return out

    def render_conversation(self, conv: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        try:
            return self.template.render(messages=conv, **kwargs)
        except TemplateError as exc:
            raise BadRequest(
                f"the chat template rejected 'messages': {exc}", "messages", "invalid_messages"
            ) from None
        except RecursionError:
            field = "tools" if kwargs.get("tools") else "messages"
            raise BadRequest(f"'{field}' is nested too deeply", field, "invalid_value") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # the template met a value of a shape it does not handle (e.g. a tool as a number)
            raise BadRequest(
                f"the chat template could not render this request: {exc!r}",
                "messages",
                "invalid_messages",
            ) from None

    def render(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM renders for a chat body."""
        conv, tools = self.normalize(body)
        return self.render_conversation(conv, self.template_kwargs(body, tools))

    # -- tokens and hashes ----------------------------------------------------------------------


def _developer_as_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's conversion for templates without a developer role: developer turns become system
    turns, then all system turns merge into one at the front when one is not first."""
    out = []
    for m in conv:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        out.append(m)
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(out):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or texts:
            merge = True
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in c
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if c:
            texts.append(c)
    if not merge:
        return out
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]
