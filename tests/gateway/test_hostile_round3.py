"""Defects found by hostile probing (a fair but hostile user against a real gateway on loopback,
uvicorn with the server limits, a stand-in engine as a subprocess), each with the check that
failed before its fix: what one tenant can learn of or do to another, and what reaches an
engine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.service.tenants import key_digest
from tests.conftest import ServedGateway, fake_engine, wait_ready

ACME, BETA, ADMIN = "sk-acme-1", "sk-beta-2", "sk-admin-3"
MODEL = "m"


def hdr(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", MODEL) as url:
        yield url


def config(engine_url: str, **kw: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "any", "role": "any", "engines": [{"name": "e0", "url": engine_url, "model": MODEL}]}
        ],
        "auth": {
            "tenants": [
                {"name": "acme", "key_sha256": [key_digest(ACME)]},
                {"name": "beta", "key_sha256": [key_digest(BETA)]},
            ],
            "admin_key_sha256": [key_digest(ADMIN)],
        },
        **kw,
    }


@pytest.fixture(scope="module")
def gw(engine_url: str) -> Iterator[ServedGateway]:
    with ServedGateway(config(engine_url)) as g:
        wait_ready(g.url)
        yield g


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


# -- what a tenant can learn of another ----------------------------------------------------------
def test_the_approximate_index_does_not_tell_one_tenant_what_another_sent(gw: ServedGateway) -> None:
    """No tokenizer is configured: prompts are hashed approximately. The approximate hashes were
    not salted, so a prompt another tenant had sent came back as cached tokens in
    ``x-agentgw-cached-tokens-est`` (chunk by chunk: an oracle for another tenant's text)."""
    secret = "acme's confidential system prompt, chunk after chunk. " * 60  # ~3.3K chars
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=chat(secret), headers=hdr(ACME))
        assert r.status_code == 200, r.text
        assert int(r.headers["x-agentgw-cached-tokens-est"]) == 0
        r = c.post("/v1/chat/completions", json=chat(secret), headers=hdr(ACME))
        assert int(r.headers["x-agentgw-cached-tokens-est"]) > 0  # its own prefix: matched
        r = c.post("/v1/chat/completions", json=chat(secret), headers=hdr(BETA))
        assert r.status_code == 200, r.text
        assert int(r.headers["x-agentgw-cached-tokens-est"]) == 0  # another's: never
        assert r.headers["x-agentgw-reason"] != "prefix"

        # the dry run explains a named tenant's request, with that tenant's matches only
        def matched(tenant: str) -> int:
            r = c.post(f"/debug/route?tenant={tenant}", json=chat(secret), headers=hdr(ADMIN))
            assert r.status_code == 200, r.text
            assert r.json()["tenant"] == tenant
            return sum(m["blocks"] for m in r.json()["matches"].values())

        assert matched("acme") > 0
        assert matched("beta") > 0  # beta sent it too, under its own salt
        r = c.post("/debug/route", json=chat(secret + "tail"), headers=hdr(ADMIN))
        assert sum(m["blocks"] for m in r.json()["matches"].values()) == 0  # unsalted: nobody's
        r = c.post("/debug/route?tenant=nobody", json=chat(secret), headers=hdr(ADMIN))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tenant")
        r = c.post("/debug/route?tenant=acme", json=chat(secret), headers=hdr(BETA))
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_required")
