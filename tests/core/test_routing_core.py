"""The routing core's three moments: arrival reads only, routed commits, finished undoes what was
in flight and records the turn."""

from __future__ import annotations

from gateway.core.hints import AgentHints
from gateway.core.router import Router, RoutingParams
from gateway.core.routing import RoutingCore, Write
from gateway.core.sessions import SessionRecord, SessionTable
from gateway.core.turn import IndexKind, Turn
from gateway.core.types import EngineView, PoolRole

M = frozenset({"m"})
ENGINES = (
    EngineView("e0", "p", PoolRole.ANY, M),
    EngineView("e1", "p", PoolRole.ANY, M),
)


def core() -> RoutingCore:
    return RoutingCore(Router(RoutingParams(profile="agentic")), 1024)


def apply(table: SessionTable, writes: list[Write], now: float) -> None:
    for w in writes:
        w.done(table.update(w.session_id, now, w.apply))


def turn(sid: str | None, parent: str | None = None, hashes: tuple[int, ...] = (1, 2, 3)) -> Turn:
    return Turn("m", 48, 16, AgentHints(session_id=sid, parent_session_id=parent), hashes)


def test_arrival_reads_only() -> None:
    c = core()
    a = c.on_arrival(turn("s", parent="p"), IndexKind.APPROX, None, None, ENGINES, 0.0)
    c.decide(a)
    assert len(c.homes) == 0 and len(c.siblings) == 0
    assert c.indexes[IndexKind.APPROX].match([1, 2, 3]) == {}


def test_a_routed_turn_homes_its_session_and_its_prefix_then_finishing_settles_it() -> None:
    c, table = core(), SessionTable()
    parent = SessionRecord("p", last_activity=0.0)
    table.put(parent)
    a = c.on_arrival(turn("s", parent="p"), IndexKind.APPROX, None, parent, ENGINES, 1.0)
    d = c.decide(a)
    apply(table, c.on_routed(a, d, 1.0), 1.0)
    rec = table.get("s", 1.0)
    assert rec is not None and rec.home == d.engine and rec.inflight == 1
    assert c.siblings.view("p") == {d.engine: 1} and parent.children == ["s"]
    assert c.indexes[IndexKind.APPROX].match([1, 2, 3])[d.engine].blocks == 3
    assert c.homes.on_engine(d.engine) == ["s"]
    apply(table, c.on_finished(a, d, d.engine, True, 2.0), 2.0)
    rec = table.get("s", 2.0)
    assert rec is not None and rec.inflight == 0 and rec.turns == 1 and rec.context_tokens == 48
    assert c.siblings.view("p") == {}
    assert c.homes.homed(2.0) == {d.engine: 48}


def test_the_next_turn_sees_the_home_and_a_precise_turn_leaves_the_approximate_index_alone() -> None:
    c, table = core(), SessionTable()
    a = c.on_arrival(turn("s"), IndexKind.PRECISE, None, None, ENGINES, 0.0)
    d = c.decide(a)
    apply(table, c.on_routed(a, d, 0.0), 0.0)
    apply(table, c.on_finished(a, d, d.engine, True, 1.0), 1.0)
    assert c.indexes[IndexKind.APPROX].match([1, 2, 3]) == {}
    nxt = c.on_arrival(turn("s"), IndexKind.PRECISE, table.get("s", 2.0), None, ENGINES, 2.0)
    assert nxt.request.session_id == "s" and nxt.snapshot.session is not None
    assert nxt.snapshot.session.home == d.engine and c.decide(nxt).engine == d.engine


def test_a_session_turn_without_a_session_writes_nothing_and_an_ending_turn_leaves_the_record() -> None:
    c, table = core(), SessionTable()
    a = c.on_arrival(turn(None), IndexKind.PRECISE, None, None, ENGINES, 0.0)
    d = c.decide(a)
    assert c.on_routed(a, d, 0.0) == [] and c.on_finished(a, d, d.engine, True, 0.0) == []
    end = Turn("m", 48, 16, AgentHints(session_id="s", session_end=True), (1,))
    a = c.on_arrival(end, IndexKind.PRECISE, None, None, ENGINES, 0.0)
    apply(table, c.on_routed(a, d, 0.0), 0.0)
    assert c.on_finished(a, d, d.engine, True, 1.0) == []  # the caller ends the session
    c.on_ended("s")
    assert len(c.homes) == 0
