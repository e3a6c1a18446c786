"""A turn that shares no prefix with its session's last turn restarts the session."""

from __future__ import annotations

import pytest

from gateway.core.hints import AgentHints
from gateway.core.sessions import MAX_HASHES, SessionRecord
from gateway.core.turn import Turn, place, prepare, restarts, settle
from gateway.core.types import Decision, EngineView, PoolRole

M = "m"
ENGINES = (
    EngineView("e0", "p", PoolRole.ANY, frozenset({M})),
    EngineView("e1", "p", PoolRole.ANY, frozenset({M})),
)


def record(hashes: list[int], turns: int = 3, model: str | None = M, first: bool = True) -> SessionRecord:
    rec = SessionRecord("s", home="e1", pool="p", turns=turns, context_tokens=64 * len(hashes), model=model)
    rec.prefix_hashes = hashes[-MAX_HASHES:]
    rec.first_hash = hashes[0] if (first and hashes) else None
    return rec


def turn(hashes: list[int], model: str = M) -> Turn:
    return Turn(model, 64 * len(hashes) + 10, 64, AgentHints(session_id="s"), hashes)


LONG = list(range(1, MAX_HASHES + 11))  # a chain the record keeps only the tail of


@pytest.mark.parametrize(
    ("rec", "t", "expected", "why"),
    [
        (record([1, 2, 3]), turn([1, 2, 3, 4]), False, "the next turn extends the last one"),
        (record([1, 2, 3]), turn([1, 9]), False, "a rewritten tail still shares the first block"),
        (record([1, 2, 3]), turn([7, 8, 9]), True, "nothing shared: an unrelated conversation"),
        (record([1, 2, 3], turns=0), turn([7, 8]), False, "no completed turn yet (e.g. hints only)"),
        (record([1, 2, 3]), turn([]), False, "a prompt shorter than a block says nothing"),
        (record([]), turn([7, 8]), False, "the last turn was shorter than a block"),
        (record([1, 2, 3]), turn([7, 8], model="other"), False, "another model's hashes differ anyway"),
        (record([1, 2, 3], model=None), turn([7, 8]), True, "a record of no model compares"),
        (record(LONG), turn([*LONG, 99]), False, "a long chain whose first block the record kept apart"),
        (record(LONG), turn([5, 6]), True, "a long chain, nothing shared"),
        (
            record([1, 2, 3], first=False),
            turn([7]),
            True,
            "a record without first_hash: its first kept block",
        ),
        (record(LONG, first=False), turn([7]), False, "truncated and no first_hash: cannot tell, no restart"),
        (None, turn([7]), False, "no record"),
    ],
)
def test_restarts(rec, t, expected, why) -> None:  # type: ignore[no-untyped-def]
    assert restarts(rec, t) is expected, why


def test_a_restarted_session_is_routed_and_recorded_as_new() -> None:
    rec = record([1, 2, 3])
    rec.observed_gaps = [4.0, 5.0]
    t = turn([7, 8, 9])
    _, snap = prepare(t, rec, None, {}, {}, ENGINES, {})
    assert snap.session is not None and snap.session.home is None and snap.session.turns == 0
    d = Decision("e0", "p", "new_session", "agentic", 0, t.prompt_tokens)
    new = place(rec, d, t, now=100.0)
    assert (new.home, new.turns, new.observed_gaps, new.inflight) == ("e0", 0, [], 1)
    done = settle(new, "e0", "e0", True, 101.0, t)
    assert done is not None and (done.turns, done.first_hash) == (1, 7)
    # the next turn of the new conversation continues it
    assert not restarts(done, turn([7, 8, 9, 10]))


def test_the_first_hash_round_trips() -> None:
    r = SessionRecord("s")
    r.record_turn(1.0, 640, [5, 6])
    assert r.first_hash == 5
    assert SessionRecord.from_dict(r.to_dict()) == r
    assert (
        SessionRecord.from_dict({k: v for k, v in r.to_dict().items() if k != "first_hash"}).first_hash
        is None
    )


def test_a_turn_hashed_approximately_neither_restarts_nor_overwrites_an_exact_session() -> None:
    """Under load the prompt analysis may not finish in time and the turn is hashed over its
    text instead (approximate hashes): those never equal the exact ones of the same prompt, so
    comparing them would restart the session (its home lost, routed as a new session's), and
    writing them would leave the next exact turn nothing to compare with."""
    rec = record([1, 2, 3])
    rec.hashes_exact = True
    approx = Turn(M, 64 * 3 + 10, 64, AgentHints(session_id="s"), [701, 702, 703], exact=False)
    assert not restarts(rec, approx)
    _, snap = prepare(approx, rec, None, {}, {}, ENGINES, {})
    assert snap.session is not None and snap.session.home == "e1"
    d = Decision("e1", "p", "sticky", "agentic", 0, approx.prompt_tokens)
    after = settle(place(rec, d, approx, 10.0), "e1", "e1", True, 11.0, approx)
    assert after is not None and after.turns == 4
    assert (after.first_hash, after.prefix_hashes, after.hashes_exact) == (1, [1, 2, 3], True)
    assert restarts(after, turn([7, 8, 9]))  # an exact unrelated prompt still restarts it
    assert not restarts(after, turn([1, 2, 3, 4]))
    # a session analysed approximately so far takes the first exact hashes
    loose = SessionRecord("t", home="e0", pool="p")
    loose.record_turn(1.0, 100, [701, 702], exact=False)
    assert not restarts(loose, turn([1, 2]))
    loose.record_turn(2.0, 130, [1, 2], exact=True)
    assert (loose.first_hash, loose.hashes_exact) == (1, True)
    assert SessionRecord.from_dict(loose.to_dict()).hashes_exact is True
