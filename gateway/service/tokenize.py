"""Exact prompt tokens and vLLM block hashes for a request, incrementally per session.

The chat template is rendered the way transformers renders it for vLLM (a sandboxed Jinja
environment with ``trim_blocks``/``lstrip_blocks``, ``tojson``, ``raise_exception``), then
encoded with the model's ``tokenizers`` tokenizer with ``add_special_tokens=False``; text content
parts are joined with newlines as vLLM does for string templates.

Incremental: for each session the previous rendered text, its token ids and the token offset of
every special-token boundary are kept. Special tokens are split out before BPE runs, so the text
after a boundary tokenizes independently of what precedes it: a new turn re-encodes only from the
last boundary inside the common text prefix, and re-hashes only new full blocks
(:class:`~gateway.core.block_hash.HashChain`). Bounded: at most ``capacity`` sessions are cached
(LRU).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.core.block_hash import HashChain, common_prefix_len
from gateway.errors import ApiError


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


@dataclass(slots=True)
class _Cached:
    text: str
    bounds: list[tuple[int, int]]
    """(char offset, token offset) of each special-token start, ascending."""
    chain: HashChain


@dataclass(frozen=True, slots=True)
class PromptInfo:
    num_tokens: int
    hashes: list[int]
    """External block hashes of the full blocks."""
    encoded_tokens: int
    """Tokens actually encoded for this request (the incremental cost)."""


class ChatTokenizer:
    def __init__(
        self, model_dir: str | Path, block_size: int, hash_seed: str | None, capacity: int = 4096
    ) -> None:
        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        tfile = d / "chat_template.jinja"
        if template is None and tfile.exists():
            template = tfile.read_text()
        if not isinstance(template, str):
            raise ValueError(f"{d} has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template)
        self.special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
        self._special_ids = frozenset(
            i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        )
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.capacity = capacity
        self._cache: OrderedDict[str, _Cached] = OrderedDict()

    def render(self, body: dict[str, Any]) -> str:
        messages = []
        for m in body["messages"]:
            c = m.get("content")
            if isinstance(c, list):
                c = "\n".join(p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
            messages.append({**m, "content": c})
        kwargs = dict(body.get("chat_template_kwargs") or {})
        try:
            return self.template.render(
                messages=messages,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                **self.special,
                **kwargs,
            )
        except TemplateError as exc:
            raise ApiError(
                400, f"the chat template rejected 'messages': {exc}", "messages", "invalid_messages"
            ) from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # the template met a value of a shape it does not handle (e.g. a tool as a number)
            raise ApiError(
                400,
                f"the chat template could not render this request: {exc!r}",
                "messages",
                "invalid_messages",
            ) from None

    def prompt_info(self, kind: str, body: dict[str, Any], session_id: str | None) -> PromptInfo:
        if kind == "chat":
            text = self.render(body)
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return self._from_tokens(list(prompt), session_id)
            if not isinstance(prompt, str):
                prompt = (
                    prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else ""
                )
            text = prompt
        prev = self._cache.pop(session_id, None) if session_id else None
        base_char, base_tok = 0, 0
        if prev is not None:
            keep_chars = common_prefix_len(prev.text, text)
            nb = 0
            for b in prev.bounds:
                if b[0] > keep_chars:
                    break
                base_char, base_tok = b
                nb += 1
            bounds = prev.bounds
            del bounds[max(0, nb - 1) :]  # the boundary we restart from is found again below
            chain = prev.chain
        else:
            bounds = []
            chain = HashChain(self.block_size, self.hash_seed, body.get("cache_salt"))
        enc = self.tokenizer.encode(text[base_char:], add_special_tokens=False)
        ids = enc.ids
        special = self._special_ids
        offsets = enc.offsets
        bounds += [(base_char + offsets[i][0], base_tok + i) for i, t in enumerate(ids) if t in special]
        chain.replace_tail(base_tok, ids)
        tokens = chain.tokens
        if session_id:
            self._remember(session_id, _Cached(text, bounds, chain))
        return PromptInfo(len(tokens), list(chain.hashes), len(ids))

    def _from_tokens(self, tokens: list[int], session_id: str | None) -> PromptInfo:
        chain = HashChain(self.block_size, self.hash_seed)
        chain.update(tokens)
        return PromptInfo(len(tokens), list(chain.hashes), len(tokens))

    def _remember(self, session_id: str, entry: _Cached) -> None:
        self._cache[session_id] = entry
        self._cache.move_to_end(session_id)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    def session_tokens(self, session_id: str) -> list[int] | None:
        """The last prompt's token ids of a session (a copy), if cached."""
        entry = self._cache.get(session_id)
        return list(entry.chain.tokens) if entry is not None else None

    def forget(self, session_id: str) -> None:
        self._cache.pop(session_id, None)
