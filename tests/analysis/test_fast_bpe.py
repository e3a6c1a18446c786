"""The tiktoken-core encoder (gateway/analysis/fast_bpe.py) against Hugging Face tokenizers."""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import subprocess
import sys
import unicodedata
from array import array
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gateway.analysis import fast_bpe
from gateway.analysis.fast_bpe import PROBE_TEXTS, FastBPE
from gateway.analysis.tokenize import FAST_CHECK_EVERY, FAST_CHECK_FIRST, ChatTokenizer
from gateway.local.tiny_model import CORPUS_DIR

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(Path(CORPUS_DIR).glob("*")) if p.is_file())


def _random_texts(n: int, seed: int = 7) -> list[str]:
    """Corpus slices, random code points, whitespace runs and special tokens mixed."""
    rng = random.Random(seed)
    corpus = _corpus()
    alphabet = (
        " \t\n\r\u00a0\u3000'\"`~!@#$%^&*()_+-=[]{};:,./<>?\\|0123456789"
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ éèêëçàñöüßøå日本語中文한국어Ελληνικάрусскийעבריתالعربية🙂🚀"
    )
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.45:
                i = rng.randrange(len(corpus))
                parts.append(corpus[i : i + rng.randint(1, 3000)])
            elif r < 0.75:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200))))
            elif r < 0.85:
                parts.append(" " * rng.randint(1, 9) + "\n" * rng.randint(0, 4) + "\t" * rng.randint(0, 3))
            elif r < 0.95:
                parts.append(rng.choice(SPECIALS))
            else:
                parts.append("".join(chr(rng.randint(0x20, 0x2FFFF)) for _ in range(rng.randint(1, 30))))
        out.append("".join(parts).encode("utf-8", "replace").decode("utf-8", "replace"))
    return out


def _agree_everywhere(path: Path, texts: list[str]) -> FastBPE:
    fast, why = FastBPE.from_tokenizer_json(path)
    assert fast is not None, why
    hf = Tokenizer.from_file(str(path))
    special_ids = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    for t in texts:
        ids, specials = fast.encode(t)
        ref = hf.encode(t, add_special_tokens=False)
        assert ids == ref.ids, t[:120]
        want = [(i, *ref.token_to_chars(i)) for i, tok in enumerate(ref.tokens) if tok in special_ids]
        assert specials == want
    return fast


def test_the_tiny_models_tokenizer_encodes_identically(tiny_llama: Path) -> None:
    fast = _agree_everywhere(tiny_llama / "tokenizer.json", [*PROBE_TEXTS, *_random_texts(300)])
    assert fast.vocab_texts  # the start-up probe covers the vocabulary too
    assert fast._rank_to_id is None  # trained ids follow the merge order: no mapping runs


def _train(tmp_path: Path, pre: object, norm: object | None, name: str) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre  # type: ignore[assignment]
    if norm is not None:
        tok.normalizer = norm  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(
        vocab_size=1200, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_corpus()], trainer)
    out = tmp_path / f"{name}.json"
    tok.save(str(out))
    return out


def test_a_llama3_style_split_and_nfc_tokenizer_encodes_identically(tmp_path: Path) -> None:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    path = _train(tmp_path, pre, normalizers.NFC(), "llama3ish")
    assert json.loads(path.read_text())["normalizer"]["type"] == "NFC"
    _agree_everywhere(path, [*PROBE_TEXTS, *_random_texts(200, seed=11)])


def test_ids_out_of_merge_order_are_mapped(tmp_path: Path, tiny_llama: Path) -> None:
    d = json.loads((tiny_llama / "tokenizer.json").read_text())
    vocab = d["model"]["vocab"]
    n_special = len(d["added_tokens"])
    ids = list(range(n_special, len(vocab)))
    perm = ids[:]
    random.Random(3).shuffle(perm)
    remap = dict(zip(ids, perm, strict=True))
    d["model"]["vocab"] = {t: remap.get(i, i) for t, i in vocab.items()}
    path = tmp_path / "shuffled.json"
    path.write_text(json.dumps(d))
    fast = _agree_everywhere(path, [*PROBE_TEXTS, *_random_texts(100, seed=5)])
    assert fast._rank_to_id is not None


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
        (lambda d: d["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
        (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "pre-tokenizer"),
        (lambda d: d["model"].update(byte_fallback=True), "byte_fallback"),
        (lambda d: d["model"].update(dropout=0.1), "dropout"),
        (lambda d: d["added_tokens"][1].update(lstrip=True), "strips"),
        (lambda d: d["model"]["merges"].append(d["model"]["merges"][0]), "earlier merge"),
    ],
)
def test_what_it_cannot_reproduce_it_refuses_with_a_reason(
    tmp_path: Path, tiny_llama: Path, edit: object, why: str
) -> None:
    d = json.loads((tiny_llama / "tokenizer.json").read_text())
    edit(d)  # type: ignore[operator]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d))
    fast, reason = FastBPE.from_tokenizer_json(path)
    assert fast is None
    assert why in reason


def _write_abc(tmp_path: Path, d: dict) -> Path:
    vocab = d["model"]["vocab"]
    n = max(vocab.values()) + 1
    for t in ("bc", "ab", "abc"):
        vocab[t] = n
        n += 1
    d["model"]["merges"] = ["b c", "a b", "ab c"]
    path = tmp_path / "abc.json"
    path.write_text(json.dumps(d))
    return path


@pytest.fixture
def abc_tokenizer(tmp_path: Path, tiny_llama: Path) -> Path:
    """The tiny tokenizer cut down to its bytes and specials, plus the "abc" vocabulary."""
    d = json.loads((tiny_llama / "tokenizer.json").read_text())
    d["model"]["vocab"] = {t: i for t, i in d["model"]["vocab"].items() if i < 3 + 256}
    assert len(d["model"]["vocab"]) == 3 + 256
    return _write_abc(tmp_path, d)


def test_the_startup_probe_finds_a_disagreeing_vocabulary(abc_tokenizer: Path) -> None:
    hf = Tokenizer.from_file(str(abc_tokenizer))
    assert hf.encode("abc", add_special_tokens=False).tokens == ["a", "bc"]
    fast, why = FastBPE.from_tokenizer_json(abc_tokenizer)
    assert fast is not None, why
    assert fast.encode("abc")[0] != hf.encode("abc", add_special_tokens=False).ids
    assert fast.agrees(hf, ["xyz", "abc"]) == "abc"
    assert fast.check(hf) == "abc"  # the start-up check: probes and the whole vocabulary
    assert fast.vocab_texts == []  # dropped once checked


def test_a_live_disagreement_turns_the_fast_path_off(tiny_llama: Path, abc_tokenizer: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    ref = ChatTokenizer(tiny_llama, 128, "0", fast_bpe=False)
    assert tok.fast is not None and tok.fast_reason == ""
    assert ref.fast is None and ref.fast_reason == "off in config"
    texts = _random_texts(FAST_CHECK_EVERY + 8, seed=9)

    def body(t: str) -> dict:
        return {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": t}]}

    for t in texts[:FAST_CHECK_FIRST]:
        assert tok.prompt_info("chat", body(t)).tokens == ref.prompt_info("chat", body(t)).tokens
    assert tok.fast_checks == FAST_CHECK_FIRST and tok.fast_mismatches == 0
    # now an encoder that drops each segment's last token: the next sampled check catches it
    broken = tok.fast
    assert broken is not None
    real = broken._ordinary

    def drop_last(seg: str, out: Any) -> None:
        n = len(out)
        real(seg, out)
        if len(out) > n:
            out.pop()

    broken._ordinary = drop_last  # type: ignore[method-assign]
    for t in texts[FAST_CHECK_FIRST:]:
        got = tok.prompt_info("chat", body(t)).tokens
        if tok.fast is None:
            break
    assert tok.fast_mismatches == 1 and tok.fast is None
    assert "disagreed" in tok.fast_reason
    # the request that found it got the tokenizer's ids, and so does every one after it
    assert got == ref.prompt_info("chat", body(t)).tokens
    last = texts[-1] + " tail"
    assert tok.prompt_info("chat", body(last)).tokens == ref.prompt_info("chat", body(last)).tokens


# -- the C encoder and block encoder (gateway/analysis/_native.c) -------------------------------

_CHARS = (
    "abcxyzABCXYZ stremvldSTREMVLDſ'’\"éèçñßøåÆ日本語中文한국어Ελληνικάрусскийעבריתالعربية"
    "0123456789٠١٢३४²³½Ⅻⅷ〇 \t\n\r\x0b\x0c\x85\u00a0\u2028\u2029\u3000\u2009\u200b"
    ".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`🙂🚀👩\u200d💻e\u0301\u0308\ufb01\x00\x1b\ue000"
)


@pytest.fixture(scope="session")
def native(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The C module: the installed one (setup.sh's ``pip install -e`` builds it in place), else
    built here from the source (a checkout that has not been installed since it was added)."""
    if fast_bpe._native is not None:
        return fast_bpe._native
    out = tmp_path_factory.mktemp("native")
    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "setup.py",
        "-q",
        "build_ext",
        "--build-lib",
        str(out),
        "--build-temp",
        str(out / "t"),
    ]
    subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    (path,) = out.rglob("_native*.so")
    spec = importlib.util.spec_from_file_location("gateway.analysis._native", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def with_native(native: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from gateway.analysis import tokenize

    monkeypatch.setattr(fast_bpe, "_native", native)
    monkeypatch.setattr(tokenize, "_native", native)
    return native


@pytest.fixture(scope="module")
def tiny_ranks(tiny_llama: Path) -> dict[bytes, int]:
    fast, why = FastBPE.from_tokenizer_json(tiny_llama / "tokenizer.json")
    assert fast is not None, why
    return dict(fast._core._mergeable_ranks)


def test_the_c_encoder_is_used_when_built(tiny_llama: Path, with_native: Any) -> None:
    fast, _ = FastBPE.from_tokenizer_json(tiny_llama / "tokenizer.json")
    assert fast is not None and fast._native is not None
    assert set(fast_bpe.NATIVE_PATTERNS) == {fast_bpe.GPT2_PATTERN, LLAMA3_SPLIT, fast_bpe.QWEN2_PATTERN}


def test_planes_4_to_13_are_unassigned_in_this_pythons_unicode_data() -> None:
    """The C encoder's class table takes them as such without looking (faster start-up)."""
    assert all(unicodedata.category(chr(cp)) == "Cn" for cp in range(0x40000, 0xE0000, 7))
    assert all(c == 8 for c in fast_bpe._classes()[0x40000:0xE0000])


@pytest.mark.parametrize("kind", [0, 1, 2])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(st.sampled_from(_CHARS), max_size=300), st.text(max_size=100)))
def test_the_c_encoder_splits_and_merges_as_tiktokens_core(
    tiny_ranks: dict[bytes, int], native: Any, kind: int, text: str
) -> None:
    """Every split regex it scans by hand, on text full of the edge cases of those regexes
    (contractions in any case, digit runs, white space runs before words and line breaks,
    unassigned and private-use code points)."""
    pattern = {v: k for k, v in fast_bpe.NATIVE_PATTERNS.items()}[kind]
    core = _core(pattern, tiny_ranks)
    encoder = native.Encoder(tiny_ranks, kind, fast_bpe._classes())
    try:
        got = encoder.encode(text)
    except ValueError:  # unassigned in Python's Unicode data, or a lone surrogate: refused
        assume(False)
    assert got == core.encode_ordinary(text)
    packed = array("I")
    packed.frombytes(encoder.encode_bytes(text))
    assert packed.tolist() == got


@functools.cache
def _core_cached(pattern: str, ranks_id: int) -> Any:
    import tiktoken

    return tiktoken.Encoding(
        f"t{ranks_id}", pat_str=pattern, mergeable_ranks=_RANKS[ranks_id], special_tokens={}
    )


_RANKS: dict[int, dict[bytes, int]] = {}


def _core(pattern: str, ranks: dict[bytes, int]) -> Any:
    _RANKS[id(ranks)] = ranks
    return _core_cached(pattern, id(ranks))


def test_a_qwen2_style_split_tokenizer_encodes_identically(tmp_path: Path, with_native: Any) -> None:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(fast_bpe.QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    path = _train(tmp_path, pre, None, "qwen2ish")
    fast = _agree_everywhere(path, [*PROBE_TEXTS, *_random_texts(200, seed=13)])
    assert fast._native is not None


def test_a_text_the_c_encoder_refuses_goes_to_tiktoken(tiny_llama: Path, with_native: Any) -> None:
    fast, _ = FastBPE.from_tokenizer_json(tiny_llama / "tokenizer.json")
    assert fast is not None
    hf = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    text = "new \U000323b0 code point, past Python 3.11's Unicode 14"  # assigned in Unicode 15
    with pytest.raises(ValueError):
        fast._native.encode(text)
    assert fast.encode(text)[0] == hf.encode(text, add_special_tokens=False).ids
    lone = "a lone \ud800 surrogate"
    with pytest.raises(ValueError):
        fast._native.encode(lone)
    assert fast.encode(lone)[0] == fast._core.encode_ordinary(lone)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300),
    parent=st.binary(min_size=0, max_size=300),
    salt=st.one_of(st.none(), st.text(max_size=40)),
    cut=st.tuples(st.integers(0, 300), st.integers(0, 300)),
)
def test_cbor_block_is_cbor2s_canonical_encoding(
    native: Any, tokens: list[int], parent: bytes, salt: str | None, cut: tuple[int, int]
) -> None:
    arr = array("i", tokens)
    start, end = sorted(min(c, len(tokens)) for c in cut)
    extra = (salt,) if salt is not None else None
    want = cbor2.dumps((parent, tuple(tokens[start:end]), extra), canonical=True)
    assert native.cbor_block(parent, arr, start, end, cbor2.dumps(extra, canonical=True)) == want


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200),
    salt=st.one_of(st.none(), st.text(max_size=40)),
    keep=st.integers(0, 12),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_the_chained_block_hashes_in_c_are_vllms_block_by_block(
    native: Any, tokens: list[int], salt: str | None, keep: int, block_size: int
) -> None:
    """chain_hashes against the reference hash_block (vLLM's sha256_cbor, cbor2 and hashlib),
    from the first block (the salt in its extra keys) or from the middle of a chain."""
    from gateway.analysis import tokenize
    from gateway.core.block_hash import external, hash_block, none_hash, salt_keys

    assert tokenize._SHA256, "OpenSSL's SHA256 was not found in hashlib's libcrypto"
    none = none_hash("0")
    arr = array("i", tokens)
    n = len(tokens) // block_size
    keep = min(keep, n)
    parent, raw, want = None, [], []
    for i in range(n):
        parent = hash_block(
            parent, tokens[i * block_size : (i + 1) * block_size], none, salt_keys(salt) if i == 0 else None
        )
        raw.append(parent)
        want.append(external(parent))
    extra0 = cbor2.dumps(salt_keys(salt), canonical=True) if salt else b"\xf6"
    start = raw[keep - 1] if keep else none
    got_raw, got = native.chain_hashes(tokenize._SHA256, start, arr, keep, n, block_size, extra0, b"\xf6")
    assert (got_raw, got) == (raw[keep:], want[keep:])


def test_without_the_c_module_the_answers_are_the_same(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, with_native: Any
) -> None:
    """The fallback when the extension is not built: tiktoken's core and cbor2."""
    from gateway.analysis import tokenize

    bodies = [
        {"messages": [{"role": "user", "content": "x" * n + " déjà vu 1234 's"}], "cache_salt": s}
        for n, s in ((10, None), (700, "t"), (3000, None))
    ]
    with_c = ChatTokenizer(tiny_llama, 16, "0")
    assert with_c.fast is not None and with_c.fast._native is not None
    want = [with_c.prompt_info("chat", b) for b in bodies]
    monkeypatch.setattr(fast_bpe, "_native", None)
    monkeypatch.setattr(tokenize, "_native", None)
    without = ChatTokenizer(tiny_llama, 16, "0")
    assert without.fast is not None and without.fast._native is None
    for b, w in zip(bodies, want, strict=True):
        got = without.prompt_info("chat", b)
        assert (list(got.tokens), got.hashes) == (list(w.tokens), w.hashes)
