"""Incremental prompt tokens and block hashes equal transformers' chat template + full encode."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

from gateway.core.block_hash import hash_tokens
from gateway.service.tokenize import ChatTokenizer


def test_incremental_equals_scratch_over_a_long_session(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    rng = random.Random(1)
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent. " * 50}]
    encoded = []
    for turn in range(30):
        msgs.append({"role": "user", "content": f"step {turn} " + "x " * rng.randrange(1, 300)})
        sid = "a" if rng.random() < 0.8 else "b"
        info = tok.prompt_info("chat", {"messages": msgs}, sid)
        ids = ref.encode(
            ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        assert info.num_tokens == len(ids)
        assert info.hashes == hash_tokens(ids, 128, "0")
        encoded.append((info.encoded_tokens, len(ids)))
        msgs.append({"role": "assistant", "content": "done " * rng.randrange(1, 100)})
        if rng.random() < 0.1:  # a harness that rewrites history
            msgs = msgs[:-3] + [msgs[-1]]
    # later turns encode a small fraction of the context
    assert sum(e for e, _ in encoded[10:]) < 0.3 * sum(n for _, n in encoded[10:])


def test_list_content_and_completions(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    a = tok.prompt_info(
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        },
        None,
    )
    b = tok.prompt_info("chat", {"messages": [{"role": "user", "content": "a\nb"}]}, None)
    assert a.num_tokens == b.num_tokens
    ids = list(range(300))
    assert tok.prompt_info("completions", {"prompt": ids}, None).hashes == hash_tokens(ids, 128, "0")
