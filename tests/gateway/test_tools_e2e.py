"""Tool calling is on in the local engines: Chat Completions with `tools` and `tool_choice: "auto"`
through the gateway (1 first-turn + 2 warm engines, the embedded default's layout), and vLLM's own
Anthropic Messages and OpenAI Responses endpoints on one engine (they need the same flags, and
Responses needs `VLLM_ENABLE_RESPONSES_API_STORE=1` to keep what `previous_response_id` names)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.local.engines import LocalEngine
from tests.conftest import MODEL, ServedGateway

pytestmark = pytest.mark.engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather at a place.",
        "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]},
    },
}


def tool_chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "What is the weather at the harbour?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"place": "harbour"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "11 C, light wind"},
        ],
        "tools": [WEATHER],
        "tool_choice": "auto",
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }


def test_chat_with_tools_and_auto_tool_choice_through_the_gateway(gateway: ServedGateway) -> None:
    r = httpx.post(gateway.url + "/v1/chat/completions", json=tool_chat(stream=False), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert r.json()["usage"]["completion_tokens"] > 0
    assert r.headers["x-agentgw-engine"] in ("first0", "warm0", "warm1")


def test_streamed_chat_with_tools_and_auto_tool_choice_through_the_gateway(gateway: ServedGateway) -> None:
    with httpx.stream(
        "POST", gateway.url + "/v1/chat/completions", json=tool_chat(stream=True), timeout=120
    ) as r:
        assert r.status_code == 200, r.read().decode()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all("error" not in c for c in chunks)
    assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)


def test_anthropic_messages_with_tools_on_one_engine(cluster: dict[str, LocalEngine]) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "system": [{"type": "text", "text": "You are a coding agent."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        "tools": [
            {
                "name": "bash",
                "description": "Run a command.",
                "input_schema": WEATHER["function"]["parameters"],
            }
        ],
        "metadata": {"user_id": json.dumps({"session_id": "s-1"})},
    }
    url = cluster["warm0"].url + "/v1/messages?beta=true"
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["usage"]["output_tokens"] > 0
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as s:
        assert s.status_code == 200, s.read().decode()
        kinds = [line[7:] for line in s.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_responses_with_tools_and_a_stored_chain_on_one_engine(cluster: dict[str, LocalEngine]) -> None:
    url = cluster["warm1"].url + "/v1/responses"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    first = {
        "model": MODEL,
        "input": "Say hello.",
        "tools": [tool],
        "tool_choice": "auto",
        "max_output_tokens": 8,
    }
    r1 = httpx.post(url, json=first, timeout=120)
    assert r1.status_code == 200, r1.text
    rid = r1.json()["id"]
    # stored: retrievable, and a follow-up can name it (the store is on)
    got = httpx.get(f"{url}/{rid}", timeout=30)
    assert got.status_code == 200 and got.json()["id"] == rid, got.text
    r2 = httpx.post(url, json=first | {"input": "Again.", "previous_response_id": rid}, timeout=120)
    assert r2.status_code == 200, r2.text
    with httpx.stream("POST", url, json=first | {"stream": True, "store": False}, timeout=120) as s:
        assert s.status_code == 200, s.read().decode()
        kinds = [json.loads(line[6:])["type"] for line in s.iter_lines() if line.startswith("data: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
