"""The benchmark stand-in engine answers like a vLLM OpenAI server, as a real subprocess."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import fake_engine


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fake_engine("--model", "m") as url:
        yield url


def _events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_streamed_chat_has_16_chunks_usage_and_done(engine_url: str) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    with httpx.Client() as client, client.stream("POST", engine_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        events = _events(r.read().decode())
    assert time.perf_counter() - t0 < 5
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 17
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[15]["choices"][0]["finish_reason"] == "length"
    assert chunks[16]["choices"] == []
    assert chunks[16]["usage"]["completion_tokens"] == 16


def test_non_streamed_completion_is_one_json_body(engine_url: str) -> None:
    with httpx.Client() as client:
        r = client.post(engine_url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        out = r.json()
        assert out["object"] == "text_completion"
        assert out["choices"][0]["text"] == " word0 word1 word2 word3"
        assert out["usage"]["completion_tokens"] == 4
        # keep-alive: a second request on the same connection, then the side endpoints
        assert client.get(engine_url + "/v1/models").json()["data"][0]["id"] == "m"
        assert 'vllm:num_requests_running{model_name="m"}' in client.get(engine_url + "/metrics").text
        wrong = client.post(engine_url + "/v1/completions", json={"model": "other", "prompt": "hi"})
        assert wrong.status_code == 404
        assert wrong.json()["error"]["param"] == "model"


def test_hold_keeps_streams_until_release() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with fake_engine("--model", "m", "--hold") as url, httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200  # the headers came; the tokens wait
            metrics = c.get(url + "/metrics").text
            assert "vllm:num_requests_running" in metrics
            running = next(x for x in metrics.splitlines() if x.startswith("vllm:num_requests_running{"))
            assert float(running.rsplit(" ", 1)[1]) == 1
            assert c.post(url + "/release").status_code == 200
            events = _events(r.read().decode())
        assert events[-1] == "[DONE]" and len(events) > 1
        # released: later streams are not held
        after = c.post(url + "/v1/chat/completions", json=body)
        assert _events(after.text)[-1] == "[DONE]"
