"""A faster encoder for byte-level BPE tokenizers, checked against the model's own tokenizer.

Hugging Face ``tokenizers`` spends ~1.4 us a token on this machine, most of it in its pipeline
(normalisation, pre-tokenisation, offsets and alignments), not in the merges; an agent turn's
new ~3,400 tokens cost ~5-6 ms to encode, more CPU than vllm-router spends on a whole request.
``tiktoken``'s core runs the same two steps (a regex split, then byte-pair merges by rank) at
~0.3 us a token; the C encoder of gateway/analysis/_native.c (built at install when a C compiler
is there) runs them for GPT-2's, Llama 3's and Qwen 2's split regexes, scanned by hand, faster
again. :func:`FastBPE.from_tokenizer_json` builds one from a ``tokenizer.json`` when
its pipeline is one this encoder reproduces, and says why not otherwise:

- model ``BPE`` with no dropout, no unknown token, no byte fallback and no subword affixes;
- pre-tokenizer ``ByteLevel(use_regex=True)`` (GPT-2's pattern) or a ``Split`` on one regex
  (``Isolated``, not inverted) followed by ``ByteLevel(use_regex=False)`` (Llama 3, Qwen2), with
  no prefix space added;
- normaliser none or ``NFC``;
- added tokens matched as written (no ``lstrip`` / ``rstrip`` / ``single_word``, and not
  normalised when a normaliser is set).

Ranks are the merge order (a merged token's rank is the index of the merge that made it); when
the vocabulary's ids already follow that order (true of trained BPE files) the ranks are the ids
and no mapping runs. tiktoken merges any adjacent pair whose bytes form a token, Hugging Face
only the pairs listed as merges; on a vocabulary where the two differ they can disagree. So
the encoder is not trusted on its construction alone: :meth:`FastBPE.check` runs both on a
probe corpus at start-up (it is not used if they differ), and :class:`ChatTokenizer` keeps
checking a sample of live encodes against the model's tokenizer and drops the fast path for good
on the first disagreement (counted, logged).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import re
import unicodedata
from array import array
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

_native: ModuleType | None
"""The C extension (gateway/analysis/_native.c; no stub: its functions are typed Any)."""
try:
    _native = importlib.import_module("gateway.analysis._native")
except ImportError:  # not built (no C compiler at install): tiktoken's core does it all
    _native = None

__all__ = ["NATIVE_PATTERNS", "PROBE_TEXTS", "FastBPE"]

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""Hugging Face's ``ByteLevel`` pre-tokenizer regex (``use_regex=True``)."""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's ``Split`` regex."""
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
"""Qwen 2's ``Split`` regex (single digits)."""
NATIVE_PATTERNS = {GPT2_PATTERN: 0, LLAMA3_PATTERN: 1, QWEN2_PATTERN: 2}
"""The split regexes the C encoder (gateway/analysis/_native.c) scans by hand, by its kind."""
_WHITE_SPACE = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029]
_WHITE_SPACE += [0x202F, 0x205F, 0x3000]


@functools.cache
def _classes() -> bytes:
    """One byte per code point for the C encoder: 1 letter, 2 number, 4 white space (Unicode's
    White_Space), 8 unassigned in this Python's Unicode data (a text with one is encoded by
    tiktoken, whose tables may be newer)."""
    out = bytearray(0x110000)
    out[0x40000:0xE0000] = b"\x08" * 0xA0000  # planes 4-13: nothing assigned (a test checks it)
    cat = unicodedata.category
    for cp in itertools.chain(range(0x40000), range(0xE0000, 0x110000)):
        c = cat(chr(cp))
        out[cp] = 1 if c[0] == "L" else 2 if c[0] == "N" else 8 if c == "Cn" else 0
    for cp in _WHITE_SPACE:
        out[cp] = 4
    return bytes(out)


PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world.\n  x = 1 \tdéjà vu\n\nEnd",
    "def f(a, b):\n    return a ** 2 + b  # it's fine, isn't it? we'll see; you'd've\n\n\n",
    "   leading and trailing spaces   \r\n\r\n\t\t\tTabs\u00a0nbsp\u2009thin\u3000ideographic",
    "日本語のテキストと中文文本, 한국어 텍스트, Ελληνικά, русский текст, עברית, العربية",
    "emoji 🙂🚀👩‍💻 and combining e\u0301 a\u0308 \u212b \ufb01 ligature, numbers 1234567890 3.14159 1e-9",
    '{"json": [1, 2, {"k": null, "v": true}], "s": "a\\nb\\\\c"}\n<tag attr=\'x\'>text</tag>',
    "URL https://example.com/a/b?c=d&e=f#g and path /usr/local/bin/python3.12 --flag=value",
    "'S 'T 'RE 'VE 'M 'LL 'D ''' \"\"\" ``` ~~~ ___ --- *** ### @@@ $$$ %%% ^^^ &&& |||",
    "\x00\x01\x07\x1b[31mred\x1b[0m \ud7ff \ue000 \U0001f600\U0010fffd",
)
"""Text the start-up check encodes both ways (the caller adds its own corpus)."""


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table that byte-level vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class FastBPE:
    """``encode(text)`` -> (token ids, [(token index, char start, char end) of each special
    token]), equal to ``tokenizers``' ``encode(text, add_special_tokens=False)`` on the
    tokenizers it accepts."""

    def __init__(
        self,
        core: Any,
        rank_to_id: list[int] | None,
        added: dict[str, tuple[int, bool]],
        nfc: bool,
        native: Any = None,
    ) -> None:
        self._core = core
        self._native = native
        """The C encoder (same ids, several times faster) when built and the split regex is one
        it scans; a text it refuses (a code point newer than this Python's Unicode data) goes
        to tiktoken's core."""
        self._rank_to_id = rank_to_id
        self._added = added
        self._nfc = nfc
        alts = sorted(added, key=len, reverse=True)  # leftmost, then longest, as HF matches them
        self._split = re.compile("|".join(re.escape(a) for a in alts)) if alts else None
        self.vocab_texts: list[str] = []
        """The text of every vocabulary token that is whole UTF-8: probes for :meth:`check`
        (tiktoken takes a piece that is a token as it is; Hugging Face only if its merges make it).
        :meth:`check` empties it: it is only needed once."""

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> tuple[FastBPE | None, str]:
        """The encoder for this tokenizer, or (None, why it cannot be reproduced)."""
        try:
            import tiktoken
        except ImportError:
            return None, "tiktoken is not installed"
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return None, f"unreadable: {exc}"
        model = d.get("model") or {}
        if model.get("type") != "BPE":
            return None, f"model {model.get('type')!r} is not BPE"
        for k in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(k):
                return None, f"BPE {k} is set"
        if model.get("byte_fallback"):
            return None, "BPE byte_fallback is set"
        norm = d.get("normalizer")
        if norm is not None and norm.get("type") != "NFC":
            return None, f"normalizer {norm.get('type')!r}"
        pattern = _pattern(d.get("pre_tokenizer"))
        if pattern is None:
            return None, f"pre-tokenizer {json.dumps(d.get('pre_tokenizer'))[:200]}"
        added: dict[str, tuple[int, bool]] = {}
        for t in d.get("added_tokens") or ():
            if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
                return None, f"added token {t.get('content')!r} strips or is single-word"
            if norm is not None and t.get("normalized"):
                return None, f"added token {t.get('content')!r} is matched after normalising"
            added[t["content"]] = (int(t["id"]), bool(t.get("special")))
        u2b = _bytes_to_unicode()
        vocab: dict[str, int] = model.get("vocab") or {}

        def to_bytes(tok: str) -> bytes | None:
            try:
                return bytes(u2b[c] for c in tok)
            except KeyError:
                return None

        ranks: dict[bytes, int] = {}
        order: list[int] = []  # rank -> id
        singles = []
        for tok, i in vocab.items():
            b = to_bytes(tok)
            if b is None:
                if tok in added:
                    continue
                return None, f"vocabulary entry {tok!r} is not byte-level"
            if len(b) == 1:
                singles.append((b, i))
        if len({b for b, _ in singles}) != 256:
            return None, f"{len(singles)} single-byte tokens, not 256"
        for b, i in sorted(singles, key=lambda x: x[1]):
            ranks[b] = len(order)
            order.append(i)
        for m in model.get("merges") or ():
            left, right = m.split(" ", 1) if isinstance(m, str) else m
            ba, bb = to_bytes(left), to_bytes(right)
            tid = vocab.get(f"{left}{right}")
            if ba is None or bb is None or tid is None:
                return None, f"merge {m!r} is not in the vocabulary"
            t = ba + bb
            if t in ranks:
                return None, f"merge {m!r} makes a token an earlier merge made"
            ranks[t] = len(order)
            order.append(tid)
        if len(ranks) + sum(1 for t in added if t in vocab) < len(vocab):
            return None, "vocabulary has tokens no merge makes"
        mono = all(x < y for x, y in itertools.pairwise(order))
        if mono:  # the ids already follow the merge order: use them as ranks
            ranks = {b: order[r] for b, r in ranks.items()}
        try:
            core = tiktoken.Encoding(
                "agentgw-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
            )
        except Exception as exc:  # tiktoken rejects the pattern or ranks
            return None, f"tiktoken refused it: {exc}"
        kind = NATIVE_PATTERNS.get(pattern)
        native = (
            _native.Encoder(ranks, kind, _classes()) if _native is not None and kind is not None else None
        )
        out = cls(core, None if mono else order, added, norm is not None, native)
        for b in ranks:
            if len(b) > 1:
                try:
                    out.vocab_texts.append(b.decode("utf-8"))
                except UnicodeDecodeError:
                    pass
        return out, ""

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int, int]]]:
        ids, specials = self.encode_array(text)
        return ids.tolist(), specials

    def encode_array(self, text: str) -> tuple[array[int], list[tuple[int, int, int]]]:
        """:meth:`encode` with the ids in an ``array("i")`` (the C encoder's bytes copied in
        once, no int objects)."""
        ids = array("i")
        specials: list[tuple[int, int, int]] = []
        pos = 0
        if self._split is not None:
            for m in self._split.finditer(text):
                if m.start() > pos:
                    self._ordinary(text[pos : m.start()], ids)
                tid, special = self._added[m.group()]
                if special:
                    specials.append((len(ids), m.start(), m.end()))
                ids.append(tid)
                pos = m.end()
        if pos < len(text):
            self._ordinary(text[pos:] if pos else text, ids)
        return ids, specials

    def _ordinary(self, seg: str, out: array[int]) -> None:
        if self._nfc:
            seg = unicodedata.normalize("NFC", seg)
        if self._native is not None and self._rank_to_id is None:
            try:
                out.frombytes(self._native.encode_bytes(seg))
                return
            except ValueError:  # an unassigned code point, a lone surrogate: tiktoken's way
                pass
        got: list[int]
        if self._native is not None:
            try:
                got = self._native.encode(seg)
            except ValueError:
                got = self._core.encode_ordinary(seg)
        else:
            got = self._core.encode_ordinary(seg)
        if self._rank_to_id is not None:
            r = self._rank_to_id
            got = [r[x] for x in got]
        out.extend(got)

    def check(self, tokenizer: Any, texts: Iterable[str] = ()) -> str:
        """The start-up check: :meth:`agrees` on :data:`PROBE_TEXTS`, ``texts`` and every
        vocabulary token's text, which is then dropped."""
        vocab, self.vocab_texts = self.vocab_texts, []
        return self.agrees(tokenizer, [*PROBE_TEXTS, *texts, *vocab])

    def agrees(self, tokenizer: Any, texts: Iterable[str]) -> str:
        """'' when this encoder gives ``tokenizer``'s ids on every text, else the first text
        (cut) on which it does not."""
        texts = list(texts)
        for i in range(0, len(texts), 4096):
            batch = texts[i : i + 4096]
            refs = tokenizer.encode_batch(batch, add_special_tokens=False)
            for t, ref in zip(batch, refs, strict=True):
                if self.encode(t)[0] != ref.ids:
                    return t[:80]
        return ""


def _pattern(pre: Any) -> str | None:
    """The split regex of a pre-tokenizer this encoder reproduces, else None."""
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel":
        ok = pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
        return GPT2_PATTERN if ok else None
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, bl = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(split.get("pattern"), dict)
        or "Regex" not in split["pattern"]
        or bl.get("type") != "ByteLevel"
        or bl.get("use_regex", True)
        or bl.get("add_prefix_space", False)
    ):
        return None
    return str(split["pattern"]["Regex"])
