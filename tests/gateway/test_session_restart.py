"""A client that reuses a session id for an unrelated conversation: the gateway places the new
conversation as a new session (no old home, turn count from zero) and counts the restart."""

from __future__ import annotations

import httpx
import orjson

from tests.conftest import ServedGateway, fake_engine, wait_ready

MODEL = "agent-model"


def _body(tag: str, words: int = 300) -> bytes:
    text = f"[{tag}] " + " ".join(f"{tag}-word{i}" for i in range(words))
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4})


def _restarts(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("agentgw_session_restarts_total "):
            return float(line.split()[1])
    raise AssertionError("agentgw_session_restarts_total not exported")


def test_a_reused_session_id_with_no_shared_prefix_restarts_the_session() -> None:
    with (
        fake_engine("--model", MODEL, "--tokens", "4") as u0,
        fake_engine("--model", MODEL, "--tokens", "4") as u1,
    ):
        config = {
            "pools": [
                {
                    "name": "p",
                    "engines": [
                        {"name": "e0", "url": u0, "model": MODEL},
                        {"name": "e1", "url": u1, "model": MODEL},
                    ],
                }
            ],
            "routing": {"approx_chunk_chars": 256},
        }
        with ServedGateway(config) as gw:
            wait_ready(gw.url)
            head = {"X-Agent-Session-Id": "reused"}
            with httpx.Client(base_url=gw.url, timeout=30) as c:
                for words in (300, 340):  # two turns of one conversation: the second extends the first
                    text = _body("first", words)
                    assert c.post("/v1/chat/completions", content=text, headers=head).status_code == 200
                assert c.get("/v1/agent/sessions/reused").json()["turns"] == 2
                assert _restarts(gw.url) == 0
                # the same id, an unrelated conversation: nothing in common with the last prompt
                assert c.post("/v1/chat/completions", content=_body("other"), headers=head).status_code == 200
                s = c.get("/v1/agent/sessions/reused").json()
                assert s["turns"] == 1, s
                assert s["last_decision"]["reason"] not in ("sticky", "rehome_cold"), s  # placed as new
                assert _restarts(gw.url) == 1
                # its next turn continues the new conversation: no restart
                assert (
                    c.post("/v1/chat/completions", content=_body("other", 340), headers=head).status_code
                    == 200
                )
                assert c.get("/v1/agent/sessions/reused").json()["turns"] == 2
                assert _restarts(gw.url) == 1
