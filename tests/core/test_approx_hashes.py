"""approx_hashes: its values are pinned (they live in Redis-shared session records, so a change
would make replicas of two versions disagree), on the ASCII fast path and the UTF-8 path alike."""

from __future__ import annotations

import hashlib

from gateway.core.turn import approx_hashes


def reference(text: str, chunk: int) -> list[int]:
    """The definition, one chunk at a time."""
    out, prev = [], b""
    for i in range(0, len(text) - chunk + 1, chunk):
        prev = hashlib.blake2b(
            prev + text[i : i + chunk].encode("utf-8", "surrogatepass"), digest_size=8
        ).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


ASCII = "<system>You are terse.<user>" + "route the agents well " * 300
UTF8 = "<user>déjà vu — 日本語 " * 200
SURROGATE = "ab\ud800cd" * 300


def test_values_are_pinned() -> None:
    a = approx_hashes(ASCII, 512)
    assert len(a) == 12
    assert a[:3] == [8454892704905946719, 7625800861795860603, 5491311324167769938]
    assert a[-1] == 12857454239105812659
    u = approx_hashes(UTF8, 512)
    assert len(u) == 7
    assert u[:3] == [15431047323283270400, 16333980135535619002, 7230596368893130679]
    assert u[-1] == 5647350903619566284
    assert approx_hashes(SURROGATE, 512) == [12144158547252708351, 5025896826791324957]


def test_same_chain_as_the_definition_at_every_length() -> None:
    for text in (ASCII, UTF8, SURROGATE):
        for n in (0, 1, 63, 64, 65, 640, 1000, len(text)):
            assert approx_hashes(text[:n], 64) == reference(text[:n], 64), (text[:10], n)
    assert approx_hashes("x" * 511, 512) == []
