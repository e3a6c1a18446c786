"""The dashboard's parts without engines: the engines' prompt-token counter parser, the windowed
histogram quantile, the session stores' bounded recent listing (memory and a real Redis), the
admin key in front of the dashboard's data, and the packaged page and assets."""

from __future__ import annotations

import httpx
import pytest

from gateway.api.app import create_app
from gateway.config import load_config
from gateway.core.sessions import SessionRecord
from gateway.service.dashboard import _quantile, parse_prompt_counters
from gateway.service.session_store import MAX_RECENT_LISTING, MemorySessionStore, RedisSessionStore
from gateway.service.tenants import TenantRegistry, key_digest
from tests.conftest import ServedGateway

# the exposition vLLM 0.32 writes (counter names get Prometheus' _total suffix; two engines'
# label sets in one process, as with data parallelism)
VLLM_TEXT = b"""# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 24.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 640.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 512.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 128.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 360.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_prompt_counters_sum_label_sets_and_split_cached_by_source() -> None:
    assert parse_prompt_counters(VLLM_TEXT) == {
        "prompt": 1024.0,
        "cached": 640.0,
        "cached:device": 512.0,
        "cached:host": 128.0,
    }


def test_prompt_counters_of_an_engine_without_them_are_empty() -> None:
    assert parse_prompt_counters(b'vllm:num_requests_running{model_name="m"} 1\n') == {}


@pytest.mark.parametrize(
    ("buckets", "q", "want"),
    [
        ([(0.1, 0.0), (0.2, 10.0), (float("inf"), 10.0)], 0.5, 0.15),
        ([(0.1, 10.0), (float("inf"), 10.0)], 0.95, 0.095),
        ([(0.1, 0.0), (float("inf"), 4.0)], 0.5, 0.1),  # in the +Inf bucket: its lower bound
        ([(0.1, 0.0), (float("inf"), 0.0)], 0.5, None),  # no observation
    ],
)
def test_histogram_quantile_interpolates_like_prometheus(
    buckets: list[tuple[float, float]], q: float, want: float | None
) -> None:
    got = _quantile(buckets, q)
    assert got == pytest.approx(want) if want is not None else got is None


def _records(n: int) -> list[SessionRecord]:
    return [SessionRecord(f"s{i}", turns=i, created=100.0 + i, last_activity=100.0 + i) for i in range(n)]


async def test_memory_store_lists_most_recent_first_bounded_and_live_only() -> None:
    store = MemorySessionStore(capacity=10, ttl_s=50.0)
    for rec in _records(12):  # two evicted for capacity
        await store.put(rec)
    assert [r.session_id for r in await store.recent(3, now=112.0)] == ["s11", "s10", "s9"]
    assert len(await store.recent(100, now=112.0)) == 10
    # s2..s5 idle for more than 50 s at now=155.5: not listed
    assert [r.session_id for r in await store.recent(100, now=155.5)] == [f"s{i}" for i in range(11, 5, -1)]
    assert await store.recent(0, now=112.0) == []
    assert await store.recent(-5, now=112.0) == []


async def test_memory_store_listing_is_capped() -> None:
    store = MemorySessionStore(capacity=MAX_RECENT_LISTING + 50, ttl_s=1e9)
    for rec in _records(MAX_RECENT_LISTING + 50):
        await store.put(rec)
    assert len(await store.recent(10 * MAX_RECENT_LISTING, now=0.0)) == MAX_RECENT_LISTING


@pytest.mark.redis
async def test_redis_store_lists_most_recent_first_bounded(redis_url: str) -> None:
    store = RedisSessionStore(redis_url, capacity=10, ttl_s=60.0, prefix="agentgw-test-recent:")
    try:
        for rec in _records(12):
            await store.put(rec)
        got = await store.recent(3, now=112.0)
        assert [r.session_id for r in got] == ["s11", "s10", "s9"]
        assert got[0].turns == 11
        assert len(await store.recent(100, now=112.0)) == 10  # trimmed to capacity
        await store.delete("s10")
        assert [r.session_id for r in await store.recent(2, now=112.0)] == ["s11", "s9"]
        assert await store.recent(0, now=112.0) == []
    finally:
        await store.redis.flushdb()
        await store.close()


ADMIN_KEY, TENANT_KEY = "admin-secret", "tenant-secret"


def _client(keys: bool) -> httpx.AsyncClient:
    """The app without its lifespan (the admin check and the static files need no service), with
    an admin key and a tenant key configured, or open (no keys: the loopback default)."""
    auth = (
        {
            "admin_key_sha256": [key_digest(ADMIN_KEY)],
            "tenants": [{"name": "t", "key_sha256": [key_digest(TENANT_KEY)]}],
        }
        if keys
        else {}
    )
    config = load_config(None, auth=auth)
    app = create_app(config)
    app.state.tenants = TenantRegistry.from_config(config.auth, announce=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "missing_api_key"),
        ({"authorization": "Bearer nope"}, 401, "invalid_api_key"),
        ({"authorization": f"Bearer {TENANT_KEY}"}, 403, "admin_required"),
        ({"x-api-key": TENANT_KEY}, 403, "admin_required"),
    ],
)
async def test_dashboard_data_needs_the_admin_key(headers: dict[str, str], status: int, code: str) -> None:
    async with _client(keys=True) as c:
        r = await c.get("/dashboard/state", headers=headers)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("keys", [True, False])
async def test_dashboard_page_and_assets_come_from_the_package(keys: bool) -> None:
    # the page holds no data: a browser loads it without a key, then the page asks for one
    async with _client(keys) as c:
        page = await c.get("/dashboard")
        js = await c.get("/dashboard/static/dashboard.js")
        css = await c.get("/dashboard/static/dashboard.css")
        missing = await c.get("/dashboard/static/nope.js")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/static/dashboard.js">' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    assert js.status_code == 200 and "/dashboard/state" in js.text and "authorization" in js.text
    assert "https://" not in js.text and "http://" not in js.text
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"


def test_dashboard_data_with_the_admin_key_from_a_served_gateway() -> None:
    auth = {"admin_key_sha256": [key_digest(ADMIN_KEY)]}
    with ServedGateway({"auth": auth}) as gw:
        denied = httpx.get(gw.url + "/dashboard/state", timeout=10)
        r = httpx.get(
            gw.url + "/dashboard/state", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        )
    assert denied.status_code == 401
    assert r.status_code == 200
    state = r.json()
    assert (state["pools"], state["sessions"]["listed"], state["session_backend"]) == ([], 0, "memory")
