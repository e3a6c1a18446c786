"""A field of our own hint dialect that no hint has (a typo such as ``sesion_end``, an unknown
``X-Agent-*`` header): under ``hints.on_invalid: reject`` (the default) a 400 naming it, in the
shape of the API called, with the nearest known name; under ``ignore`` the known hints still count
and the warning names it. Other dialects' objects pass. No engines: hints are read before
routing."""

from __future__ import annotations

import httpx
import orjson

from gateway.config import load_config
from gateway.service.metrics import GatewayMetrics
from gateway.service.prompts import Prompts
from gateway.wire.openai import parse_body
from tests.conftest import ServedGateway

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_unknown_hint_fields_and_headers_are_400s_naming_them() -> None:
    with ServedGateway({}) as gw:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={**CHAT, "agent_hints": {"session_id": "s", "sesion_end": True}},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("agent_hints.sesion_end", "invalid_hint")
        assert "did you mean 'session_end'?" in err["message"]

        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"X-Agent-Sesion-Id": "s"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-agent-sesion-id", r.text
        assert "did you mean 'x-agent-session-id'?" in r.json()["error"]["message"]

        # Anthropic's shape on /v1/messages
        r = httpx.post(
            gw.url + "/v1/messages",
            json={**CHAT, "agent_hints": {"fan_outt": 2}},
        )
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and "agent_hints.fan_outt" in body["error"]["message"], body
        assert "did you mean 'fan_out'?" in body["error"]["message"]

        # the out-of-band hints route names the field as its body has it
        r = httpx.post(gw.url + "/v1/agent/sessions/s1/hints", json={"expected_tool_latency": 400})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expected_tool_latency", r.text
        assert "did you mean 'expected_tool_latency_ms'?" in r.json()["error"]["message"]

        # other dialects' objects are theirs: past the hints (no engine here: the model is unknown)
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={**CHAT, "nvext": {"agent_hints": {"osl": 4, "new": 1}}, "metadata": {"x": 1}},
            headers={"X-Agentgw-Something": "1"},
        )
        assert r.status_code != 400, r.text


def test_under_ignore_the_known_hints_count_and_the_warning_names_the_unknown() -> None:
    config = load_config(None, hints={"on_invalid": "ignore"})
    prompts = Prompts(config, kv_events=False, metrics=GatewayMetrics())
    body = {**CHAT, "agent_hints": {"session_id": "s", "sesion_end": True}}
    parsed = parse_body("chat", orjson.dumps(body))
    hints, warning = prompts.hints(parsed, [(b"x-agent-fan-outt", b"3"), (b"x-agent-turn", b"2")])
    assert (hints.session_id, hints.turn_index, hints.session_end) == ("s", 2, False)
    assert warning is not None
    assert "'agent_hints.sesion_end': unknown field; did you mean 'session_end'?" in warning
    assert "'x-agent-fan-outt': unknown hint header; did you mean 'x-agent-fan-out'?" in warning
    # an invalid value still drops the hints, as before, and both are in the warning
    bad = parse_body("chat", orjson.dumps({**CHAT, "agent_hints": {"fan_out": "x", "zz": 1}}))
    hints, warning = prompts.hints(bad, [])
    assert hints.fan_out is None and warning is not None
    assert "agent_hints.zz" in warning and "agent_hints.fan_out" in warning
