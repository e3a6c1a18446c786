"""Exact prompt tokens and vLLM block hashes for a request, reused by content across requests.

The prompt text comes from :class:`~gateway.analysis.chat_render.ChatRenderer` (vLLM 0.32's
normalisation and the model's chat template); it is encoded with the model's ``tokenizers``
tokenizer with ``add_special_tokens=False`` (a completions prompt gets the tokenizer's prefix,
as vLLM encodes it with ``add_special_tokens=True``), and hashed with vLLM's block-hash chain.

**Content-keyed incremental cache.** A request's key chain is ``k_0 = H(kind, tools, template
kwargs, cache_salt)``, ``k_i = hash(k_{i-1}, sketch(message_i))`` (a sketch reads a long string
by its length, head and tail, so keying costs O(messages), not O(text); wherever a cached answer
or render is reused the messages themselves are compared; a completions prompt is cut in
fixed-size chunks instead of messages, keyed whole). Every cached entry (rendered text, token ids as an
``array``, special-token boundaries, raw block hashes) is findable under each of its keys, so a
request whose first ``i`` messages equal a cached entry's (the next turn of a session, another
session with the same system prompt and tools, a turn that was served by another replica) starts
from that entry; a request whose whole chain ends at an entry's last key is that entry's prompt
and is answered from it without rendering (unless the template reads the date). A request that
extends an entry's whole conversation by new messages (an agent's next turn) renders only those:
the entry's render without its generation prompt, then what the new messages add to a short
stand-in of the old ones (:meth:`ChatTokenizer._stitch`; checked against whole renders on a probe
at start-up and on a sample of live turns, off for good on the first difference). Otherwise only
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
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cbor2
import orjson
from tokenizers import Tokenizer

from gateway.analysis.chat_render import SPECIAL_TOKEN_NAMES, ChatRenderer, Unsupported
from gateway.analysis.fast_bpe import PROBE_TEXTS, FastBPE, _native
from gateway.core.block_hash import common_prefix_len, external, hash_block, none_hash, salt_keys
from gateway.errors import BadRequest

__all__ = ["DEFAULT_CACHE_BYTES", "ChatTokenizer", "PromptInfo", "Unsupported", "affinity_key"]

DEFAULT_CACHE_BYTES = 512 * 1024 * 1024
_CBOR_NONE = b"\xf6"


def _openssl_sha256() -> int:
    """The address of OpenSSL's one-shot ``SHA256()`` in the libcrypto that hashlib runs on (the
    native chain hash calls it), once it gave hashlib's digest on a probe; 0 when not found."""
    if _native is None or not hasattr(_native, "chain_hashes"):
        return 0
    try:
        import _hashlib
        import ctypes

        fn = ctypes.CDLL(_hashlib.__file__).SHA256
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
        probe, out = b"agentgw block hash probe", ctypes.create_string_buffer(32)
        fn(probe, len(probe), out)
        if out.raw != hashlib.sha256(probe).digest():
            return 0
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    except (ImportError, OSError, AttributeError):
        return 0


_SHA256 = _openssl_sha256()
"""Nonzero: block hashes are chained in C, one call per prompt (:meth:`ChatTokenizer._hash`)."""
PROMPT_CHUNK_CHARS = 4096
"""A completions prompt is keyed in chunks of this many characters."""
TOKEN_CHUNK = 2048
"""A token-id prompt is keyed in chunks of this many tokens."""
RENDER_CHECK_FIRST = 8
RENDER_CHECK_EVERY = 64
"""The first ``RENDER_CHECK_FIRST`` incremental renders, then one in ``RENDER_CHECK_EVERY``, are
also rendered whole and compared."""
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
    keys: list[Hashable]
    conv: list[dict[str, Any]] | None = None
    """The normalised messages the text renders (chat entries)."""
    bare: int = -1
    """Length of the render of :attr:`conv` without the generation prompt, a prefix of
    :attr:`text` (-1: unknown): where the next turn's new messages start."""
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
        raise BadRequest(f"'{param}' is nested too deeply", param, "invalid_value") from None
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"'{param}' is not valid JSON: {exc}", param, "invalid_value") from None


SKETCH_CHARS = 256
"""A message's key reads strings longer than this by their length, head and tail only."""


def _sketch(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every string longer than :data:`SKETCH_CHARS` replaced by its length, first
    and last 64 characters: a message's key costs O(structure), not O(text). Two messages with
    the same sketch are told apart by comparing them wherever a cached answer or render is
    reused."""
    if isinstance(obj, str):
        if len(obj) <= SKETCH_CHARS:
            return obj
        return f"\0{len(obj)}\0{obj[:64]}\0{obj[-64:]}"
    if depth > 64:
        return obj  # deeper structures are dumped whole (and refused past orjson's limit)
    if isinstance(obj, dict):
        return {k: _sketch(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_sketch(v, depth + 1) for v in obj]
    return obj


def _message_keys(root: bytes, conv: list[dict[str, Any]]) -> list[Hashable]:
    """The key chain of a conversation: ``k_i = hash((k_{i-1}, message i's sketch))``, Python's
    own hash of a tuple (this process's cache only; a collision costs a comparison, never a wrong
    answer). A string field longer than :data:`SKETCH_CHARS` enters as its length, head and tail;
    a structured one (tool calls, content parts) as the JSON of its :func:`_sketch`."""
    k: Hashable = int.from_bytes(root[:8], "big")
    keys = [k]
    for i, m in enumerate(conv):
        parts: list[Any] = [k]
        for name, v in m.items():
            if isinstance(v, str):
                parts += (name, len(v), v[:64], v[-64:]) if len(v) > SKETCH_CHARS else (name, v)
            elif v is None or isinstance(v, (bool, int, float)):
                parts += (name, v)
            else:
                parts += (name, _dumps(_sketch(v), f"messages[{i}].{name}"))
        k = hash(tuple(parts))
        keys.append(k)
    return keys


def _chain(root: bytes, parts: Iterator[bytes]) -> list[Hashable]:
    keys: list[Hashable] = [root]
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


def _stitch_probe_bodies() -> list[dict[str, Any]]:
    """Agent conversations the incremental render is checked on at start-up: system prompt or
    none, tool calls with and without content, consecutive tool results, reasoning, content
    parts, a developer turn; with and without tools."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]

    def call(i: int) -> dict[str, Any]:
        args = f'{{"path": "src/f{i}.py"}}'
        return {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": args}}

    sys_ = {"role": "system", "content": "You are a coding agent. Be brief."}
    u = [
        {"role": "user", "content": f"Step {i}: fix the failing test in f{i}.py, then run it."}
        for i in range(4)
    ]
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "Here is"}, {"type": "text", "text": "more."}],
    }
    a_call = {"role": "assistant", "content": None, "tool_calls": [call(1)]}
    a_both = {"role": "assistant", "content": "Reading two files.", "tool_calls": [call(2), call(3)]}
    t = [
        {"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f{i}():\n    return {i}\n"}
        for i in range(4)
    ]
    a_text = {"role": "assistant", "content": "Fixed: the test passes now."}
    a_think = {"role": "assistant", "content": "Done.", "reasoning_content": "The test expects 2."}
    dev = {"role": "developer", "content": "Prefer small diffs."}
    convs = [
        [sys_, u[0], a_call, t[1], a_both, t[2], t[3], a_text, u[1], a_think, u[2]],
        [u[0], a_text, u[1], a_think, parts, a_call, t[1], u[2], a_text, u[3]],
        [sys_, u[0], a_think, u[1], a_text, u[2], a_both, t[2], t[3], u[3]],
        [sys_, dev, u[0], a_call, t[1], a_text, parts, a_think, u[1]],
    ]
    out: list[dict[str, Any]] = []
    for c in convs:
        out.append({"messages": c})
        out.append({"messages": c, "tools": tools})
    return out


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
        self._index: dict[Hashable, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.exact_hits = 0
        """Requests answered from an entry with their whole key chain (no render, no encode)."""
        self.incremental = self._splits_at_special_tokens()
        """Whether text after a special token encodes independently of the text before it (true of
        byte-level BPE; checked on a probe at start-up, else every prompt is encoded whole)."""
        self._gen_prompt: str | None = None
        """What the generation prompt appends to a render (from the probe), when constant."""
        self.stitched = 0
        """Renders of a turn that extends a cached conversation, done incrementally."""
        self.stitch_checks = 0
        self.stitch_misses = 0
        """Turns rendered whole because the stand-in's render changed when new messages followed."""
        self.stitch_mismatches = 0
        self.stitch = True
        self.stitch_reason = self._probe_stitch()
        self.stitch = not self.stitch_reason
        self.stitched = self.stitch_misses = self.stitch_checks = 0
        """Whether a turn that extends a cached conversation renders only its new messages
        (:meth:`_stitch`); :attr:`stitch_reason` says why not."""
        if self.stitch_reason:
            log.info("%s: rendering every prompt whole (%s)", d, self.stitch_reason)
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

    # -- incremental rendering ------------------------------------------------------------------
    def _stitch(self, prev: _Entry, conv: list[dict[str, Any]], kwargs: dict[str, Any]) -> str | None:
        """The render of ``conv``, which extends ``prev``'s conversation P by new messages S,
        without rendering P again: P's render without the generation prompt (a prefix of the
        cached text) + what S adds to a short stand-in K of P (its first message and its last one
        or two, so that S's messages keep their neighbour and the parity of their index). None
        (render it whole) when this does not apply; checked against a whole render at start-up
        (:meth:`_probe_stitch`) and on a sample of live renders (the first disagreement turns it
        off for good)."""
        p = prev.conv
        if p is None or prev.bare < 0:
            return None
        n = len(p)
        m = 1 if n % 2 == 0 else 2
        if n < 1 + m:
            return None
        stand_in = [p[0], *p[n - m :]]
        r = self.renderer
        try:
            a = r.render_conversation(stand_in, {**kwargs, "add_generation_prompt": False})
            b = r.render_conversation([*stand_in, *conv[n:]], kwargs)
        except BadRequest:
            return None  # the whole render says what is wrong with it
        if not b.startswith(a):
            self.stitch_misses += 1
            return None  # the template changes how K (so P) ends when S follows: not append-only
        text = prev.text[: prev.bare] + b[len(a) :]
        k = self.stitched = self.stitched + 1
        if k > RENDER_CHECK_FIRST and k % RENDER_CHECK_EVERY:
            return text
        self.stitch_checks += 1
        whole = r.render_conversation(conv, kwargs)
        if whole == text:
            return text
        self.stitch_mismatches += 1
        self.stitch, self.stitch_reason = False, "differed from a whole render on a live prompt"
        log.warning(
            "incremental render differs from the whole render at char %d: rendering whole from now on",
            common_prefix_len(whole, text),  # type: ignore[arg-type]  # str is fine
        )
        return whole

    def _probe_stitch(self) -> str:
        """'' when stitched renders equal whole ones on a probe of agent conversations (every
        split, with and without tools and generation prompt), else why not. Sets
        :attr:`_gen_prompt`, the text the generation prompt appends."""
        if not self.render_is_pure:
            return "the template reads the date"
        r = self.renderer
        bodies = _stitch_probe_bodies()
        gen: set[str] = set()
        convs = []
        for body in bodies:
            try:
                conv, tools = r.normalize(body)
                kw = r.template_kwargs(body, tools)
                on = r.render_conversation(conv, {**kw, "add_generation_prompt": True})
                off = r.render_conversation(conv, {**kw, "add_generation_prompt": False})
            except (BadRequest, Unsupported):
                continue  # a shape this template refuses
            if not on.startswith(off):
                return "the generation prompt is not appended at the end"
            gen.add(on[len(off) :])
            convs.append((conv, kw))
        if len(gen) != 1 or len(convs) < len(bodies) // 2:
            return "the generation prompt varies" if len(gen) > 1 else "the template refuses the probe"
        self._gen_prompt = gen.pop()
        tried = 0
        for conv, kw in convs:
            for agp in (True, False):
                kwargs = {**kw, "add_generation_prompt": agp}
                whole = r.render_conversation(conv, kwargs)
                for n in range(2, len(conv)):
                    try:
                        bare = r.render_conversation(conv[:n], {**kw, "add_generation_prompt": False})
                    except BadRequest:
                        continue
                    prev = _Entry(
                        bare, array("i"), array("q"), array("q"), array("q"), [], [], [], conv[:n], len(bare)
                    )
                    self.stitch, self.stitched = True, RENDER_CHECK_FIRST  # no live check inside
                    got = self._stitch(prev, conv, kwargs)
                    tried += 1
                    if got is not None and got != whole:
                        return f"a stitched render differs from the whole one ({len(conv)} messages, split at {n})"
        if self.stitch_misses * 2 > tried:  # mostly rendered whole anyway, at twice the cost
            return "the template renders the end of a conversation differently once messages follow"
        return ""

    def _special_texts(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def _encode(self, text: str) -> tuple[Sequence[int], list[tuple[int, int, int]]]:
        """Token ids of ``text`` (no special tokens added; an ``array("i")`` or a list) and
        (token index, char start, char end) of each special token in it."""
        fast = self.fast
        if fast is not None:
            arr, specials = fast.encode_array(text)
            n = self.fast_encodes = self.fast_encodes + 1
            if n > FAST_CHECK_FIRST and n % FAST_CHECK_EVERY:
                return arr, specials
            self.fast_checks += 1
            ref = self.tokenizer.encode(text, add_special_tokens=False).ids
            ids = arr.tolist()
            if ref == ids:
                return arr, specials
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
        """Token ids and block hashes of a chat or completions body. Raises
        :class:`~gateway.errors.BadRequest` for a body the template rejects and
        :class:`Unsupported` when not exact.
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
            keys = _message_keys(root, conv)
            hit = self._exact(keys[-1], conv) if self.render_is_pure else None
            if hit is not None:
                return hit
            prev, matched = self._lookup(keys)
            text = None
            if (
                prev is not None
                and matched == len(prev.keys) - 1 < len(conv)
                and self.stitch
                and prev.conv == conv[:matched]  # the keys are sketches: compare the messages
            ):
                text = self._stitch(prev, conv, kwargs)
            if text is None:
                text = r.render_conversation(conv, kwargs)
            if not kwargs["add_generation_prompt"]:
                bare = len(text)
            elif self._gen_prompt is not None and text.endswith(self._gen_prompt):
                bare = len(text) - len(self._gen_prompt)
            else:
                bare = -1
            return self._from_text(text, keys, salt, (), prev, conv, bare)
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
        return self._exact(keys[-1]) or self._from_text(
            prompt, keys, salt, self._prompt_prefix, self._lookup(keys)[0]
        )

    def _exact(self, key: Hashable, conv: list[dict[str, Any]] | None = None) -> PromptInfo | None:
        """The cached answer of a request whose whole key chain ends in ``key`` (the same
        conversation, tools, template kwargs and salt as a cached entry: the same prompt text),
        without rendering or encoding; None when no entry ends there. ``conv``: the request's
        messages, compared with the entry's (chat keys are sketches)."""
        with self._lock:
            e = self._index.get(key)
            if e is None or e.keys[-1] != key:
                return None
            self._entries.move_to_end(id(e))
        if conv is not None and e.conv != conv:
            return None
        self.exact_hits += 1
        return PromptInfo(len(e.tokens), list(e.hashes), 0, e.tokens)

    def _lookup(self, keys: list[Hashable]) -> tuple[_Entry | None, int]:
        """The entry holding the longest prefix of ``keys``, and that prefix's last index."""
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                e = self._index.get(keys[i])
                if e is not None:
                    self._entries.move_to_end(id(e))
                    return e, i
        return None, -1

    def _from_text(
        self,
        text: str,
        keys: list[Hashable],
        salt: str | None,
        prefix: Sequence[int],
        prev: _Entry | None,
        conv: list[dict[str, Any]] | None = None,
        bare: int = -1,
    ) -> PromptInfo:
        if not self.incremental:
            prev = None
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
        self._store(_Entry(text, tokens, starts, ends, toks, raw, hashes, keys, conv, bare))
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
        if _SHA256 and _native is not None and isinstance(tokens, array) and len(tokens) // bs > keep:
            # the whole chain in one C call: CBOR and OpenSSL's sha256, no Python per block
            extra0 = cbor2.dumps(salt_keys(salt), canonical=True) if salt else _CBOR_NONE
            more_raw, more = _native.chain_hashes(
                _SHA256, parent or self._none, tokens, keep, len(tokens) // bs, bs, extra0, _CBOR_NONE
            )
            raw.extend(more_raw)
            hashes.extend(more)
            return raw, hashes
        if _native is not None and isinstance(tokens, array):
            # the same sha256 over the same canonical CBOR, encoded in C
            none, sha, cbor = self._none, hashlib.sha256, _native.cbor_block
            for i in range(keep, len(tokens) // bs):
                extra = _CBOR_NONE if not (i == 0 and salt) else cbor2.dumps(salt_keys(salt), canonical=True)
                parent = sha(cbor(parent or none, tokens, i * bs, (i + 1) * bs, extra)).digest()
                raw.append(parent)
                hashes.append(int.from_bytes(parent[24:], "big"))
            return raw, hashes
        for i in range(keep, len(tokens) // bs):
            extra_keys = salt_keys(salt) if i == 0 else None
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], self._none, extra_keys)
            raw.append(parent)
            hashes.append(external(parent))
        return raw, hashes

    def _from_tokens(self, prompt: list[int], salt: str | None) -> PromptInfo:
        tokens = array("i")
        try:
            tokens.extend(prompt)
        except (TypeError, OverflowError):
            raise BadRequest("'prompt' token ids must be integers", "prompt", "invalid_value") from None
        root = _h(b"ids\0" + _dumps(salt, "cache_salt"))
        step = TOKEN_CHUNK
        keys = _chain(root, (_h(tokens[i : i + step].tobytes()) for i in range(0, len(tokens), step)))
        prev, _ = self._lookup(keys)
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
            + (sys.getsizeof(e.text) + 400 * len(e.conv) if e.conv is not None else 0)
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
