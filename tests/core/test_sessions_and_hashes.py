"""Session table bounds, and the block-hash chain (incremental == from scratch)."""

from __future__ import annotations

import random

from gateway.core.block_hash import HashChain, common_prefix_len, hash_tokens, none_hash
from gateway.core.sessions import SessionRecord, SessionTable, reconcile


def test_session_table_ttl_and_lru_capacity() -> None:
    t = SessionTable(capacity=2, ttl_s=10)
    for i, sid in enumerate(["a", "b"]):
        t.put(SessionRecord(sid, last_activity=float(i)))
    t.touch("a")
    evicted = t.put(SessionRecord("c", last_activity=2.0))
    assert [r.session_id for r in evicted] == ["b"]
    assert t.get("a", now=5.0) is not None
    assert t.get("a", now=100.0) is None  # idle past the TTL
    assert [r.session_id for r in t.expire(now=100.0)] == ["c"]
    assert len(t) == 0


def test_session_record_round_trips_and_learns_gaps() -> None:
    r = SessionRecord("s", created=0.0)
    r.record_turn(10.0, 500, [1, 2])
    r.record_turn(14.0, 900, [1, 2, 3])
    r.record_turn(20.0, 1300, [1, 2, 3, 4])
    assert r.turns == 3 and r.observed_gaps == [4.0, 6.0]
    assert r.expected_gap() == 6.0
    r.expected_gap_s = 40.0
    assert r.expected_gap() == 40.0
    assert SessionRecord.from_dict(r.to_dict()) == r


def test_hash_chain_incremental_equals_scratch() -> None:
    rng = random.Random(0)
    tokens: list[int] = []
    chain = HashChain(16, "0")
    for _ in range(20):
        tokens = tokens + [rng.randrange(4096) for _ in range(rng.randrange(1, 50))]
        if rng.random() < 0.2:  # a rewritten tail (templates may rewrite history)
            tokens = tokens[: rng.randrange(len(tokens) + 1)] + [7, 7, 7]
        chain.update(tokens)
        assert chain.hashes == hash_tokens(tokens, 16, "0")


def test_seed_and_salt_change_hashes() -> None:
    toks = list(range(64))
    assert hash_tokens(toks, 16, "0") != hash_tokens(toks, 16, "1")
    assert none_hash(None) != none_hash("0")
    salted = HashChain(16, "0", cache_salt="tenant-a")
    salted.update(toks)
    assert salted.hashes[0] != hash_tokens(toks, 16, "0")[0]


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len("abcdef", "abcdxx") == 4
    assert common_prefix_len(list(range(1000)), list(range(1000))) == 1000


def test_reconcile_keeps_the_newer_copy_but_never_lets_hints_erase_a_home() -> None:
    def placed(t: float) -> SessionRecord:
        return SessionRecord("s", home="e1", pool="p", turns=3, created=0.0, last_activity=t)

    hinted = SessionRecord("s", created=9.0, last_activity=9.0, expected_gap_s=40.0)
    assert reconcile(placed(1.0), None) is not None
    assert reconcile(placed(1.0), placed(2.0)) is None  # the store's is newer: left
    newer = placed(3.0)
    assert reconcile(newer, placed(2.0)) is newer
    # a replica that missed the session took hints for it meanwhile (a newer, homeless copy)
    kept = reconcile(placed(1.0), hinted)
    assert kept is not None and (kept.home, kept.turns, kept.expected_gap_s, kept.last_activity) == (
        "e1",
        3,
        40.0,
        9.0,
    )
    # and the other way round: the store holds the placed copy, the local view only the hints
    store = placed(1.0)
    out = reconcile(SessionRecord("s", created=9.0, last_activity=9.0, expected_gap_s=5.0), store)
    assert out is store and (out.home, out.expected_gap_s) == ("e1", 5.0)
    # two copies of hints only, or an ended one: the newer wins as before
    assert reconcile(SessionRecord("s", last_activity=1.0), hinted) is None
