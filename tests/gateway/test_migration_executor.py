"""The migration executor's bookkeeping: `current` holds each live session's latest migration and
nothing of a session that is gone, and stays bounded; a replaced migration's end never drops its
successor. The engines' control API is an `httpx.MockTransport` (no sockets)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.config import load_config
from gateway.core.planner import ActionKind, MoveState, PlanAction, PlannerParams
from gateway.core.router import Router, RoutingParams
from gateway.core.routing import RoutingCore
from gateway.core.sessions import SessionRecord
from gateway.service import migrations as migrations_module
from gateway.service.cluster import Cluster
from gateway.service.metrics import GatewayMetrics
from gateway.service.migrations import MigrationExecutor
from gateway.service.session_store import MemorySessionStore

CFG = {
    "pools": [
        {
            "name": "first_turn",
            "role": "first_turn",
            "engines": [{"name": "a", "url": "http://a:1", "model": "m", "control_url": "http://a:2"}],
        },
        {
            "name": "warm",
            "role": "warm",
            "engines": [{"name": "b", "url": "http://b:1", "model": "m", "control_url": "http://b:2"}],
        },
    ],
}


class ControlApi:
    """Stand-in engine_ext control endpoints: records calls; `hold` keeps them pending."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = asyncio.Event()
        self.release.set()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.url.host}{request.url.path}")
        await self.release.wait()
        return httpx.Response(200, json={})


@pytest.fixture
def control() -> ControlApi:
    return ControlApi()


@pytest.fixture
def executor(control: ControlApi) -> MigrationExecutor:
    config = load_config(None, **CFG)
    client = httpx.AsyncClient(transport=httpx.MockTransport(control.handler))
    return MigrationExecutor(
        config.migration,
        client,
        Cluster(config, client),
        MemorySessionStore(capacity=100, ttl_s=600),
        GatewayMetrics(),
        clock=lambda: 0.0,
    )


async def settle(ex: MigrationExecutor) -> None:
    for _ in range(50):
        if not ex._tasks:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"migrations still running: {list(ex._tasks)}")


def metric(ex: MigrationExecutor, name: str, labels: dict[str, str]) -> float:
    value = ex.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_a_finished_migration_stays_while_its_session_lives_and_an_ended_sessions_release_leaves(
    executor: MigrationExecutor, control: ControlApi
) -> None:
    await executor.sessions.put(SessionRecord("s1", created=0.0, last_activity=0.0, home="a"))
    control.release.clear()
    m = executor.submit(PlanAction(ActionKind.STAY, "s1", "a", pin_ttl_s=30, reason="expected_gap"), None)
    await asyncio.sleep(0.01)
    assert executor.current == {"s1": m} and m.state == "running"
    control.release.set()
    await settle(executor)
    assert executor.current == {"s1": m} and m.state == "done"  # the session API shows it
    # what GatewayService.end_session does: cancel what is pending, forget the session, release
    executor.cancel("s1", reason="session_end")
    await executor.sessions.delete("s1")
    executor.submit(PlanAction(ActionKind.RELEASE, "s1", "a", reason="session_end"), None)
    await settle(executor)
    assert control.calls == ["a/v1/kv/pin", "a/v1/kv/unpin"]
    assert executor.current == {}
    assert [(r.action.kind, r.state) for r in executor.recent] == [
        (ActionKind.STAY, "done"),
        (ActionKind.RELEASE, "done"),
    ]


async def test_a_migration_of_an_unknown_or_expired_session_leaves_when_it_finishes(
    executor: MigrationExecutor,
) -> None:
    executor.submit(PlanAction(ActionKind.DEMOTE, "gone", "a", pin_ttl_s=30), None)
    await settle(executor)
    assert executor.current == {} and executor.recent[-1].state == "done"


async def test_a_completed_move_waits_for_the_next_turn_then_leaves(executor: MigrationExecutor) -> None:
    await executor.sessions.put(
        SessionRecord("s1", created=0.0, last_activity=0.0, home="a", pool="first_turn")
    )
    move = PlanAction(ActionKind.MOVE, "s1", "a", ("b",), pin_ttl_s=30, reason="first_turn_to_warm")
    executor.submit(move, [1, 2, 3])
    await settle(executor)
    assert executor.current["s1"].state == "done"  # the next turn reads how it served
    rec = await executor.sessions.get("s1", 0.0)
    assert rec is not None and rec.home == "b"
    executor.on_next_turn("s1", "b", cached_fraction=1.0)
    assert executor.current == {}
    assert metric(executor, "agentgw_moved_next_turn_total", {"outcome": "hit"}) == 1


async def test_finished_migrations_kept_for_live_sessions_are_bounded(
    executor: MigrationExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrations_module, "MAX_FINISHED", 2)
    for i in range(3):
        sid = f"s{i}"
        await executor.sessions.put(SessionRecord(sid, created=0.0, last_activity=0.0, home="a"))
        executor.submit(PlanAction(ActionKind.MOVE, sid, "a", ("b",), reason="first_turn_to_warm"), [1])
        await settle(executor)
    assert sorted(executor.current) == ["s1", "s2"]  # the oldest was dropped


async def test_a_replaced_migration_never_drops_its_successor(
    executor: MigrationExecutor, control: ControlApi
) -> None:
    control.release.clear()
    executor.submit(PlanAction(ActionKind.STAY, "s1", "a", pin_ttl_s=30), None)
    await asyncio.sleep(0.01)
    second = executor.submit(PlanAction(ActionKind.DEMOTE, "s1", "a", pin_ttl_s=60), None)
    await asyncio.sleep(0.01)  # the first one's cancellation has run its done callback by now
    assert executor.current == {"s1": second}
    assert executor.cancel("s1", reason="session_end")  # still tracked, so it can be cancelled
    await asyncio.sleep(0.01)
    assert executor.current == {} and not executor._tasks
    assert [(r.state, r.error) for r in executor.recent] == [
        ("cancelled", "new_plan"),
        ("cancelled", "session_end"),
    ]
    control.release.set()


async def test_a_knee_ahead_move_rehomes_then_releases_its_move_bounds(
    executor: MigrationExecutor, control: ControlApi
) -> None:
    """The routing core keeps the planner's move state; the executor reports to it: a completed
    move re-homes the session (the core's homes follow it) and frees its bounds; a cancelled one
    frees them too, and re-homes nothing."""
    params = PlannerParams()
    core = RoutingCore(Router(RoutingParams()), 1000)
    executor.on_rehome = core.on_moved
    executor.on_move_end = core.move_ended
    for sid in ("s1", "s2"):
        await executor.sessions.put(SessionRecord(sid, created=0.0, last_activity=0.0, home="b", pool="warm"))
        core.homes.placed(sid, "b", 0.0)
        core.homes.settled(sid, "b", 1000, 0.0)
    core.moves = MoveState().started("s1", "b", "a", 0.0, params, 1000)
    executor.submit(PlanAction(ActionKind.MOVE, "s1", "b", ("a",), pin_ttl_s=30, reason="knee_ahead"), [1, 2])
    await settle(executor)
    rec = await executor.sessions.get("s1", 0.0)
    assert rec is not None and rec.home == "a"
    assert core.homes.on_engine("a") == ["s1"]
    assert core.moves.inflight == {} and dict(core.moves.active) == {}
    assert core.moves.moved_at == {"s1": 0.0}  # the dwell remembers it
    control.release.clear()
    core.moves = core.moves.started("s2", "b", "a", 1.0, params, 1000)
    executor.submit(PlanAction(ActionKind.MOVE, "s2", "b", ("a",), pin_ttl_s=30, reason="knee_ahead"), [1, 2])
    await asyncio.sleep(0.01)
    assert core.moves.inflight == {"s2": ("b", "a", 1000)}
    assert executor.cancel("s2", reason="next_turn_arrived")
    assert core.moves.inflight == {} and dict(core.moves.active) == {}
    assert core.homes.on_engine("b") == ["s2"]  # no re-home for a cancelled move
    control.release.set()
    moves = "agentgw_moves_total"
    assert metric(executor, moves, {"reason": "knee_ahead", "outcome": "started"}) == 2
    assert metric(executor, moves, {"reason": "knee_ahead", "outcome": "completed"}) == 1
    assert metric(executor, moves, {"reason": "knee_ahead", "outcome": "cancelled_next_turn_arrived"}) == 1


async def test_a_move_whose_session_was_placed_again_meanwhile_is_counted_stale(
    executor: MigrationExecutor, control: ControlApi
) -> None:
    """The copy finished, but a turn placed the session elsewhere in the meantime: the home stays
    where that placement put it, and the move counts as ``stale``, not ``completed``."""
    await executor.sessions.put(SessionRecord("s1", created=0.0, last_activity=0.0, home="b", pool="warm"))
    control.release.clear()
    executor.submit(PlanAction(ActionKind.MOVE, "s1", "b", ("a",), reason="knee_ahead"), [1, 2])
    await asyncio.sleep(0.01)

    def placed_on_c(rec: SessionRecord | None) -> SessionRecord | None:
        assert rec is not None
        rec.home = "c"
        return rec

    await executor.sessions.update("s1", 0.0, placed_on_c)
    control.release.set()
    await settle(executor)
    rec = await executor.sessions.get("s1", 0.0)
    assert rec is not None and rec.home == "c"
    labels = {"reason": "knee_ahead"}
    assert metric(executor, "agentgw_moves_total", {**labels, "outcome": "stale"}) == 1
    assert metric(executor, "agentgw_moves_total", {**labels, "outcome": "completed"}) == 0
