"""Exact prompt tokens and vLLM block hashes for a request, reused by content across requests.

The prompt text comes from :class:`~gateway.analysis.chat_render.ChatRenderer` (vLLM 0.32's
normalisation and the model's chat template); it is encoded with the model's ``tokenizers``
tokenizer with ``add_special_tokens=False`` (a completions prompt gets the tokenizer's prefix,
as vLLM encodes it with ``add_special_tokens=True``), and hashed with vLLM's block-hash chain.

**Content-keyed incremental cache.** A request's key chain is ``k_0 = H(kind, tools, template
kwargs, cache_salt)``, ``k_i = H(k_{i-1}, H(message_i))`` (a completions prompt is cut in
fixed-size chunks instead of messages). Every cached entry (rendered text, token ids as an
``array``, special-token boundaries, raw block hashes) is findable under each of its keys, so a
request whose first ``i`` messages equal a cached entry's (the next turn of a session, another
session with the same system prompt and tools, a turn that was served by another replica) starts
from that entry; a request whose whole chain ends at an entry's last key is that entry's prompt
and is answered from it without rendering (unless the template reads the date). Otherwise only
the longest common *text* prefix is trusted, and only up to the last
special token lying wholly inside it: special tokens are split out before BPE runs, so the text
after one tokenizes independently of what precedes it (checked on a probe at start-up). Only new
full blocks are hashed. Entries are immutable once stored (a new request builds new arrays), so
a :attr:`PromptInfo.tokens` handed out stays valid. When a newer entry takes over every key of
an older one (the next turn of the same conversation) the older one is dropped. Bounded by bytes
(``cache_bytes``), LRU. Thread-safe: one lock guards the index; encoding and hashing run outside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer

from gateway.analysis.chat_render import SPECIAL_TOKEN_NAMES, ChatRenderer, Unsupported
from gateway.analysis.fast_bpe import PROBE_TEXTS, FastBPE
from gateway.core.block_hash import common_prefix_len, external, hash_block, none_hash
from gateway.errors import ApiError

__all__ = ["DEFAULT_CACHE_BYTES", "ChatTokenizer", "PromptInfo", "Unsupported", "affinity_key"]

DEFAULT_CACHE_BYTES = 512 * 1024 * 1024
PROMPT_CHUNK_CHARS = 4096
"""A completions prompt is keyed in chunks of this many characters."""
TOKEN_CHUNK = 2048
"""A token-id prompt is keyed in chunks of this many tokens."""
FAST_CHECK_FIRST = 8
FAST_CHECK_EVERY = 128
"""The first ``FAST_CHECK_FIRST`` fast encodes, then one in ``FAST_CHECK_EVERY``, are also
encoded by the model's tokenizer and compared."""

log = logging.getLogger(__name__)

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)


@dataclass(frozen=True, slots=True)
class PromptInfo:
    num_tokens: int
    hashes: list[int]
    """External block hashes of the full blocks."""
    encoded_tokens: int
    """Tokens actually encoded for this request (the incremental cost)."""
    tokens: Sequence[int] = ()
    """The prompt's token ids (an ``array``; shared with the cache: never mutate it)."""


@dataclass(slots=True)
class _Entry:
    text: str
    tokens: array[int]
    bound_starts: array[int]
    """Char offset of each special token's start (the first bound is a pseudo one at 0)."""
    bound_ends: array[int]
    """Char offset of each special token's end, ascending."""
    bound_toks: array[int]
    """Token offset of each special token."""
    raw: list[bytes]
    hashes: list[int]
    keys: list[bytes]
    nbytes: int = 0
    live: int = 0
    """How many keys of the index still point at this entry."""


# -- hashing of content ---------------------------------------------------------------------------


def _h(data: bytes) -> bytes:
    """A content key (in this process's cache only, never shared or stored): SHA-256 cut to 16
    bytes, which runs on the CPU's SHA extensions where BLAKE2b does not (647 KB: ~0.85 ms
    against ~1.7 ms on the dev machine)."""
    return hashlib.sha256(data).digest()[:16]


def _dumps(obj: Any, param: str) -> bytes:
    """Canonical-enough bytes of a JSON value (key order kept: templates see it)."""
    try:
        return orjson.dumps(obj)
    except (orjson.JSONEncodeError, TypeError):
        pass  # deeper than orjson's 255 levels, or an int beyond 64 bits
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    except RecursionError:
        raise ApiError(400, f"'{param}' is nested too deeply", param, "invalid_value") from None
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"'{param}' is not valid JSON: {exc}", param, "invalid_value") from None


def _chain(root: bytes, parts: Iterator[bytes]) -> list[bytes]:
    keys = [root]
    k = root
    for d in parts:
        k = _h(k + d)
        keys.append(k)
    return keys


def affinity_key(kind: str, body: dict[str, Any]) -> bytes:
    """A cheap key of the start of a prompt (first message or first chunk, tool names), to send
    requests that share a beginning to the same worker, whose content-keyed cache then holds it.
    Never recursive: a body nested 1,000 deep costs what a flat one does."""
    if kind == "chat":
        msgs = body.get("messages")
        first = msgs[0] if isinstance(msgs, list) and msgs else None
        c = first.get("content") if isinstance(first, dict) else None
        if isinstance(c, list):
            c = "\n".join(t for p in c[:16] if isinstance(p, dict) and isinstance(t := p.get("text"), str))
        data = c[:4096] if isinstance(c, str) else ""
        tools = body.get("tools")
        for t in tools[:64] if isinstance(tools, list) else ():
            fn = t.get("function") if isinstance(t, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            data += "\0" + (name if isinstance(name, str) else "")
        return _h(data.encode("utf-8", "surrogatepass"))
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return _h(p[:PROMPT_CHUNK_CHARS].encode("utf-8", "surrogatepass"))
    ids = [t for t in p[:TOKEN_CHUNK] if isinstance(t, int)] if isinstance(p, list) else []
    return _h(repr(ids).encode())


class ChatTokenizer:
    """One model's renderer, tokenizer and content-keyed cache of token ids and block hashes."""

    def __init__(
        self,
        model_dir: str | Path,
        block_size: int,
        hash_seed: str | None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        fast_bpe: bool = True,
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
        special: dict[str, str] = {}
        for k in SPECIAL_TOKEN_NAMES:
            v = cfg.get(k)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                special[k] = v
        self.renderer = ChatRenderer(template, special)
        self.render_is_pure = "strftime_now" not in template
        """The render depends on the conversation and its kwargs only (no date in the template),
        so a request whose whole key chain equals a cached entry's reuses it without rendering."""
        self._special_ids = frozenset(
            i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        )
        with_sp = self.tokenizer.encode("a", add_special_tokens=True).ids
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        cut = with_sp.index(plain[0]) if plain and plain[0] in with_sp else 0
        self._prompt_prefix = with_sp[:cut] if with_sp[cut:] == plain else None
        """Token ids a completions prompt starts with (vLLM's add_special_tokens=True), or None
        when the tokenizer adds anything but a prefix."""
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._none = none_hash(hash_seed)
        self.cache_bytes = cache_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[bytes, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.exact_hits = 0
        """Requests answered from an entry with their whole key chain (no render, no encode)."""
        self.incremental = self._splits_at_special_tokens()
        """Whether text after a special token encodes independently of the text before it (true of
        byte-level BPE; checked on a probe at start-up, else every prompt is encoded whole)."""
        self.fast: FastBPE | None = None
        """The tiktoken-core encoder when it reproduces this tokenizer (gateway/analysis/fast_bpe.py)."""
        self.fast_reason = "off in config"
        """Why :attr:`fast` is None ('' when it is set)."""
        self.fast_encodes = 0
        self.fast_checks = 0
        self.fast_mismatches = 0
        if fast_bpe:
            fast, self.fast_reason = FastBPE.from_tokenizer_json(d / "tokenizer.json")
            if fast is not None:
                mixed = "".join(f"{a}x {a}\n{b}" for a in self._special_texts() for b in PROBE_TEXTS[:2])
                bad = fast.check(self.tokenizer, [template, mixed])
                self.fast_reason = f"differs from the tokenizer on {bad!r}" if bad else ""
                self.fast = None if bad else fast
            if self.fast is None:
                log.info("%s: encoding with tokenizers (fast BPE not used: %s)", d, self.fast_reason)

    def _special_texts(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Token ids of ``text`` (no special tokens added) and (token index, char start, char
        end) of each special token in it."""
        fast = self.fast
        if fast is not None:
            ids, specials = fast.encode(text)
            n = self.fast_encodes = self.fast_encodes + 1
            if n > FAST_CHECK_FIRST and n % FAST_CHECK_EVERY:
                return ids, specials
            self.fast_checks += 1
            ref = self.tokenizer.encode(text, add_special_tokens=False).ids
            if ref == ids:
                return ids, specials
            self.fast_mismatches += 1
            self.fast, self.fast_reason = None, "disagreed with the tokenizer on a live prompt"
            i = common_prefix_len(ids, ref)
            log.warning(
                "fast BPE disagrees with the tokenizer at token %d of %d (%r vs %r): using the tokenizer",
                i,
                len(ref),
                ids[i : i + 4],
                ref[i : i + 4],
            )
        # encode_batch releases the GIL while it runs (encode does not)
        enc = self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
        ids = enc.ids
        out = []
        for i in self._special_positions(ids):
            a, b = enc.token_to_chars(i) or (0, 0)
            out.append((i, a, b))
        return ids, out

    def _splits_at_special_tokens(self) -> bool:
        added = self._special_texts()
        if not added:
            return False
        probe_a, probe_b = "Hello, world.\n  x = 1 ", " déjà vu\n\nEnd"
        whole = self.tokenizer.encode(probe_a + added[0] + probe_b, add_special_tokens=False).ids
        first = self.tokenizer.encode(probe_a, add_special_tokens=False).ids
        rest = self.tokenizer.encode(added[0] + probe_b, add_special_tokens=False).ids
        return whole == first + rest

    def render(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM renders for a chat body."""
        return self.renderer.render(body)

    def prompt_info(self, kind: str, body: dict[str, Any], session_id: str | None = None) -> PromptInfo:
        """Token ids and block hashes of a chat or completions body. Raises :class:`ApiError`
        (400) for a body the template rejects and :class:`Unsupported` when not exact.
        ``session_id`` is accepted for older callers and ignored: reuse is by content."""
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        if kind == "chat":
            r = self.renderer
            conv, tools = r.normalize(body)
            kwargs = r.template_kwargs(body, tools)
            rest = {k: v for k, v in kwargs.items() if k != "tools"}
            root = _h(
                b"chat\0"
                + _dumps(kwargs.get("tools"), "tools")
                + _dumps([rest, salt], "chat_template_kwargs")
            )
            keys = _chain(root, (_h(_dumps(m, f"messages[{i}]")) for i, m in enumerate(conv)))
            hit = self._exact(keys[-1]) if self.render_is_pure else None
            if hit is not None:
                return hit
            text = r.render_conversation(conv, kwargs)
            return self._from_text(text, keys, salt, ())
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return self._from_tokens(prompt, salt)
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        if not isinstance(prompt, str):
            prompt = ""
        if self._prompt_prefix is None:
            raise Unsupported("the tokenizer adds special tokens after a prompt")
        step = PROMPT_CHUNK_CHARS
        root = _h(b"text\0" + _dumps(salt, "cache_salt"))
        chunks = (
            _h(prompt[i : i + step].encode("utf-8", "surrogatepass")) for i in range(0, len(prompt), step)
        )
        keys = _chain(root, chunks)
        return self._exact(keys[-1]) or self._from_text(prompt, keys, salt, self._prompt_prefix)

    def _exact(self, key: bytes) -> PromptInfo | None:
        """The cached answer of a request whose whole key chain ends in ``key`` (the same
        conversation, tools, template kwargs and salt as a cached entry: the same prompt text),
        without rendering, comparing or encoding; None when no entry ends there."""
        with self._lock:
            e = self._index.get(key)
            if e is None or e.keys[-1] != key:
                return None
            self._entries.move_to_end(id(e))
        self.exact_hits += 1
        return PromptInfo(len(e.tokens), list(e.hashes), 0, e.tokens)

    def _lookup(self, keys: list[bytes]) -> _Entry | None:
        with self._lock:
            for k in reversed(keys):
                e = self._index.get(k)
                if e is not None:
                    self._entries.move_to_end(id(e))
                    return e
        return None

    def _from_text(self, text: str, keys: list[bytes], salt: str | None, prefix: Sequence[int]) -> PromptInfo:
        prev = self._lookup(keys) if self.incremental else None
        if prev is not None:
            keep_chars = common_prefix_len(prev.text, text)  # type: ignore[arg-type]  # str is fine
            # restart at the last special token lying wholly inside the common text: the new text
            # has it too, so the text before it was a segment of its own in both
            nb = bisect_right(prev.bound_ends, keep_chars)  # >= 1: the pseudo bound ends at 0
            base_char, base_tok = prev.bound_starts[nb - 1], prev.bound_toks[nb - 1]
            starts, ends, toks = (
                prev.bound_starts[: nb - 1],
                prev.bound_ends[: nb - 1],
                prev.bound_toks[: nb - 1],
            )
            tokens = prev.tokens[:base_tok]
        else:
            base_char, base_tok = 0, len(prefix)
            starts, ends, toks = array("q"), array("q"), array("q")
            tokens = array("i", prefix)
        ids, specials = self._encode(text[base_char:])
        if not starts:
            starts.append(0)
            ends.append(0)
            toks.append(len(prefix))
        for i, a, b in specials:
            starts.append(base_char + a)
            ends.append(base_char + b)
            toks.append(base_tok + i)
        tokens.extend(ids)
        raw, hashes = self._hash(tokens, prev, base_tok, salt)
        self._store(_Entry(text, tokens, starts, ends, toks, raw, hashes, keys))
        return PromptInfo(len(tokens), list(hashes), len(ids), tokens)

    def _special_positions(self, ids: list[int]) -> list[int]:
        """Indices of the special tokens in ``ids``, ascending (one C scan per special id)."""
        out: list[int] = []
        present = self._special_ids.intersection(ids) if len(self._special_ids) < 64 else self._special_ids
        for sid in present:
            i = -1
            try:
                while True:
                    i = ids.index(sid, i + 1)
                    out.append(i)
            except ValueError:
                pass
        out.sort()
        return out

    def _hash(
        self, tokens: array[int], prev: _Entry | None, start: int, salt: str | None
    ) -> tuple[list[bytes], list[int]]:
        bs = self.block_size
        keep = 0
        if prev is not None:
            keep = min(len(prev.raw), (start + common_prefix_len(prev.tokens[start:], tokens[start:])) // bs)
        raw, hashes = prev.raw[:keep] if prev else [], prev.hashes[:keep] if prev else []
        parent = raw[-1] if raw else None
        for i in range(keep, len(tokens) // bs):
            extra = (salt,) if (i == 0 and salt) else None
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], self._none, extra)
            raw.append(parent)
            hashes.append(external(parent))
        return raw, hashes

    def _from_tokens(self, prompt: list[int], salt: str | None) -> PromptInfo:
        tokens = array("i")
        try:
            tokens.extend(prompt)
        except (TypeError, OverflowError):
            raise ApiError(400, "'prompt' token ids must be integers", "prompt", "invalid_value") from None
        root = _h(b"ids\0" + _dumps(salt, "cache_salt"))
        step = TOKEN_CHUNK
        keys = _chain(root, (_h(tokens[i : i + step].tobytes()) for i in range(0, len(tokens), step)))
        prev = self._lookup(keys)
        raw, hashes = self._hash(tokens, prev, 0, salt)
        new_blocks = len(hashes) - (min(len(prev.raw), len(hashes)) if prev else 0)
        zero = array("q", [0])
        self._store(_Entry("", tokens, zero, zero, zero, raw, hashes, keys))
        return PromptInfo(len(tokens), list(hashes), new_blocks * self.block_size, tokens)

    # -- the bounded index ----------------------------------------------------------------------
    @staticmethod
    def _size(e: _Entry) -> int:
        return (
            sys.getsizeof(e.text)
            + e.tokens.itemsize * len(e.tokens)
            + 24 * len(e.bound_toks)
            + 120 * len(e.raw)
            + 130 * len(e.keys)
            + 400
        )

    def _store(self, e: _Entry) -> None:
        e.nbytes = self._size(e)
        if e.nbytes > self.cache_bytes:
            return
        with self._lock:
            self._entries[id(e)] = e
            for k in e.keys:
                old = self._index.get(k)
                if old is not None:
                    old.live -= 1
                    if old.live <= 0:
                        self._drop(old)  # a newer entry took over every key (the next turn)
                self._index[k] = e
                e.live += 1
            self._bytes += e.nbytes
            while self._bytes > self.cache_bytes and self._entries:
                self._drop(next(iter(self._entries.values())))

    def _drop(self, e: _Entry) -> None:
        """Remove an entry (the lock is held)."""
        if self._entries.pop(id(e), None) is None:
            return
        self._bytes -= e.nbytes
        for k in e.keys:
            if self._index.get(k) is e:
                del self._index[k]

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    @property
    def cached_entries(self) -> int:
        return len(self._entries)
