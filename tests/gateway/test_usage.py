"""Per-tenant usage metrics: requests, input, cached and output tokens, from the usage each answer
reports (Chat streamed with include_usage, not streamed, Anthropic Messages) and, when an answer
reports none, from the gateway's own count (counted as unreported). Real vLLM reports are read by
the same parser: tests/benchmarks/test_balancer.py's replay compares them with what clients got."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.service.usage import Usage, read_usage
from tests.conftest import ServedGateway, fake_engine, wait_ready

KEYS = {"acme": "usage-acme-key", "beta": "usage-beta-key"}
ADMIN = "usage-admin"


def _metrics(url: str) -> dict[tuple[str, ...], float]:
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    out: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        if line.startswith(
            (
                "agentgw_tenant_tokens_total{",
                "agentgw_tenant_requests_total{",
                "agentgw_tenant_usage_unreported_total{",
            )
        ):
            head, value = line.rsplit(" ", 1)
            name, labels = head.split("{", 1)
            out[(name, *sorted(labels.rstrip("}").split(",")))] = float(value)
    return out


def test_usage_is_counted_per_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USAGE_ACME", KEYS["acme"])
    monkeypatch.setenv("USAGE_BETA", KEYS["beta"])
    monkeypatch.setenv("USAGE_ADMIN", ADMIN)
    with fake_engine("--model", "m", "--tokens", "5") as a:
        cfg = {
            "pools": [{"name": "p", "engines": [{"name": "e0", "url": a, "model": "m"}]}],
            "auth": {
                "tenants": [
                    {"name": "acme", "key_env": ["USAGE_ACME"]},
                    {"name": "beta", "key_env": ["USAGE_BETA"]},
                ],
                "admin_key_env": ["USAGE_ADMIN"],
            },
        }
        with ServedGateway(cfg) as gw:
            wait_ready(gw.url)

            def post(tenant: str, path: str, body: dict[str, Any]) -> httpx.Response:
                h = {"authorization": f"Bearer {KEYS[tenant]}"}
                r = httpx.post(gw.url + path, json=body, headers=h, timeout=30)
                assert r.status_code == 200, r.text
                return r

            msgs = [{"role": "user", "content": "count me " * 40}]
            want = {"input": 0, "output": 0}
            # acme: streamed with include_usage, not streamed, and an Anthropic message
            r = post(
                "acme",
                "/v1/chat/completions",
                {"model": "m", "messages": msgs, "stream": True, "stream_options": {"include_usage": True}},
            )
            usage = [
                json.loads(line[6:])["usage"]
                for line in r.text.splitlines()
                if line.startswith("data: {") and '"usage":{' in line
            ][-1]
            want["input"] += usage["prompt_tokens"]
            want["output"] += usage["completion_tokens"]
            u = post("acme", "/v1/chat/completions", {"model": "m", "messages": msgs}).json()["usage"]
            want["input"] += u["prompt_tokens"]
            want["output"] += u["completion_tokens"]
            m = post("acme", "/v1/messages", {"model": "m", "max_tokens": 5, "messages": msgs}).json()[
                "usage"
            ]
            want["input"] += m["input_tokens"]
            want["output"] += m["output_tokens"]
            # beta: a stream without a usage report
            post("beta", "/v1/chat/completions", {"model": "m", "messages": msgs, "stream": True})
            got = _metrics(gw.url)
            assert got[("agentgw_tenant_requests_total", 'status="2xx"', 'tenant="acme"')] == 3
            assert got[("agentgw_tenant_tokens_total", 'kind="input"', 'tenant="acme"')] == want["input"]
            assert (
                got[("agentgw_tenant_tokens_total", 'kind="output"', 'tenant="acme"')] == want["output"] > 0
            )
            assert ("agentgw_tenant_usage_unreported_total", 'tenant="acme"') not in got
            assert got[("agentgw_tenant_requests_total", 'status="2xx"', 'tenant="beta"')] == 1
            assert got[("agentgw_tenant_usage_unreported_total", 'tenant="beta"')] == 1
            assert (
                got[("agentgw_tenant_tokens_total", 'kind="input"', 'tenant="beta"')] > 0
            )  # the gateway's count
            assert ("agentgw_tenant_tokens_total", 'kind="output"', 'tenant="beta"') not in got


def test_read_usage_finds_the_last_report_of_each_api() -> None:
    chat = b'data: {"choices":[],"usage":{"prompt_tokens":120,"total_tokens":130,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":64}}}\n\ndata: [DONE]\n\n'
    assert read_usage([b"data: {...}\n\n", chat]) == Usage(120, 10, 64)
    # split over two chunks, details null (engine without --enable-prompt-tokens-details)
    split = b'{"id":"x","usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,"prompt_tokens_details":null}}'
    assert read_usage([split[:30], split[30:]]) == Usage(7, 2, None)
    anthropic = b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":5}}\n\n'
    assert read_usage([anthropic]) == Usage(None, 5, None)
    responses = b'"usage":{"input_tokens":50,"input_tokens_details":{"cached_tokens":32},"output_tokens":4}}'
    assert read_usage([b'{"usage":null}', responses, b'{"usage":null}']) == Usage(50, 4, 32)
    assert read_usage([b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n']) is None
