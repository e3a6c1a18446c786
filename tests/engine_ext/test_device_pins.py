"""DevicePins on a real vLLM BlockPool (no engine): pins hold blocks out of eviction, yield to
the bound and to admission, expire, release, and reset; commands from other threads queue."""

from __future__ import annotations

import threading

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from engine_ext.device_pins import DevicePins, PinCommand
from engine_ext.scheduler import pin_settings

BLOCKS = 17  # 16 usable: block 0 is vLLM's null block


def _pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=16)


_next_hash = iter(range(1, 1 << 30))


def _request(pool: BlockPool, n: int) -> list:
    """Allocate n blocks and give each a prefix-cache hash, as a finished request holds them."""
    blocks = pool.get_new_blocks(n)
    for b in blocks:
        b.set_block_hash(make_block_hash_with_group_id(next(_next_hash).to_bytes(8, "big"), 0))
    return blocks


def _finish(pins: DevicePins, pool: BlockPool, session: str, n: int, ttl: float | None, now: float = 0.0):
    blocks = _request(pool, n)
    hashes = [b.block_hash for b in blocks]
    pins.finished(session, [blocks], ttl, now)
    pool.free_blocks(reversed(blocks))  # the request ends: vLLM drops its references
    return blocks, hashes


def _alive(blocks: list, hashes: list) -> bool:
    return [b.block_hash for b in blocks] == hashes


def _pressure(pool: BlockPool) -> None:
    """Allocate every free block once (evicting whatever the free queue holds), then free them."""
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks(blocks)


def test_pinned_prefix_survives_pressure_that_evicts_its_unpinned_twin() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=8)
    a = _finish(pins, pool, "a", 4, ttl=60.0)
    b = _finish(pins, pool, "b", 4, ttl=None)
    assert pins.num_pinned_blocks == 4 and pool.get_num_free_blocks() == 12
    _pressure(pool)
    assert _alive(*a)
    assert not _alive(*b)
    assert all(blk.ref_cnt == 1 for blk in a[0])


def test_expiry_and_release_return_blocks_to_the_lru() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=8)
    a = _finish(pins, pool, "a", 3, ttl=10.0, now=0.0)
    c = _finish(pins, pool, "c", 3, ttl=100.0, now=0.0)
    assert pins.expire(5.0) == 0
    assert pins.expire(10.0) == 1 and pins.counters["expired"] == 1
    assert pins.release("c") and not pins.release("c")
    assert pins.num_pinned_blocks == 0 and pool.get_num_free_blocks() == 16
    _pressure(pool)
    assert not _alive(*a) and not _alive(*c)


def test_bound_makes_the_oldest_pin_yield_and_refuses_a_pin_larger_than_the_bound() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=6)
    _finish(pins, pool, "a", 3, ttl=60.0)
    _finish(pins, pool, "b", 3, ttl=60.0)
    _finish(pins, pool, "c", 3, ttl=60.0)  # 9 > 6: a (the oldest) yields
    assert pins.session("a", 0.0) is None and pins.session("c", 0.0) == {"blocks": 3, "ttl_left_s": 60.0}
    assert pins.num_pinned_blocks == 6 and pins.counters["yielded_to_bound"] == 1
    _finish(pins, pool, "big", 7, ttl=60.0)
    assert pins.session("big", 0.0) is None and pins.counters["refused_over_bound"] == 1
    assert pins.num_pinned_blocks == 6


def test_shared_blocks_count_once_and_stay_until_the_last_pin_goes() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=8)
    shared = _request(pool, 2)
    own = _request(pool, 1)
    pins.finished("a", [shared], 60.0, 0.0)
    pins.finished("b", [[*shared, *own]], 60.0, 0.0)
    pool.free_blocks([*shared, *own])
    assert pins.num_pinned_blocks == 3
    pins.release("a")
    assert all(b.ref_cnt == 1 for b in shared)  # still held by b's pin
    pins.release("b")
    assert all(b.ref_cnt == 0 for b in [*shared, *own])


def test_release_oldest_is_what_admission_calls_and_it_runs_out() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=8)
    _finish(pins, pool, "a", 2, ttl=60.0)
    _finish(pins, pool, "b", 2, ttl=60.0)
    assert pins.release_oldest() and pins.session("a", 0.0) is None
    assert pins.release_oldest() and not pins.release_oldest()
    assert pins.counters["released_for_admission"] == 2


def test_a_new_turn_moves_a_live_pin_to_the_newer_prefix_and_keeps_its_deadline() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=8)
    _finish(pins, pool, "a", 2, ttl=30.0, now=0.0)
    newer = _finish(pins, pool, "a", 4, ttl=None, now=10.0)
    assert pins.session("a", 10.0) == {"blocks": 4, "ttl_left_s": 20.0}
    assert pins.num_pinned_blocks == 4 and all(b.ref_cnt == 1 for b in newer[0])
    _finish(pins, pool, "a", 1, ttl=0.0, now=11.0)  # pin_ttl_s == 0 releases
    assert pins.session("a", 11.0) is None


def test_a_pin_asked_later_holds_only_the_prefix_still_cached_in_each_group() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=16)
    full, window = _request(pool, 4), _request(pool, 2)  # e.g. a full-attention and a window group
    pins.finished("a", [full, [pool.null_block, *window]], None, 0.0)
    pool.free_blocks([*full, *window])
    evicted = full[1]
    pool.touch([evicted])  # take block 1 of the prefix out and evict its hash, as reuse would
    pool.evict_blocks({evicted.block_id})
    assert pins.pin("a", 60.0) == 1 + 2  # block 0 of the first group, both of the second
    assert pins.counters["stale_blocks"] == 3
    assert full[2].ref_cnt == 0 and window[0].ref_cnt == 1


def test_stale_blocks_are_not_pinned() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=16)
    blocks, _ = _finish(pins, pool, "a", 4, ttl=None)
    _pressure(pool)  # evicted before anyone asked for the pin
    assert pins.pin("a", 60.0) == 0 and pins.counters["stale_blocks"] == 4
    assert all(b.ref_cnt == 0 for b in blocks)


def test_release_all_frees_every_pinned_block_so_the_pool_can_reset() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=12)
    for s in "abc":
        _finish(pins, pool, s, 3, ttl=60.0)
    assert not pool.reset_prefix_cache()
    assert pins.release_all() == 3 and pins.counters["reset"] == 3
    assert pool.reset_prefix_cache()


def test_commands_from_other_threads_apply_on_the_engine_thread() -> None:
    pool = _pool()
    pins = DevicePins(pool, max_blocks=8, max_commands=4)
    _finish(pins, pool, "a", 3, ttl=None)
    done = []
    t = threading.Thread(target=lambda: done.append(pins.submit(PinCommand("a", until=60.0))))
    t.start()
    t.join()
    assert done == [True] and pins.num_pinned_blocks == 0  # queued, not applied
    assert pins.snapshot()["commands_pending"] == 1
    pins.apply_commands()
    snap = pins.snapshot(lambda: 0.0)
    assert snap["pinned_blocks"] == 3 and snap["pinned_share"] == pytest.approx(3 / 16)
    assert snap["sessions"] == {"a": {"blocks": 3, "ttl_left_s": 60.0}}
    assert all(pins.submit(PinCommand("a")) for _ in range(4)) and not pins.submit(PinCommand("a"))
    pins.apply_commands()
    assert pins.num_pinned_blocks == 0
    pins.submit(PinCommand("a", end=True))
    pins.apply_commands()
    assert pins.known_blocks("a") == 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [({}, (8, 4096)), ({"device_pin_fraction": 0.25, "device_pin_sessions": 3}, (4, 3)), (None, (8, 4096))],
)
def test_pin_settings(extra: dict | None, expected: tuple[int, int]) -> None:
    assert pin_settings(extra, 17) == expected


@pytest.mark.parametrize("extra", [{"device_pin_fraction": 1.5}, {"device_pin_sessions": 0}])
def test_pin_settings_reject_bad_values(extra: dict) -> None:
    with pytest.raises(ValueError):
        pin_settings(extra, 17)


def test_control_server_queues_device_commands_and_reports_the_pins() -> None:
    import httpx

    from engine_ext.control import ControlServer, ControlService, service_on
    from engine_ext.pinned_policy import PinnedLRUCachePolicy

    pool = _pool()
    pins = DevicePins(pool, max_blocks=8)
    _finish(pins, pool, "s", 3, ttl=None)
    clock = lambda: 100.0  # noqa: E731
    srv = ControlServer(
        ControlService(PinnedLRUCachePolicy(16, clock=clock), lambda: {"host": {}, "tiers": {}}),
        "127.0.0.1",
        0,
        "t",
    )
    srv.start()
    url, auth = f"http://127.0.0.1:{srv.port}", {"Authorization": "Bearer t"}
    try:
        service = service_on(0)
        assert service is srv.service
        assert httpx.get(f"{url}/v1/kv/stats", headers=auth).json()["device"] is None
        service.attach_device(pins, clock)
        r = httpx.post(f"{url}/v1/kv/pin", json={"session_id": "s", "ttl_s": 30}, headers=auth).json()
        assert r["device"] == {"queued": True, "known_blocks": 3} and pins.num_pinned_blocks == 0
        pins.apply_commands()  # what the scheduler does at its next step
        stats = httpx.get(f"{url}/v1/kv/stats", headers=auth).json()["device"]
        assert stats["pinned_blocks"] == 3 and stats["sessions"] == {"s": {"blocks": 3, "ttl_left_s": 30.0}}
        session = httpx.get(f"{url}/v1/kv/sessions/s", headers=auth).json()
        assert session["device_pin"] == {"blocks": 3, "ttl_left_s": 30.0}
        text = httpx.get(f"{url}/metrics", headers=auth).text
        assert "agentgw_kv_device_pinned_blocks 3\n" in text
        assert 'agentgw_kv_device_pin_releases_total{reason="released"} 0\n' in text
        assert httpx.get(f"{url}/metrics").status_code == 401
        httpx.post(f"{url}/v1/kv/unpin", json={"session_id": "s"}, headers=auth)
        pins.apply_commands()
        assert pins.num_pinned_blocks == 0 and pins.known_blocks("s") == 3
        httpx.post(f"{url}/v1/kv/evict", json={"session_id": "s"}, headers=auth)
        pins.apply_commands()
        assert pins.known_blocks("s") == 0
    finally:
        srv.stop()
    assert service_on(0) is None
