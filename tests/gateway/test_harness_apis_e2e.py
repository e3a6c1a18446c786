"""Anthropic Messages and OpenAI Responses through the gateway, with the real SDKs, against the
three real engines: streamed and not, through the same pipeline as chat (decision headers,
sessions from the harnesses' own fields, exact block hashes that equal what the engine's KV
events announce), ``previous_response_id`` chains that reach the engine holding them (also through
two replicas sharing Redis), unknown ids and bad input in each API's own error shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.local.engines import LocalEngine
from tests.conftest import MODEL, ServedGateway, cluster_config, wait_ready

pytestmark = pytest.mark.engine

TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]
SYSTEM = "You are a coding agent. " + "Follow the repository's conventions. " * 60


def _messages_body(session: str, turns: int) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    for t in range(turns):
        msgs.append({"role": "user", "content": [{"type": "text", "text": f"step {t}: list the files."}]})
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": f"toolu_{t}", "name": "bash", "input": {"command": "ls"}}
                ],
            }
        )
        msgs.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": "a.py b.py"}],
            }
        )
    msgs.append({"role": "user", "content": "Now fix a.py."})
    return {
        "model": MODEL,
        "max_tokens": 8,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": msgs,
        "tools": TOOLS,
        "metadata": {"user_id": json.dumps({"session_id": session})},
    }


def _debug(gw: ServedGateway, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{gw.url}/debug/route?endpoint={endpoint}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _all_blocks_announced(gw: ServedGateway, endpoint: str, body: dict[str, Any], engine: str) -> None:
    """The gateway's block hashes for the prompt are the ones the engine announced in its KV
    events after serving it: the gateway rendered and tokenized it exactly as vLLM did."""
    import time

    deadline = time.monotonic() + 10
    while True:
        d = _debug(gw, endpoint, body)
        assert d["exact_hashes"] is True and d["blocks"] > 0, d
        got = d["matches"].get(engine, {}).get("blocks", 0)
        if got == d["blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == d["blocks"], (engine, d["matches"], d["blocks"])


def test_messages_through_the_gateway_with_the_anthropic_sdk(gateway: ServedGateway) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="any", max_retries=0)
    body = _messages_body("cc-session-1", 1)
    raw = client.messages.with_raw_response.create(**body)
    msg = raw.parse()
    assert msg.type == "message" and msg.usage.output_tokens > 0
    engine = raw.headers["x-agentgw-engine"]
    assert raw.headers["x-agentgw-session"] == "cc-session-1"
    _all_blocks_announced(gateway, "messages", body, engine)
    # streamed, the next turns: Anthropic's event sequence relayed; the session stays where its
    # prefix is
    homes = []
    for turns in (2, 3):
        nxt = _messages_body("cc-session-1", turns)
        with client.messages.with_streaming_response.create(**nxt, stream=True) as s:
            homes.append((s.headers["x-agentgw-engine"], s.headers["x-agentgw-reason"]))
            kinds = [json.loads(line[6:])["type"] for line in s.iter_lines() if line.startswith("data: ")]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert homes == [(engine, "sticky"), (engine, "sticky")], homes
    s_json = httpx.get(f"{gateway.url}/v1/agent/sessions/cc-session-1", timeout=10).json()
    assert s_json["turns"] == 3 and s_json["home_engine"] == homes[1][0]


def test_messages_count_tokens_makes_no_session_turn(gateway: ServedGateway) -> None:
    body = _messages_body("cc-count", 1)
    body.pop("max_tokens")
    r = httpx.post(f"{gateway.url}/v1/messages/count_tokens", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 100
    assert httpx.get(f"{gateway.url}/v1/agent/sessions/cc-count", timeout=10).status_code == 404


def test_messages_errors_are_anthropic_shaped_and_name_the_field(gateway: ServedGateway) -> None:
    client = anthropic.Anthropic(base_url=gateway.url, api_key="any", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": 5}])  # type: ignore[list-item]
    err = exc.value.body
    assert isinstance(err, dict) and err["type"] == "error", err
    assert err["error"]["type"] == "invalid_request_error"
    assert "messages[0].content" in err["error"]["message"]
    r = httpx.post(f"{gateway.url}/v1/messages?beta=true", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(
        f"{gateway.url}/v1/messages",
        json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


def _chain(client: openai.OpenAI, n: int, **extra: Any) -> list[tuple[str, str]]:
    """n Responses turns, each continuing the last: (response id, engine) per turn."""
    out: list[tuple[str, str]] = []
    prev = None
    for t in range(n):
        kw: dict[str, Any] = {
            "model": MODEL,
            "input": f"turn {t}: say hello.",
            "max_output_tokens": 8,
            **extra,
        }
        if prev is not None:
            kw["previous_response_id"] = prev
        raw = client.responses.with_raw_response.create(**kw)
        prev = raw.parse().id
        out.append((prev, raw.headers["x-agentgw-engine"]))
    return out


def test_responses_chain_reaches_its_engine(gateway: ServedGateway) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="any", max_retries=0)
    chain = _chain(client, 3, instructions=SYSTEM)
    engines = {e for _, e in chain}
    assert len(engines) == 1, chain
    # stored responses are read (and cancelled) on their engine
    got = client.responses.retrieve(chain[-1][0])
    assert got.id == chain[-1][0]
    # streamed, store off (what Codex sends): a session from prompt_cache_key
    with client.responses.with_streaming_response.create(
        model=MODEL, input="hello", max_output_tokens=8, stream=True, store=False, prompt_cache_key="codex-s1"
    ) as s:
        assert s.headers["x-agentgw-session"] == "codex-s1"
        kinds = [json.loads(line[6:])["type"] for line in s.iter_lines() if line.startswith("data: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    # exact hashes for a Responses prompt with tools: the engine announced every block
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": "List the files. " * 40}],
        "instructions": SYSTEM,
        "tools": [{"type": "function", "name": "bash", "parameters": TOOLS[0]["input_schema"]}],
        "max_output_tokens": 4,
        "store": False,
    }
    r = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    _all_blocks_announced(gateway, "responses", body, r.headers["x-agentgw-engine"])


def test_unknown_response_ids_get_openais_answers(gateway: ServedGateway) -> None:
    """OpenAI's: a 400 ``previous_response_not_found`` for a chain that cannot continue, a 404 for
    a GET of an unknown id."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="any", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert exc.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert exc.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    assert exc.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    r = httpx.delete(f"{gateway.url}/v1/responses/resp_nope", timeout=10)
    assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported_endpoint"
    r = httpx.post(f"{gateway.url}/v1/responses", json={"model": MODEL, "input": 5}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_a_responses_chain_across_two_replicas_sharing_redis(
    cluster: dict[str, LocalEngine], tiny_llama: Path, redis_url: str
) -> None:
    cfg = cluster_config(cluster, tiny_llama, sessions={"backend": "redis", "redis_url": redis_url})
    with ServedGateway(cfg) as a, ServedGateway(cfg) as b:
        wait_ready(a.url)
        wait_ready(b.url)
        ca = openai.OpenAI(base_url=a.url + "/v1", api_key="any", max_retries=0)
        cb = openai.OpenAI(base_url=b.url + "/v1", api_key="any", max_retries=0)
        first = ca.responses.with_raw_response.create(model=MODEL, input="turn 0", max_output_tokens=8)
        rid, engine = first.parse().id, first.headers["x-agentgw-engine"]
        second = cb.responses.with_raw_response.create(
            model=MODEL, input="turn 1", max_output_tokens=8, previous_response_id=rid
        )
        assert second.headers["x-agentgw-engine"] == engine
        assert second.headers["x-agentgw-reason"] == "owner"
        third = ca.responses.with_raw_response.create(
            model=MODEL, input="turn 2", max_output_tokens=8, previous_response_id=second.parse().id
        )
        assert third.headers["x-agentgw-engine"] == engine
        assert cb.responses.retrieve(rid).id == rid
