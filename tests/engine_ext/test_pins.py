"""The pin table is pure: time is passed in."""

from __future__ import annotations

import pytest

from engine_ext.pins import PinHint, PinTable, parse_pin_hint


def test_pins_protect_until_the_deadline_then_lapse() -> None:
    table = PinTable()
    table.pin("s", [b"k1", b"k2"], until=10.0)
    assert table.pinned_keys(now=9.9) == {b"k1", b"k2"}
    assert table.pinned_keys(now=10.0) == set()
    assert table.expire(now=10.0) == ["s"]
    assert len(table) == 0


def test_repinning_resets_the_deadline_and_unpin_is_idempotent() -> None:
    table = PinTable()
    table.pin("s", [b"k"], until=5.0)
    table.pin("s", [], until=20.0)
    assert table.session("s", now=10.0) == {"session_id": "s", "num_keys": 1, "ttl_left_s": 10.0}
    assert table.unpin("s") is True
    assert table.unpin("s") is False


def test_the_table_is_bounded_by_dropping_the_earliest_deadline() -> None:
    table = PinTable(max_sessions=2)
    table.pin("a", [b"a"], until=1.0)
    table.pin("b", [b"b"], until=9.0)
    table.pin("c", [b"c"], until=5.0)
    assert sorted(table.sessions()) == ["b", "c"]


@pytest.mark.parametrize(
    ("params", "hint"),
    [
        (None, None),
        ({}, None),
        ({"agentgw": {"pin_ttl_s": 3}}, None),
        ({"agentgw": {"session_id": "s"}}, PinHint("s")),
        ({"agentgw": {"session_id": "s", "pin_ttl_s": 40}}, PinHint("s", 40.0)),
        ({"agentgw": {"session_id": "s", "pin_ttl_s": -1}}, PinHint("s")),
        ({"agentgw": {"session_id": "s", "release": True}}, PinHint("s", None, True)),
    ],
)
def test_parse_pin_hint(params, hint) -> None:
    assert parse_pin_hint(params) == hint
