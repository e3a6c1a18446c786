"""Per-tenant session quotas (``auth.tenants[].max_sessions``): a tenant past its quota loses its
own least recently active session, never another tenant's. The defect it fixes: 1,000 junk hint
POSTs from one key evicted a victim's session (one global LRU). Pure table tests, the config rule,
then a served gateway (memory and a real redis-server) where tenant A floods junk hints and
tenant B's session survives."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.config import ConfigError, load_config
from gateway.core.sessions import SessionRecord, SessionTable
from gateway.service.tenants import key_digest
from tests.conftest import ServedGateway, fake_engine, wait_ready

A_KEY, B_KEY, ADMIN_KEY = "sk-quota-a", "sk-quota-b", "sk-quota-admin"
MODEL = "quota-model"


def rec(sid: str, t: float) -> SessionRecord:
    return SessionRecord(sid, created=t, last_activity=t)


def test_a_tenant_past_its_quota_loses_its_own_oldest_session() -> None:
    t = SessionTable(capacity=10, ttl_s=100, quotas={"a": 3, "b": 3})
    t.put(rec("b:victim", 0))
    for i in range(20):
        t.put(rec(f"a:junk{i}", 1 + i))
    assert t.get("b:victim", 21) is not None
    assert [s for s in ("a:junk16", "a:junk17", "a:junk18", "a:junk19") if s in t] == [
        "a:junk17",
        "a:junk18",
        "a:junk19",
    ]
    assert t.namespace_count("a") == 3 and t.evicted_quota == 17 and t.evicted_capacity == 0


def test_capacity_evicts_ids_of_no_tenant_before_any_tenants() -> None:
    t = SessionTable(capacity=4, ttl_s=100, quotas={"a": 2, "b": 2})
    t.put(rec("b:old", 0))  # the oldest record of all
    for i in range(6):
        t.put(rec(f"loose{i}", 1 + i))  # an admin's or unknown prefix's ids: no quota
    t.put(rec("a:x", 10))
    assert "b:old" in t and "a:x" in t
    assert len(t) == 4 and t.evicted_capacity == 4
    assert "loose4" in t and "loose5" in t and "loose3" not in t
    # removal and TTL expiry keep the per-tenant counts right
    t.remove("a:x")
    assert t.namespace_count("a") == 0
    assert t.get("b:old", 200) is None and t.namespace_count("b") == 0 and t.expired == 1


def test_without_quotas_the_table_is_one_lru() -> None:
    t = SessionTable(capacity=2, ttl_s=100)
    for i in range(3):
        t.put(rec(f"a:{i}", i))
    assert "a:0" not in t and len(t) == 2 and t.evicted_capacity == 1


def test_quotas_fill_the_capacity_and_must_fit_it() -> None:
    cfg = load_config(
        None,
        sessions={"capacity": 100},
        auth={"tenants": [{"name": "a", "max_sessions": 40}, {"name": "b"}, {"name": "c"}]},
    )
    assert cfg.session_quotas() == {"a": 40, "b": 30, "c": 30}
    with pytest.raises(ConfigError, match=r"auth\.tenants: max_sessions .* sessions\.capacity 10"):
        load_config(None, sessions={"capacity": 10}, auth={"tenants": [{"name": "a", "max_sessions": 11}]})


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", MODEL) as url:
        yield url


def _gateway(engine_url: str, sessions: dict[str, object]) -> ServedGateway:
    return ServedGateway(
        {
            "pools": [{"name": "p", "engines": [{"name": "e0", "url": engine_url, "model": MODEL}]}],
            "sessions": {"capacity": 12, **sessions},
            "auth": {
                "tenants": [
                    {"name": "a", "key_sha256": [key_digest(A_KEY)], "max_sessions": 5},
                    {"name": "b", "key_sha256": [key_digest(B_KEY)], "max_sessions": 5},
                ],
                "admin_key_sha256": [key_digest(ADMIN_KEY)],
            },
        }
    )


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_junk_hints_from_one_tenant_never_evict_another_tenants_session(
    engine_url: str, redis_url: str, backend: str
) -> None:
    sessions: dict[str, object] = {"backend": backend}
    if backend == "redis":
        import redis

        redis.Redis.from_url(redis_url).flushdb()
        sessions["redis_url"] = redis_url
    with _gateway(engine_url, sessions) as gw:
        wait_ready(gw.url)
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            # tenant B's session: a real turn, then a hint
            r = c.post(
                "/v1/chat/completions",
                headers={**_auth(B_KEY), "x-session-id": "victim"},
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-agentgw-session"] == "victim"
            hint = {"expected_tool_latency_ms": 5000}
            assert (
                c.post("/v1/agent/sessions/victim/hints", headers=_auth(B_KEY), json=hint).status_code == 200
            )
            # tenant A floods junk sessions, far past its quota and the whole capacity
            for i in range(60):
                r = c.post(f"/v1/agent/sessions/junk{i}/hints", headers=_auth(A_KEY), json=hint)
                assert r.status_code == 200, r.text
            victim = c.get("/v1/agent/sessions/victim", headers=_auth(B_KEY))
            assert victim.status_code == 200, victim.text
            assert victim.json()["turns"] == 1
            # A keeps its 5 most recent; its older ones are gone
            kept = [
                i
                for i in range(60)
                if c.get(f"/v1/agent/sessions/junk{i}", headers=_auth(A_KEY)).status_code == 200
            ]
            assert kept == [55, 56, 57, 58, 59]
            metrics = c.get("/metrics", headers=_auth(ADMIN_KEY)).text
    assert 'agentgw_session_evictions_total{reason="tenant_quota"} 55.0' in metrics
    assert 'reason="capacity"' not in metrics
