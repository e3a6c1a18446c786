"""Table-driven tests of the gateway's load ledger (``gateway/core/load.py``) and its merge into
engine views: phases, idempotence, unknown engines, the scrape's lower bound on decoding."""

from __future__ import annotations

import pytest

from gateway.core.load import EngineCounts, InflightLoad, merge
from gateway.core.types import EngineView, PoolRole


def view(**kw: object) -> EngineView:
    return EngineView(name="a", pool="p", role=PoolRole.WARM, models=frozenset({"m"}), **kw)  # type: ignore[arg-type]


# each step: (action, ticket index or uncached tokens) -> expected (prefilling, backlog, decoding) of "a"
SCENARIOS = {
    "prefill then decode then done": [
        ("sent", 1000, (1, 1000, 0)),
        ("first", 0, (0, 0, 1)),
        ("finished", 0, (0, 0, 0)),
    ],
    "two in flight, one answered": [
        ("sent", 1000, (1, 1000, 0)),
        ("sent", 300, (2, 1300, 0)),
        ("first", 1, (1, 1000, 1)),
        ("finished", 0, (0, 0, 1)),  # finished without a first byte: out of the backlog
        ("finished", 1, (0, 0, 0)),
    ],
    "idempotent": [
        ("sent", 50, (1, 50, 0)),
        ("first", 0, (0, 0, 1)),
        ("first", 0, (0, 0, 1)),
        ("finished", 0, (0, 0, 0)),
        ("finished", 0, (0, 0, 0)),
        ("first", 0, (0, 0, 0)),
    ],
    "non-streamed answer": [
        ("sent", 700, (1, 700, 0)),
        ("last", 0, (0, 0, 0)),
        ("finished", 0, (0, 0, 0)),
    ],
    "negative tokens count as 0": [("sent", -5, (1, 0, 0)), ("finished", 0, (0, 0, 0))],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_ledger_phases(name: str) -> None:
    load = InflightLoad(["a", "b"])
    tickets = []
    for action, arg, expected in SCENARIOS[name]:
        if action == "sent":
            tickets.append(load.sent("a", arg))
        elif action == "first":
            load.first_byte(tickets[arg])
        elif action == "last":
            load.first_byte(tickets[arg], decoding=False)
        else:
            load.finished(tickets[arg])
        c = load.of("a")
        assert (c.prefilling, c.backlog_tokens, c.decoding) == expected, (name, action, arg)
        assert load.of("b") == EngineCounts()


def test_unknown_engine_is_not_accounted() -> None:
    load = InflightLoad(["a"])
    t = load.sent("zz", 100)
    assert not load.first_byte(t)
    assert not load.finished(t)
    assert "zz" not in load.counts
    assert load.of("zz") == EngineCounts()


@pytest.mark.parametrize(
    ("running", "own", "decoding", "backlog"),
    [
        (0, EngineCounts(), 0, 0),
        (0, EngineCounts(prefilling=2, backlog_tokens=900, decoding=1), 1, 900),
        (5, EngineCounts(prefilling=2, backlog_tokens=900, decoding=1), 3, 900),  # other replicas'
        (1, EngineCounts(prefilling=2, backlog_tokens=900, decoding=0), 0, 900),  # stale scrape
        (4, EngineCounts(), 4, 0),
    ],
)
def test_merge(running: int, own: EngineCounts, decoding: int, backlog: int) -> None:
    v = merge(view(running=running), own)
    assert (v.decoding, v.prefill_backlog_tokens) == (decoding, backlog)
    assert (v.running, v.name) == (running, "a")


def test_in_flight_tokens_count_from_sending_to_finishing() -> None:
    """The whole prompt counts from ``sent`` until ``finished`` (or a non-streamed answer's last
    byte), whatever the phase; it never goes below the uncached tokens; merge copies it."""
    load = InflightLoad(["a"])
    t1 = load.sent("a", 100, 5000)
    t2 = load.sent("a", 700, 300)  # a prompt smaller than its uncached part: the uncached count
    assert load.of("a").tokens == 5700
    load.first_byte(t1)
    assert load.of("a").tokens == 5700
    assert merge(view(), load.of("a")).inflight_tokens == 5700
    load.finished(t1)
    load.finished(t1)
    assert load.of("a").tokens == 700
    load.first_byte(t2, decoding=False)
    load.finished(t2)
    assert load.of("a") == EngineCounts()
    assert merge(view(), load.of("a")).inflight_tokens == 0


@pytest.mark.parametrize(
    ("kv_usage", "pinned", "tokens", "capacity", "expected"),
    [
        (0.3, 0.0, 0, 100, 0.3),  # no ledger: the gauge
        (0.3, 0.2, 0, 100, 0.1),  # soft pins yield
        (0.1, 0.0, 64 * 40, 100, 0.4),  # in flight but not yet in the gauge: the ledger leads
        (0.5, 0.0, 64 * 40, 100, 0.5),  # the gauge counts more (other replicas): the gauge
        (0.1, 0.0, 64 * 40 + 1, 100, 0.41),  # a partial block is a block
        (0.1, 0.0, 64 * 40, 0, 0.1),  # capacity unknown: the gauge
    ],
)
def test_kv_share(kv_usage: float, pinned: float, tokens: int, capacity: int, expected: float) -> None:
    v = view(kv_usage=kv_usage, pinned_share=pinned, inflight_tokens=tokens, capacity_blocks=capacity)
    assert v.kv_share(64) == pytest.approx(expected)
