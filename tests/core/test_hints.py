"""Every hint dialect maps onto AgentHints; precedence and validation (table-driven)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.hints import HintError, parse_hints

CASES: list[tuple[str, dict[str, str], dict[str, Any], dict[str, Any]]] = [
    (
        "ours: body",
        {},
        {
            "agent_hints": {
                "session_id": "s",
                "parent_session_id": "p",
                "agent_role": "subagent",
                "turn_index": 3,
                "expected_tool_latency_ms": 40000,
                "fan_out": 4,
                "latency_class": "background",
                "session_end": True,
                "priority": 5,
            }
        },
        {
            "session_id": "s",
            "parent_session_id": "p",
            "agent_role": "subagent",
            "turn_index": 3,
            "expected_tool_latency_ms": 40000,
            "fan_out": 4,
            "latency_class": "background",
            "session_end": True,
            "priority": 5,
        },
    ),
    (
        "ours: headers",
        {
            "x-agent-session-id": "s",
            "x-agent-tool-latency-ms": "1500",
            "x-agent-fan-out": "2",
            "x-agent-session-end": "true",
            "x-agent-role": "main",
        },
        {},
        {
            "session_id": "s",
            "expected_tool_latency_ms": 1500,
            "fan_out": 2,
            "session_end": True,
            "agent_role": "main",
        },
    ),
    (
        "dynamo headers + nvext",
        {"x-dynamo-session-id": "d", "x-dynamo-parent-session-id": "dp", "x-dynamo-session-final": "1"},
        {"nvext": {"agent_hints": {"priority": 2, "osl": 300, "speculative_prefill": True}}},
        {
            "session_id": "d",
            "parent_session_id": "dp",
            "session_end": True,
            "priority": 2,
            "osl": 300,
            "speculative_prefill": True,
            "agent_role": "subagent",
        },
    ),
    (
        "vllm router agentic_context",
        {},
        {
            "vllm_xargs": {
                "agentic_context": {
                    "session_id": "v",
                    "parent_ids": ["root", "mid"],
                    "agent_role": "worker",
                    "expected_resume": 12.5,
                    "kv_retention_ttl_seconds": 60,
                    "priority": 1,
                }
            }
        },
        {
            "session_id": "v",
            "parent_session_id": "mid",
            "agent_role": "subagent",
            "expected_tool_latency_ms": 12500,
            "kv_retention_ttl_s": 60,
            "priority": 1,
        },
    ),
    ("vllm header", {"x-session-id": "h"}, {}, {"session_id": "h"}),
    ("vllm body", {}, {"session_id": "b"}, {"session_id": "b"}),
    (
        "claude code subagent",
        {
            "x-claude-code-session-id": "cc",
            "x-claude-code-agent-id": "a2",
            "x-claude-code-parent-agent-id": "a1",
        },
        {},
        {"session_id": "cc#a2", "parent_session_id": "cc#a1", "agent_id": "a2", "agent_role": "subagent"},
    ),
    (
        "claude code subagent of the main agent",
        {"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a2"},
        {},
        {"session_id": "cc#a2", "parent_session_id": "cc", "agent_role": "subagent"},
    ),
    ("claude code main", {"x-claude-code-session-id": "cc"}, {}, {"session_id": "cc", "agent_role": None}),
    ("codex", {"session-id": "cx"}, {}, {"session_id": "cx"}),
    ("codex thread", {"thread-id": "th"}, {}, {"session_id": "th"}),
    ("aiperf", {"x-correlation-id": "corr"}, {}, {"session_id": "corr"}),
    ("openai prompt_cache_key", {}, {"prompt_cache_key": "pck", "user": "u"}, {"session_id": "pck"}),
    ("openai user last", {}, {"user": "u"}, {"session_id": "u"}),
    (
        "precedence: ours body > headers > dynamo > vllm > openai",
        {"x-agent-session-id": "hdr", "x-dynamo-session-id": "dyn", "x-session-id": "vl"},
        {"agent_hints": {"session_id": "body"}, "prompt_cache_key": "pck"},
        {"session_id": "body"},
    ),
    (
        "precedence: headers > dynamo",
        {"x-agent-session-id": "hdr", "x-dynamo-session-id": "dyn"},
        {},
        {"session_id": "hdr"},
    ),
    ("nothing", {}, {}, {"session_id": None, "agent_role": None, "session_end": False}),
]


@pytest.mark.parametrize(("name", "headers", "body", "expected"), CASES, ids=[c[0] for c in CASES])
def test_dialects(name: str, headers: dict[str, str], body: dict[str, Any], expected: dict[str, Any]) -> None:
    h = parse_hints(headers, body)
    for field, value in expected.items():
        assert getattr(h, field) == value, field


BAD: list[tuple[dict[str, str], dict[str, Any], str]] = [
    ({}, {"agent_hints": "x"}, "agent_hints"),
    ({}, {"agent_hints": {"session_id": ""}}, "agent_hints.session_id"),
    ({}, {"agent_hints": {"session_id": "x" * 300}}, "agent_hints.session_id"),
    ({}, {"agent_hints": {"expected_tool_latency_ms": -1}}, "agent_hints.expected_tool_latency_ms"),
    ({}, {"agent_hints": {"fan_out": 5000}}, "agent_hints.fan_out"),
    ({}, {"agent_hints": {"fan_out": 1.5}}, "agent_hints.fan_out"),
    ({}, {"agent_hints": {"agent_role": "boss"}}, "agent_hints.agent_role"),
    ({}, {"agent_hints": {"latency_class": "urgent"}}, "agent_hints.latency_class"),
    ({}, {"agent_hints": {"session_end": "maybe"}}, "agent_hints.session_end"),
    ({"x-agent-tool-latency-ms": "soon"}, {}, "x-agent-tool-latency-ms"),
    ({"x-agent-fan-out": "-3"}, {}, "x-agent-fan-out"),
    ({}, {"nvext": {"agent_hints": {"priority": "high"}}}, "nvext.agent_hints.priority"),
    (
        {},
        {"vllm_xargs": {"agentic_context": {"expected_resume": -4}}},
        "vllm_xargs.agentic_context.expected_resume",
    ),
    ({"x-session-id": "bad\x00id"}, {}, "X-Session-ID"),
]


@pytest.mark.parametrize(("headers", "body", "field"), BAD)
def test_invalid_hints_name_the_field(headers: dict[str, str], body: dict[str, Any], field: str) -> None:
    with pytest.raises(HintError) as err:
        parse_hints(headers, body)
    assert err.value.field == field
    assert field in str(err.value)
