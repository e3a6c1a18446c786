"""Per-tenant cache salts really separate vLLM's prefix cache: against one real engine, the same
prompt under another tenant's salt gets no cached tokens, under the same salt it does."""

from __future__ import annotations

import httpx
import pytest

from gateway.local.engines import LocalEngine
from gateway.service.tenants import cache_salt
from tests.conftest import MODEL

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(cluster: dict[str, LocalEngine]) -> LocalEngine:
    """A warm engine of the shared cluster (prefix caching on; the prompt below is this test's)."""
    return cluster["warm1"]


def cached(engine: LocalEngine, prompt: str, salt: str | None) -> int:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1,
    }
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(engine.spec.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_tenant_salts_do_not_share_prefix_cache_blocks(engine: LocalEngine) -> None:
    prompt = "The victim's exact confidential prompt. " * 60
    acme, beta = cache_salt("acme", ""), cache_salt("beta", "")
    assert cached(engine, prompt, acme) == 0
    assert cached(engine, prompt, acme) > 0  # the owner hits its own blocks
    assert cached(engine, prompt, beta) == 0  # another tenant: no timing side channel
    assert cached(engine, prompt, None) == 0  # nor an unsalted caller
