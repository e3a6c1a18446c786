"""A tenant's cache salt enters the block hashes exactly as vLLM 0.32 puts it there (its own
request block hasher is the reference): with the bare salt as the first block's extra key, every
salted hash differed from the engine's KV events and no tenant's prefix ever matched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gateway.analysis.tokenize import ChatTokenizer
from gateway.core.block_hash import hash_tokens

# vLLM reads PYTHONHASHSEED when it makes its NONE_HASH: run its hasher in a child with the
# engines' seed, without touching this process's environment
_VLLM = """
import json, sys
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k
from vllm.v1.request import Request
k.init_none_hash(sha256_cbor)
toks, salt = json.loads(sys.stdin.read())
r = Request("r", toks, SamplingParams(max_tokens=1), None, cache_salt=salt,
            block_hasher=k.get_request_block_hasher(128, sha256_cbor))
print(json.dumps([int.from_bytes(h[-8:], "big") for h in r.block_hashes]))
"""


def vllm_hashes(tokens: list[int], salt: str | None) -> list[int]:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _VLLM],
        input=json.dumps([tokens, salt]),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=True,
        timeout=300,
    ).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


def test_salted_and_plain_hashes_equal_vllms(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    msgs = [
        {"role": "system", "content": "a ledger of passing ships " * 60},
        {"role": "user", "content": "x"},
    ]
    info = tok.prompt_info("chat", {"messages": msgs, "cache_salt": "tenant-a"})
    tokens = list(info.tokens)
    assert len(tokens) >= 256
    want = vllm_hashes(tokens, "tenant-a")
    assert list(info.hashes) == want
    assert hash_tokens(tokens, 128, "0", "tenant-a") == want
    assert hash_tokens(tokens, 128, "0") == vllm_hashes(tokens, None)
