"""Bad input never gets a 500: random request shapes against a served gateway (stand-in engine),
with the exact-hash path (a tokenizer and chat template) and without it (approximate hashes).

Every answer is either a success or an OpenAI-shaped error (a 503 only when no engine is healthy,
which does not happen here); the explicit cases name the field. Found by this test: a content part
whose `text` was not a string, and a `tools` value that was not an array, each gave a 500.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServedGateway, fake_engine, wait_ready

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/debug/route",
    "/v1/agent/sessions",
    "/v1/agent/sessions/s1",
)
KEYS = (
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "agent_hints", "agentgw",
    "prompt_cache_key", "user", "session_id", "nvext", "vllm_xargs", "priority", "kv_transfer_params",
    "n", "tools", "metadata", "chat_template_kwargs", "cache_salt",
)  # fmt: skip
HINT_KEYS = (
    "session_id", "parent_session_id", "expected_tool_latency_ms", "fan_out", "priority",
    "session_end", "is_subagent", "interactive", "kv_retention_ttl_s", "turn_index",
)  # fmt: skip
HEADERS = (
    "x-session-id", "x-agentgw-session-id", "x-correlation-id", "x-dynamo-session-id",
    "x-agentgw-parent-session-id", "x-agentgw-expected-tool-latency-ms", "x-agentgw-fan-out",
    "x-agentgw-priority",
)  # fmt: skip


class Shapes:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        kinds = 9 if depth < 3 else 6
        k = r.randrange(kinds)
        if k == 0:
            return None
        if k == 1:
            return r.choice([True, False])
        if k == 2:
            return r.choice([-1, 0, 7, 10**12, -(10**12)])
        if k == 3:
            return r.random() * 1e6 - 5
        if k == 4:
            return r.choice(["", "x", "user", "text", "m", "a" * 300])
        if k == 5:
            return r.choice(["None", "{}", "[]", "-1"])
        if k == 6:
            return [self.value(depth + 1) for _ in range(r.randrange(3))]
        keys = ("role", "content", "type", "text", "session_id", "a")
        return {r.choice(keys): self.value(depth + 1) for _ in range(r.randrange(3))}

    def messages(self) -> Any:
        r = self.rng
        return r.choice(
            [
                [{"role": "user", "content": "hi"}],
                self.value(),
                [{"role": self.value(), "content": self.value()}],
                [{"role": "user", "content": [{"type": "text", "text": self.value()}]}],
                [{"role": "user", "content": [self.value()]}],
                [{"role": "assistant", "content": None}, {"role": "user", "content": "go"}],
            ]
        )

    def body(self, route: str) -> dict[str, Any]:
        r = self.rng
        b: dict[str, Any] = {}
        if r.random() < 0.85:
            b["model"] = r.choice(["m", "m", "m", "nope", 3, None, ""])
        if r.random() < 0.75:
            b["messages"] = self.messages()
        if route == "/v1/completions" and r.random() < 0.8:
            b["prompt"] = r.choice(["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [], self.value()])
        for key in r.sample(KEYS, r.randrange(5)):
            b[key] = self.value()
        if r.random() < 0.3:
            b["agent_hints"] = {r.choice(HINT_KEYS): self.value() for _ in range(3)}
        return b

    def headers(self) -> dict[str, str]:
        return {k: str(self.value()) for k in self.rng.sample(HEADERS, self.rng.randrange(3))}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", "m") as url:
        yield url


def config(engine_url: str, tokenizer: Path | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "pools": [
            {"name": "any", "role": "any", "engines": [{"name": "e0", "url": engine_url, "model": "m"}]}
        ]
    }
    if tokenizer is not None:
        cfg["models"] = [{"name": "m", "tokenizer": str(tokenizer), "block_size": 128}]
    return cfg


def check(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{r.status_code} for {what}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, what


@pytest.mark.parametrize("exact", [False, True], ids=["approx-hashes", "exact-hashes"])
def test_random_request_shapes_never_get_a_server_error(
    engine_url: str, tiny_llama: Path, exact: bool
) -> None:
    shapes = Shapes(seed=11 if exact else 7)
    with ServedGateway(config(engine_url, tiny_llama if exact else None)) as gw:
        wait_ready(gw.url)
        # a fresh connection per request: a server error closes the connection, and reusing it
        # would report the next request's reset instead of the request that caused it
        for _ in range(600):
            route = shapes.rng.choice(ROUTES)
            method = shapes.rng.choice(["POST", "GET", "DELETE"]) if "sessions" in route else "POST"
            body, headers = shapes.body(route), shapes.headers()
            r = httpx.request(method, gw.url + route, content=json.dumps(body), headers=headers, timeout=10)
            check(r, f"{method} {route} {json.dumps(body)[:300]} {headers}")


@pytest.mark.parametrize(
    ("messages", "extra", "param"),
    [
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], {}, "messages[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "text"}]}], {}, "messages[0].content[0].text"),
        ([{"role": "user", "content": ["hi"]}], {}, "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": 3}]}], {}, "messages[0].content[0].type"),
        ([{"role": "user", "content": {"text": "hi"}}], {}, "messages[0].content"),
        ([{"role": "user", "content": "hi"}], {"tools": 5}, "tools"),
        ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ],
)
def test_malformed_content_and_tools_name_the_field(
    engine_url: str, messages: list, extra: dict, param: str
) -> None:
    with ServedGateway(config(engine_url, None)) as gw:
        wait_ready(gw.url)
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": messages, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0] in err["message"]


def test_image_parts_and_null_content_pass(engine_url: str) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": [{"image_url": {"url": "x"}}]},
    ]
    with ServedGateway(config(engine_url, None)) as gw:
        wait_ready(gw.url)
        r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": messages})
    assert r.status_code == 200, r.text
