"""vLLM's prefix-cache block hashes, reproduced outside vLLM (``--prefix-caching-hash-algo
sha256_cbor`` with a fixed ``PYTHONHASHSEED``).

``H(x) = sha256(cbor2.dumps(x, canonical=True))``; ``NONE = H(seed)`` (seed: the engine's
``PYTHONHASHSEED`` string, else ``"vllm-none-hash"``); block ``i`` over full blocks of
``block_size`` tokens: ``h_i = H((h_{i-1} or NONE, tuple(tokens_i), extra_i))``; KV events carry
``int.from_bytes(h, "big") & (2**64 - 1)``. A partial last block has no hash.

:class:`HashChain` keeps a token list and its hashes so that extending a conversation hashes only
the new full blocks: a turn costs O(new tokens), not O(context).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2

DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str | None) -> bytes:
    return sha256_cbor(seed if seed is not None else DEFAULT_SEED)


def salt_keys(cache_salt: str | None) -> tuple[tuple[str, str], ...] | None:
    """The first block's extra hash keys for a request's ``cache_salt``, as vLLM 0.32 builds them
    (``generate_block_hash_extra_keys``: ``("cache_salt", salt)`` pairs, not the bare salt; with
    the bare salt every salted hash differed from the engine's, so no tenant's prefix matched)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def hash_block(parent: bytes | None, tokens: Sequence[int], none: bytes, extra: Any = None) -> bytes:
    return sha256_cbor((parent or none, tuple(tokens), extra))


def external(h: bytes) -> int:
    """The 64-bit form vLLM publishes in KV events."""
    return int.from_bytes(h, "big") & _MASK64


def hash_tokens(
    tokens: Sequence[int], block_size: int, seed: str | None, cache_salt: str | None = None
) -> list[int]:
    """The external hashes of every full block of ``tokens``."""
    chain = HashChain(block_size, seed, cache_salt)
    chain.update(tokens)
    return list(chain.hashes)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by galloping + binary search on slice equality
    (each comparison runs in C)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class HashChain:
    """An incrementally extended block-hash chain for one token sequence."""

    __slots__ = ("_none", "_raw", "block_size", "cache_salt", "hashes", "tokens")

    def __init__(self, block_size: int, seed: str | None, cache_salt: str | None = None) -> None:
        self.block_size = block_size
        self.cache_salt = cache_salt
        self._none = none_hash(seed)
        self.tokens: list[int] = []
        self._raw: list[bytes] = []
        self.hashes: list[int] = []

    def update(self, tokens: Sequence[int]) -> int:
        """Make the chain describe ``tokens`` (compared with the current tokens from the start)."""
        return self.replace_tail(0, list(tokens))

    def replace_tail(self, start: int, tail: list[int]) -> int:
        """Make the chain describe ``tokens[:start] + tail``, where the caller knows the first
        ``start`` tokens are unchanged: only the old tail is compared with the new one, and only
        blocks after their common prefix are hashed. O(len(tail)). Returns the blocks hashed."""
        tokens = self.tokens
        start = min(start, len(tokens))
        keep = (start + common_prefix_len(tokens[start:], tail)) // self.block_size
        del tokens[start:]
        tokens.extend(tail)
        del self._raw[keep:]
        del self.hashes[keep:]
        bs = self.block_size
        parent = self._raw[-1] if self._raw else None
        new = 0
        for i in range(keep, len(tokens) // bs):
            extra = salt_keys(self.cache_salt) if i == 0 else None
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], self._none, extra)
            self._raw.append(parent)
            self.hashes.append(external(parent))
            new += 1
        return new
