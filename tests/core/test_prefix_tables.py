"""The fleet-sized prefix indexes against PrefixIndex: EngineTables gives the same matches on
random stores, removals (by medium), clears and evictions; BloomTables never misses a block stored
and not removed, and lengthens few matches (false positives)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.prefix_index import PrefixIndex
from gateway.core.prefix_tables import BloomTables, EngineTables
from gateway.core.types import Medium

ENGINES = ("e0", "e1", "e2")
MEDIA = (Medium.GPU, Medium.CPU, Medium.STORAGE)

op = st.tuples(
    st.sampled_from(("store", "remove", "remove_medium", "clear")),
    st.sampled_from(ENGINES),
    st.integers(0, 3),  # chain
    st.integers(1, 12),  # length
    st.sampled_from(MEDIA),
)


def chain(c: int, n: int) -> list[int]:
    return [(c << 32) | (i + 1) * 2654435761 % (1 << 31) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.integers(4, 64))
def test_engine_tables_match_prefix_index(ops: list[tuple[str, str, int, int, Medium]], cap: int) -> None:
    ref, new = PrefixIndex(cap), EngineTables(cap)
    for kind, e, c, n, m in ops:
        hashes = chain(c, n)
        if kind == "store":
            ref.apply_stored(e, hashes, m)
            new.apply_stored(e, hashes, m)
        elif kind == "remove":
            ref.apply_removed(e, hashes[-n // 2 :])
            new.apply_removed(e, hashes[-n // 2 :])
        elif kind == "remove_medium":
            ref.apply_removed(e, hashes[-n // 2 :], m)
            new.apply_removed(e, hashes[-n // 2 :], m)
        else:
            ref.clear(e)
            new.clear(e)
        for c2 in range(4):
            q = chain(c2, 12)
            assert new.match(q) == ref.match(q), (ops, c2)
        for e2 in ENGINES:
            assert new.engine_blocks(e2) == ref.engine_blocks(e2)


def test_bloom_tables_never_miss_and_rarely_overshoot() -> None:
    rng = random.Random(7)
    exact, bloom = EngineTables(), BloomTables(capacity_per_engine=2000)
    chains = {
        e: [[rng.getrandbits(63) for _ in range(rng.randrange(5, 60))] for _ in range(20)] for e in ENGINES
    }
    for e, cs in chains.items():
        for c in cs:
            exact.apply_stored(e, c)
            bloom.apply_stored(e, c)
        for c in cs[:5]:  # the tails of a few chains evicted
            exact.apply_removed(e, c[len(c) // 2 :])
            bloom.apply_removed(e, c[len(c) // 2 :])
    over = total = 0
    for cs in chains.values():
        for c in cs:
            want, got = exact.match(c), bloom.match(c)
            for e, m in want.items():
                assert got[e].blocks >= m.blocks  # no false negatives
                total += 1
                over += got[e].blocks > m.blocks
    assert total > 0 and over / total < 0.05, (over, total)
    assert bloom.bytes() == 3 * 20_000
