"""PinnedLRUCachePolicy on its own (a fake clock; no engine)."""

from __future__ import annotations

import inspect

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from engine_ext.pinned_policy import PinnedLRUCachePolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def filled(clock: Clock) -> PinnedLRUCachePolicy:
    policy = PinnedLRUCachePolicy(cache_capacity=8, clock=clock)
    for i in range(6):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        insert(policy, bytes([i]), chunk)
    return policy


def insert(policy: PinnedLRUCachePolicy, key: bytes, chunk: ChunkStatus) -> None:
    """A chunk a store allocated, as vLLM calls it: with the storing request's context from vLLM
    0.34 on (one without recorded key positions: plain LRU recency), without it in 0.32."""
    if "req_context" in inspect.signature(policy.insert).parameters:
        policy.insert(key, chunk, ReqContext(req_id="store"))
    else:
        policy.insert(key, chunk)


def finish(policy: PinnedLRUCachePolicy, keys: list[bytes], **hint: object) -> None:
    ctx = ReqContext(req_id="r", kv_transfer_params={"agentgw": hint})
    policy.on_request_finished((tuple(keys),), set(), set(keys), ctx)


def evicted(policy: PinnedLRUCachePolicy, n: int) -> list[bytes]:
    result = policy.evict(n, set())
    return [k for k, _ in result] if result is not None else []


def test_pinned_chunks_are_skipped_until_the_ttl_then_lru_again() -> None:
    clock = Clock()
    policy = filled(clock)
    finish(policy, [b"\x00", b"\x01"], session_id="s", pin_ttl_s=10)
    finish(policy, [b"\x02", b"\x03", b"\x04", b"\x05"], session_id="t")
    assert set(evicted(policy, 2)) == {b"\x04", b"\x05"}  # plain LRU would take 0 and 1
    clock.now = 10.0
    assert set(evicted(policy, 2)) == {b"\x00", b"\x01"}


def test_eviction_fails_rather_than_break_a_pin() -> None:
    clock = Clock()
    policy = filled(clock)
    finish(policy, [bytes([i]) for i in range(6)], session_id="s", pin_ttl_s=10)
    assert policy.evict(1, set()) is None
    assert policy.num_pin_protected_evictions_refused == 1


def test_release_hint_and_demotion() -> None:
    clock = Clock()
    policy = filled(clock)
    finish(policy, [b"\x00"], session_id="s", pin_ttl_s=10)
    finish(policy, [b"\x00"], session_id="s", release=True)
    assert policy.session_state("s")["pin"] is None
    finish(policy, [b"\x05"], session_id="late")  # most recent
    assert policy.demote_session("late") == 1
    assert evicted(policy, 1) == [b"\x05"]
