"""benchmarks/knee_live.py's pure parts: the modes' gateway configs, the plays, and how next
turns are told apart (local hit, moved, moved at arrival). The run itself needs 3 engines and is
a benchmark (docs/benchmarks_live.md)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.knee_live import mode_config, next_turns, plays_for, round_ratio
from benchmarks.live_replay import LiveRecord


def rec(session: str, idx: int, engine: str, t: float, reason: str = "sticky", error: str = "") -> LiveRecord:
    return LiveRecord(
        play="p",
        stream="root",
        idx=idx,
        session_id=session,
        engine=engine,
        t_arrive=t,
        t_first=t + 0.1,
        t_last=t + 0.5,
        input_tokens=1000,
        output_tokens=8,
        cached_tokens=900,
        error=error,
        reason=reason,
    )


def test_next_turns_split_by_the_previous_turns_engine() -> None:
    records = [
        rec("s1", 0, "e0", 0.0, "new_session"),
        rec("s1", 1, "e0", 1.0),  # local
        rec("s1", 2, "e1", 2.0, "sticky"),  # moved (re-homed during the gap)
        rec("s1", 3, "e2", 3.0, "kv_balance"),  # moved at arrival
        rec("s2", 5, "e1", 0.5, "new_session"),
        rec("s2", 6, "e0", 1.5, "kv_overflow", error="boom"),  # failed: not a next turn
        rec("s2", 7, "e1", 2.5),  # its previous turn failed: skipped too
    ]
    nt = next_turns(records)
    assert [r.idx for r in nt.local] == [1]
    assert [r.idx for r in nt.moved] == [2, 3]
    assert [r.idx for r in nt.moved_at_arrival] == [3]


def test_mode_configs() -> None:
    base = {"pools": [], "migration": {"control_token": "t"}}
    arrival = mode_config(base, "arrival")
    assert arrival["migration"] == {"control_token": "t", "enabled": False}
    ahead = mode_config(base, "ahead")
    assert ahead["migration"] == {"control_token": "t"}  # the default: the planner runs
    assert mode_config(base, "ahead", 3.0)["migration"] == {"control_token": "t", "turn_s": 3.0}
    assert mode_config(base, "arrival", 3.0)["migration"] == {"control_token": "t", "enabled": False}
    assert base == {"pools": [], "migration": {"control_token": "t"}}  # not changed in place
    with pytest.raises(ValueError, match="unknown mode"):
        mode_config(base, "later")


def test_plays_are_seeded_scaled_and_cut() -> None:
    args = argparse.Namespace(plays=3, seed=1, max_context=2048, max_output=16, max_requests=5)
    a, b = plays_for(args), plays_for(args)
    assert [p.play_id for p in a] == [p.play_id for p in b]
    assert [[r.input_tokens for r in p.requests] for p in a] == [
        [r.input_tokens for r in p.requests] for p in b
    ]
    for p in a:
        assert 0 < len(p.requests) <= 5
        assert all(r.input_tokens + r.output_tokens <= 2048 and r.output_tokens <= 16 for r in p.requests)


def test_round_ratio_is_a_turn_over_the_median_of_its_rounds_other_turns() -> None:
    def at(session: str, idx: int, ttft_s: float) -> LiveRecord:
        r = rec(session, idx, "e0", 10.0)
        r.t_first = 10.0 + ttft_s
        return r

    round2 = [at("knee-7-0", 2, 0.9), at("knee-7-1", 2, 0.3), at("knee-7-2", 2, 0.2), at("knee-7-3", 2, 0.4)]
    other_repeat = [at("knee-8-0", 2, 5.0)]
    other_round = [at("knee-7-1", 1, 5.0)]
    records = round2 + other_repeat + other_round
    assert round_ratio(round2[0], records, set()) == pytest.approx(0.9 / 0.3)
    # hot with hot only: 0 and 3 are hot, so 0's peer is 3
    assert round_ratio(round2[0], records, {"knee-7-0", "knee-7-3"}) == pytest.approx(0.9 / 0.4)
    assert round_ratio(round2[1], records, {"knee-7-0", "knee-7-3"}) == pytest.approx(0.3 / 0.2)
    assert round_ratio(other_repeat[0], records, set()) is None  # alone in its round
    assert round_ratio(rec("p1", 0, "e0", 0.0), records, set()) is None  # a play's turn


def test_report_reprints_the_next_turns_table_from_a_saved_run(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json
    from dataclasses import asdict

    from benchmarks.knee_live import main

    records = [
        rec("knee-1-0", 0, "e0", 0.0),
        rec("knee-1-0", 1, "e1", 5.0, "kv_balance"),
        rec("knee-1-1", 1, "e2", 5.0),
    ]
    path = tmp_path / "run.json"
    path.write_text(
        json.dumps({"modes": {"arrival": {"records": [asdict(r) for r in records], "planner_moves": {}}}})
    )
    assert main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "arrival" in out and "1: 100 / 100 ms, 90%, x1.00" in out
