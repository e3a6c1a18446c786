"""An error the engine itself produces (here: a prompt plus ``max_tokens`` past the model's window,
which the gateway does not check) reaches the client in the shape of the API it called, with the
engine's message kept: OpenAI's for Chat Completions and Responses (the gateway's ``type`` for
the status and a string ``code``, not vLLM's ``"type": "BadRequestError", "code": 400``),
Anthropic's for Messages."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
TOO_MANY = 10**6  # the engines' window is 32,768 tokens


def _openai_shaped(r: httpx.Response) -> dict[str, object]:
    assert r.status_code == 400, r.text
    assert r.headers["x-agentgw-engine"], "the engine answered, not the gateway"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and isinstance(err["code"], str), err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def test_engine_errors_come_back_in_each_apis_shape(gateway: ServedGateway) -> None:
    url = gateway.url
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOO_MANY},
        timeout=60,
    )
    err = _openai_shaped(chat)
    assert "BadRequestError" not in chat.text
    assert "max" in str(err["message"]).lower() or "context" in str(err["message"]).lower(), err

    resp = httpx.post(
        f"{url}/v1/responses",
        json={"model": MODEL, "input": "hi", "max_output_tokens": TOO_MANY},
        timeout=60,
    )
    _openai_shaped(resp)
    assert "BadRequestError" not in resp.text

    msg = httpx.post(
        f"{url}/v1/messages",
        json={"model": MODEL, "max_tokens": TOO_MANY, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert msg.status_code == 400, msg.text
    body = msg.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"] and "BadRequestError" not in msg.text, body
