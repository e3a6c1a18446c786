"""The event-sourced prefix index against a naive reference, on the event sequences vLLM produces
(chains stored in order, removals from the tail, clears), with hypothesis."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.core.prefix_index import PrefixIndex, match_linear
from gateway.core.types import Medium

ENGINES = ["e0", "e1", "e2"]
CHAINS = [[1000 * c + i for i in range(40)] for c in range(3)]  # three distinct conversations

op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(ENGINES),
        st.integers(0, 2),
        st.integers(1, 40),
        st.sampled_from(list(Medium)),
    ),
    st.tuples(
        st.just("remove_tail"), st.sampled_from(ENGINES), st.integers(0, 2), st.integers(1, 40), st.just(None)
    ),
    st.tuples(st.just("clear"), st.sampled_from(ENGINES), st.just(0), st.just(0), st.just(None)),
)


class Naive:
    """engine -> block -> set of media."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, set[Medium]]] = {e: {} for e in ENGINES}

    def longest(self, engine: str, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if not self.held[engine].get(h):
                break
            n += 1
        return n


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.integers(0, 2), st.integers(1, 40))
def test_match_equals_naive_reference(ops: list, chain: int, length: int) -> None:  # type: ignore[type-arg]
    index, naive = PrefixIndex(), Naive()
    for kind, engine, c, n, medium in ops:
        if kind == "store":
            index.apply_stored(engine, CHAINS[c][:n], medium)
            for h in CHAINS[c][:n]:
                naive.held[engine].setdefault(h, set()).add(medium)
        elif kind == "remove_tail":
            # vLLM frees a request's blocks tail first: remove everything past n
            tail = CHAINS[c][n:]
            index.apply_removed(engine, tail)
            for h in tail:
                naive.held[engine].pop(h, None)
        else:
            index.clear(engine)
            naive.held[engine].clear()
    query = CHAINS[chain][:length]
    got = index.match(query)
    ref = match_linear(index, query)
    for e in ENGINES:
        expected = naive.longest(e, query)
        assert (got[e].blocks if e in got else 0) == expected
        assert ref.get(e, 0) == expected


def test_media_are_tracked_separately() -> None:
    index = PrefixIndex()
    chain = [1, 2, 3, 4]
    index.apply_stored("e", chain, Medium.GPU)
    index.apply_stored("e", chain, Medium.CPU)
    index.apply_removed("e", chain[2:], Medium.GPU)  # evicted from device, still in the CPU tier
    m = index.match(chain)["e"]
    assert (m.blocks, m.gpu_blocks) == (4, 2)
    assert m.weighted_blocks == 2 * 1.0 + 2 * 0.6
    index.apply_removed("e", chain, Medium.CPU)
    assert index.match(chain)["e"].blocks == 2


def test_capacity_bounds_each_engine() -> None:
    index = PrefixIndex(capacity_per_engine=10)
    index.apply_stored("e", list(range(100)))
    assert index.engine_blocks("e") == 10
    assert len(index) == 10
    assert index.match(list(range(100))) == {}  # the head was forgotten first: no prefix left
    assert index.match(list(range(90, 100)))["e"].blocks == 10


def test_match_cost_is_logarithmic_in_context() -> None:
    """The binary search touches O(log n) blocks per engine, not n."""
    index = PrefixIndex()
    chain = list(range(100_000))
    index.apply_stored("e", chain)
    calls = 0
    orig = index.holds

    def counting(engine: str, h: int) -> Medium | None:
        nonlocal calls
        calls += 1
        return orig(engine, h)

    index.holds = counting  # type: ignore[method-assign]
    assert index.match(chain + [-1])["e"].blocks == 100_000
    assert calls < 3 * 20


def _reference_store(ix: PrefixIndex, engine: str, hashes: list[int], medium: Medium) -> None:
    """apply_stored block by block, as it was before the held-prefix fast path."""
    lru = ix._lru.setdefault(engine, __import__("collections").OrderedDict())
    if medium != Medium.GPU:
        ix._tiered.add(engine)
    for h in hashes:
        holders = ix._holders.setdefault(h, {})
        holders[engine] = holders.get(engine, 0) | (1 << medium)
        lru[h] = None
        lru.move_to_end(h)
    while len(lru) > ix.capacity_per_engine:
        old, _ = lru.popitem(last=False)
        ix._drop(old, engine)


store_op = st.tuples(
    st.sampled_from(ENGINES[:2]),
    st.integers(0, 2),
    st.integers(0, 39),
    st.integers(1, 40),
    st.sampled_from([Medium.GPU, Medium.GPU, Medium.GPU, Medium.CPU]),
    st.booleans(),
)


def _replay(ops: list, index: PrefixIndex, ref: PrefixIndex) -> Iterator[None]:  # type: ignore[type-arg]
    """``ops`` on ``index`` and, block by block, on ``ref``; yields after each store. Chains with
    holes (a removal in the middle), gaps (a chain stored from a later block) and other media."""
    for engine, c, start, n, medium, remove in ops:
        if remove:  # punch a hole: forget one block in the middle
            h = CHAINS[c][(start + n) // 2 % 40]
            index.apply_removed(engine, [h])
            ref.apply_removed(engine, [h])
            continue
        chain = CHAINS[c][start : start + n] if start % 3 else CHAINS[c][:n]
        index.apply_stored(engine, chain, medium)
        _reference_store(ref, engine, chain, medium)
        yield


@settings(max_examples=300, deadline=None)
@given(st.lists(store_op, max_size=30), st.integers(8, 200))
def test_the_held_prefix_fast_path_leaves_what_block_by_block_storing_leaves(
    ops: list,  # type: ignore[type-arg]
    capacity: int,
) -> None:
    """Chains with holes (a removal or an eviction in the middle), gaps (a chain stored from a
    later block) and other media: the same holders and the same LRU order, in the same order."""
    fast, ref = PrefixIndex(capacity), PrefixIndex(capacity)
    for _ in _replay(ops, fast, ref):
        assert fast._holders == ref._holders
        assert {e: list(o) for e, o in fast._lru.items()} == {e: list(o) for e, o in ref._lru.items()}


@settings(max_examples=200, deadline=None)
@given(st.lists(store_op, max_size=30), st.integers(1, 20))
def test_the_recency_slack_leaves_the_holders_strict_storing_leaves_while_nothing_is_evicted(
    ops: list,  # type: ignore[type-arg]
    slack: int,
) -> None:
    """Below capacity the slack changes only the LRU order: the same holders (so the same
    matches) as storing block by block, on chains with holes, gaps and other media."""
    lazy, ref = PrefixIndex(10_000, recency_slack=slack), PrefixIndex(10_000)
    for _ in _replay(ops, lazy, ref):
        assert lazy._holders == ref._holders
        assert {e: set(o) for e, o in lazy._lru.items()} == {e: set(o) for e, o in ref._lru.items()}


def test_within_the_slack_a_turn_adds_only_its_new_blocks_and_a_stale_floor_moves_the_chain() -> None:
    ix = PrefixIndex(1000, recency_slack=10)
    a, b = [1, 2, 3], [100, 101, 102, 103]
    ix.apply_stored("e", a)
    ix.apply_stored("e", b)  # 4 stores since a's floor: within the slack
    ix.apply_stored("e", a + [4])
    assert list(ix._lru["e"]) == [1, 2, 3, 100, 101, 102, 103, 4]  # a's held blocks stayed put
    ix.apply_stored("e", [200 + i for i in range(10)])  # a's floor is now 15 stores old
    ix.apply_stored("e", a + [4, 5])
    assert list(ix._lru["e"])[-5:] == [1, 2, 3, 4, 5]  # moved to the recent end, as strict LRU
    assert ix.match(a + [4, 5])["e"].blocks == 5
    strict = PrefixIndex(1000)
    strict.apply_stored("e", a)
    strict.apply_stored("e", b)
    strict.apply_stored("e", a + [4])
    assert list(strict._lru["e"]) == [100, 101, 102, 103, 1, 2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=60), st.integers(0, 3))
@example([90] * 60, 0)  # short gaps that add up: the floor must age, not restart each turn
@example([90] * 60, 1)
@example([199] * 30, 2)  # long gaps: the slack must stay within capacity - gap - chains
def test_a_chain_in_use_is_never_forgotten_within_the_capacity_less_the_slack(
    gaps: list[int], sibling_every: int
) -> None:
    """A session's chain extended by a block each turn, other conversations stored between its
    turns (at most 200 blocks), a sibling sharing its head renewing that head now and then:
    with capacity 400 and slack 100 the chain (at most 61 blocks, its sibling's 61) is found
    whole when each turn arrives (200 + 100 + 61 + 61 < 400)."""
    ix = PrefixIndex(400, recency_slack=100)
    chain = [0]
    sibling = [0]
    fresh = iter(range(10_000, 10**9))
    ix.apply_stored("e", chain)
    for turn, gap in enumerate(gaps):
        ix.apply_stored("e", [next(fresh) for _ in range(gap)])
        if sibling_every and turn % sibling_every == 0:
            sibling.append(next(fresh))
            ix.apply_stored("e", sibling)
        # when the next turn arrives, its history is still found whole
        assert ix.match(chain)["e"].blocks == len(chain)
        chain.append(next(fresh))
        ix.apply_stored("e", chain)
