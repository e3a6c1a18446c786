"""A stored response whose owner record is missing (Redis restarted empty, or the record expired
while the engine kept the response) is looked for on the engines: found, the chain goes on at its
engine and the record is written again; found nowhere, it is the usual not-found answer, and the
id is remembered as missing for a few seconds; an engine that may hold it but does not answer
makes it a 503 to retry, never a chain ended for good. With tenants the engines are not asked.
(Against real vLLM engines: tests/gateway/test_responses_store_e2e.py.)"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Collection
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.core.router import Router
from gateway.errors import Refused, UpstreamFailed
from gateway.service import responses
from gateway.service.cluster import Cluster
from gateway.service.gateway import GatewayService
from gateway.service.metrics import GatewayMetrics
from gateway.service.proxy import make_upstream
from gateway.service.responses import ResponseOwners, engine_search, owner_key
from gateway.service.session_store import MemorySessionStore

RID = "resp_0123abcd"


class Engines:
    """Engines answering ``GET /v1/responses/{id}``: each holds some ids, refuses connections,
    or never answers."""

    def __init__(
        self,
        held: dict[str, set[str]],
        refusing: Collection[str] = (),
        silent: Collection[str] = (),
        resetting: Collection[str] = (),
    ):
        self.held = held
        self.refusing = refusing
        self.silent = silent
        self.resetting = resetting
        self.calls: list[tuple[str, str, str]] = []
        self.outcomes: Counter[str] = Counter()

    def listed(self) -> list[tuple[str, str]]:
        return [(name, "p") for name in self.held]

    async def call(self, engine: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        self.calls.append((engine, method, path))
        if engine in self.refusing:
            raise UpstreamFailed(f"engine '{engine}' failed: ConnectionRefused", True, refused=True)
        if engine in self.resetting:  # a stale keep-alive connection: the request never got out
            raise UpstreamFailed(f"engine '{engine}' failed: ReadError", True)
        if engine in self.silent:
            await asyncio.sleep(3600)
        rid = path.rsplit("/", 1)[1]
        if rid in self.held[engine]:
            return 200, b'{"id": "%s", "object": "response"}' % rid.encode()
        return 404, b'{"error": {"message": "not found"}}'


def owners(
    engines: Engines, timeout_s: float = 5.0
) -> tuple[ResponseOwners, MemorySessionStore, list[float]]:
    now = [1000.0]
    store = MemorySessionStore(100, 3600.0)
    find = engine_search(engines.listed, engines.call, timeout_s)
    found = ResponseOwners(store, lambda: now[0], find, on_search=lambda o: engines.outcomes.update([o]))
    return found, store, now


def test_a_missing_record_is_found_on_the_engine_that_holds_it_and_written_again() -> None:
    engines = Engines({"e1": set(), "e2": {RID}, "e3": set()})
    found, store, now = owners(engines)

    async def run() -> None:
        assert await found.owner(RID) == "e2"
        assert sorted(c[0] for c in engines.calls) == ["e1", "e2", "e3"]
        assert engines.calls[0][1:] == ("GET", f"/v1/responses/{RID}")
        rec = await store.get(owner_key(RID), now[0])
        assert rec is not None and rec.home == "e2" and rec.pool == "p"
        engines.calls.clear()
        assert await found.owner(RID) == "e2"  # the record again: no call
        assert engines.calls == []

    asyncio.run(run())
    assert engines.outcomes == {"found": 1}


def test_an_id_found_nowhere_is_not_found_and_not_asked_again_for_a_few_seconds() -> None:
    engines = Engines({"e1": set(), "e2": set()}, refusing={"e2"})  # e2 down: known gone, not silent
    found, _, now = owners(engines)

    async def run() -> None:
        assert await found.owner(RID) is None
        assert len(engines.calls) == 2
        assert await found.owner(RID) is None
        assert len(engines.calls) == 2  # remembered missing
        now[0] += responses.MISS_TTL_S + 1
        assert await found.owner(RID) is None
        assert len(engines.calls) == 4

    asyncio.run(run())
    assert engines.outcomes == {"not_found": 2, "remembered_missing": 1}


def test_the_missing_ids_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(responses, "MISSES", 3)
    found, _, _ = owners(Engines({"e1": set()}))

    async def run() -> None:
        for i in range(10):
            assert await found.owner(f"resp_{i}") is None

    asyncio.run(run())
    assert list(found._missing) == ["resp_7", "resp_8", "resp_9"]


def test_an_engine_that_does_not_answer_makes_it_a_503_to_retry_not_a_lost_chain() -> None:
    engines = Engines({"e1": set(), "e2": set()}, silent={"e2"})
    found, _, _ = owners(engines, timeout_s=0.2)

    async def run() -> None:
        with pytest.raises(Refused) as exc:
            await found.owner(RID, "response_id")
        assert exc.value.code == "owner_unavailable" and exc.value.field == "response_id"
        assert "'e2'" in str(exc.value)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []  # asks cancelled

    asyncio.run(run())
    # and it is not remembered as missing: the retry asks again
    assert found._missing == {}


def test_one_holder_answers_at_once_though_another_is_silent() -> None:
    engines = Engines({"e1": {RID}, "e2": set()}, silent={"e2"})
    found, _, _ = owners(engines, timeout_s=30)
    assert asyncio.run(asyncio.wait_for(found.owner(RID), 5)) == "e1"


def _config(sessions: dict[str, Any] | None = None, **auth: Any) -> GatewayConfig:
    engines = [{"name": "e1", "url": "http://127.0.0.1:9", "model": "m"}]
    pools = [{"name": "p", "role": "any", "engines": engines}]
    return GatewayConfig.model_validate({"pools": pools, "auth": auth, "sessions": sessions or {}})


def _service_finds(config: GatewayConfig) -> bool:
    """Does the service the app builds from ``config`` look for missing owner records?"""

    async def build() -> bool:
        upstream = make_upstream(config, None)
        try:
            cluster = Cluster(config, upstream.http)
            store = MemorySessionStore(config.sessions.capacity, config.sessions.ttl_s)
            service = GatewayService(
                config, upstream, cluster, Router(config.router_params()), GatewayMetrics(), store
            )
            return service.placement.owners.find is not None
        finally:
            await upstream.http.aclose()

    return asyncio.run(build())


def test_the_gateway_searches_only_without_tenants() -> None:
    assert _service_finds(_config())
    assert not _service_finds(_config(tenants=[{"name": "t", "key_sha256": ["0" * 64]}]))
    assert not _service_finds(_config({"discover_response_owners": False}))


def test_an_engine_whose_connection_broke_makes_it_a_503_but_one_refusing_is_gone() -> None:
    """Only a refused connection says an engine is gone (its stored responses with it); a reset
    or a request it could not be sent (under load) says nothing: a 503 to retry, not a not-found
    that ends the chain."""
    found, _, _ = owners(Engines({"e1": set(), "e2": set()}, resetting={"e2"}))

    async def run() -> None:
        with pytest.raises(Refused) as exc:
            await found.owner(RID)
        assert exc.value.code == "owner_unavailable" and "'e2'" in str(exc.value)

    asyncio.run(run())
    gone, _, _ = owners(Engines({"e1": set(), "e2": set()}, refusing={"e2"}))
    assert asyncio.run(gone.owner(RID)) is None


def test_the_engines_are_read_after_the_owner_lookup_so_a_readmission_meanwhile_is_seen() -> None:
    """The owner's lookup may wait (its store pushing back after an outage, a search): an owner
    re-admitted during that wait is the turn's engine, not gone (the views used to be read
    before the lookup: a healthy owner then looked gone and the chain ended not-found)."""
    from gateway.api.responses_routes import parse

    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{9 + i}", "model": "m"} for i in (1, 2)]
    config = GatewayConfig.model_validate({"pools": [{"name": "p", "role": "any", "engines": engines}]})

    async def run() -> str:
        upstream = make_upstream(config, None)
        try:
            cluster = Cluster(config, upstream.http)
            cluster.record_probe("e1", True)
            cluster.record_probe("e2", True)  # e2 up: no panic mode keeping e1 in the views
            cluster.record_connect_failure("e1", refused=False)  # ejected (a reset), not gone
            store = MemorySessionStore(config.sessions.capacity, config.sessions.ttl_s)
            service = GatewayService(
                config, upstream, cluster, Router(config.router_params()), GatewayMetrics(), store
            )
            owners_ = service.placement.owners

            async def lookup(response_id: str, field: str = "previous_response_id") -> tuple[str, float]:
                assert not cluster.engines["e1"].healthy
                cluster.engines["e1"].healthy = True  # re-admitted while the lookup waited
                return "e1", 1.0

            owners_.lookup = lookup  # type: ignore[method-assign]
            body = b'{"model": "m", "input": "next", "previous_response_id": "%s"}' % RID.encode()
            a = await service.analyze(parse(body), [])
            return service.decide(a).engine
        finally:
            await upstream.http.aclose()

    assert asyncio.run(run()) == "e1"
