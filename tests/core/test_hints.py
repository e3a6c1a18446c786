"""Every hint dialect maps onto AgentHints; precedence and validation (table-driven)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.core.hints import AGENT_HINT_FIELDS, HEADER_NAMES, HintError, parse_hints, unknown_hints

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


# -- harnesses: what Claude Code and Codex send ------------------------------------------------
CAPTURES = Path(__file__).resolve().parents[1] / "data" / "captures"
CC_SESSION = "3adc0907-82a3-49e7-a21f-e4754f55e388"
CC_COMPACT_SESSION = "23526d8d-d624-4505-99a2-3431cc6eaf00"
CODEX_THREAD = "01a23109-3ccb-7261-a430-aa4d5f7d3070"


def _capture(name: str) -> tuple[dict[str, str], dict[str, Any]]:
    capture = json.loads((CAPTURES / name).read_text())
    return {k.lower(): v for k, v in capture["headers"].items()}, capture["body"]


CAPTURED: list[tuple[str, dict[str, Any]]] = [
    (
        "claude_code_2.1.328_turn1.json",
        {
            "session_id": CC_SESSION,
            "agent_role": None,
            "request_kind": None,
            "sources": {"session_id": "claude_code"},
        },
    ),
    ("claude_code_2.1.328_turn2.json", {"session_id": CC_SESSION, "agent_role": None, "request_kind": None}),
    # `claude -p --continue /compact` (no request-class header by default): the conversation plus
    # the compaction instruction as the last user message, then, cut by the output limit, resumed
    # with Claude Code's "Output token limit hit" message after it; and a main-loop turn so resumed
    ("claude_code_2.1.328_compact.json", {"session_id": CC_COMPACT_SESSION, "request_kind": "compaction"}),
    (
        "claude_code_2.1.328_compact_resumed.json",
        {"session_id": CC_COMPACT_SESSION, "request_kind": "compaction"},
    ),
    ("claude_code_2.1.328_turn_resumed.json", {"session_id": CC_COMPACT_SESSION, "request_kind": None}),
    (
        "codex_0.169.0_turn1.json",
        {
            "session_id": CODEX_THREAD,
            "agent_role": None,
            "agent_id": "/root",
            "request_kind": "turn",
            "turn_id": "01a23109-3ce2-7833-b7d1-c6dd3c41ac24",
            "parent_session_id": None,
        },
    ),
    (
        "codex_0.169.0_turn2.json",
        {
            "session_id": CODEX_THREAD,
            "request_kind": "turn",
            "turn_id": "01a23109-8512-7d61-998a-b1b10fc7d470",
        },
    ),
]


@pytest.mark.parametrize(("name", "expected"), CAPTURED, ids=[c[0] for c in CAPTURED])
def test_live_captures_are_recognised_without_configuration(name: str, expected: dict[str, Any]) -> None:
    headers, body = _capture(name)
    h = parse_hints(headers, body)
    for field, value in expected.items():
        assert getattr(h, field) == value, field


def test_claude_code_session_from_metadata_user_id_alone() -> None:
    _, body = _capture("claude_code_2.1.328_turn1.json")
    h = parse_hints({}, body)  # e.g. a proxy in between dropped the header
    assert h.session_id == CC_SESSION and h.sources["session_id"] == "claude_code"


def test_codex_session_from_client_metadata_alone() -> None:
    _, body = _capture("codex_0.169.0_turn1.json")
    h = parse_hints({}, {k: v for k, v in body.items() if k != "prompt_cache_key"})
    assert h.session_id == CODEX_THREAD and h.request_kind == "turn" and h.agent_id == "/root"


def _codex_meta(**fields: Any) -> str:
    return json.dumps(
        {"session_id": "root", "thread_id": "root", "agent_name": "/root", "request_kind": "turn", **fields}
    )


# Fields read from the harnesses' source (a random-weight model never starts a subagent):
# Claude Code's cli (x-claude-code-agent-id / -parent-agent-id sent when agentType != "main";
# x-claude-code-request-class only with CLAUDE_CODE_GATEWAY_HINT_HEADERS on) and codex-rs
# core/src/responses_metadata.rs (x-openai-subagent, x-codex-parent-thread-id, turn metadata).
FROM_SOURCE: list[tuple[str, dict[str, str], dict[str, Any], dict[str, Any]]] = [
    (
        "claude code subagent with request class",
        {
            "x-claude-code-session-id": "cc",
            "x-claude-code-agent-id": "a7",
            "x-claude-code-request-class": "subagent",
        },
        {},
        {
            "session_id": "cc#a7",
            "parent_session_id": "cc",
            "agent_role": "subagent",
            "request_kind": "subagent",
        },
    ),
    (
        "claude code compaction",
        {"x-claude-code-session-id": "cc", "x-claude-code-request-class": "compaction"},
        {},
        {"session_id": "cc", "agent_role": None, "request_kind": "compaction"},
    ),
    (
        "claude code workflow without agent id",
        {"x-claude-code-session-id": "cc", "x-claude-code-request-class": "Workflow"},
        {},
        {"session_id": "cc", "agent_role": "subagent", "request_kind": "workflow"},
    ),
    (
        "claude code main by class",
        {"x-claude-code-session-id": "cc", "x-claude-code-request-class": "main"},
        {"metadata": {"user_id": json.dumps({"session_id": "other"})}},
        {"session_id": "cc", "agent_role": "main"},
    ),
    (
        "claude code metadata subagent header",
        {"x-claude-code-agent-id": "a1"},
        {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "cc"})}},
        {"session_id": "cc#a1", "parent_session_id": "cc", "agent_role": "subagent"},
    ),
    (
        "anthropic sdk user id is not a session",
        {},
        {"metadata": {"user_id": "user-42"}},
        {"session_id": None},
    ),
    (
        "codex spawned subagent",
        {
            "session-id": "root",
            "thread-id": "child",
            "x-codex-parent-thread-id": "root",
            "x-openai-subagent": "collab_spawn",
            "x-codex-turn-metadata": _codex_meta(
                thread_id="child",
                agent_name="/root/worker",
                parent_thread_id="root",
                subagent_kind="thread_spawn",
                turn_id="t9",
            ),
        },
        {"prompt_cache_key": "root"},
        {
            "session_id": "child",
            "parent_session_id": "root",
            "agent_role": "subagent",
            "agent_id": "/root/worker",
            "turn_id": "t9",
        },
    ),
    (
        "codex subagent from metadata only",
        {"x-codex-turn-metadata": _codex_meta(thread_id="child", parent_thread_id="root")},
        {},
        {"session_id": "child", "parent_session_id": "root", "agent_role": "subagent"},
    ),
    (
        "codex review subagent",
        {"session-id": "root", "thread-id": "rev", "x-openai-subagent": "review"},
        {},
        {"session_id": "rev", "agent_role": "subagent", "parent_session_id": None},
    ),
    (
        "codex fork",
        {
            "session-id": "root",
            "thread-id": "side",
            "x-codex-turn-metadata": _codex_meta(thread_id="side", forked_from_thread_id="root"),
        },
        {},
        {"session_id": "side", "parent_session_id": "root", "agent_role": "main"},
    ),
    (
        "codex compaction",
        {"thread-id": "root", "x-codex-turn-metadata": _codex_meta(request_kind="compaction")},
        {},
        {"session_id": "root", "request_kind": "compaction"},
    ),
    (
        "codex metadata that is not JSON is ignored",
        {"session-id": "root", "x-codex-turn-metadata": "not json"},
        {},
        {"session_id": "root", "request_kind": None},
    ),
    (
        "ours beat codex",
        {"x-agent-session-id": "mine", "thread-id": "child", "x-codex-parent-thread-id": "root"},
        {},
        {"session_id": "mine", "parent_session_id": "root", "agent_role": "subagent"},
    ),
    (
        "claude code beats codex and prompt_cache_key",
        {"x-claude-code-session-id": "cc", "session-id": "cx"},
        {"prompt_cache_key": "pck"},
        {"session_id": "cc"},
    ),
]


def _cc_fork(prompt: str | list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    """A Claude Code fork as its source builds one: the conversation, then the fixed prompt."""
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
    ]
    return {
        "tools": [{"name": "Bash"}],
        "stream": True,
        **body,
        "messages": [*history, {"role": "user", "content": prompt}],
    }


CC = {"x-claude-code-session-id": "cc"}
# Claude Code 2.1.328's requests that are not turns, without CLAUDE_CODE_GATEWAY_HINT_HEADERS: the
# fixed prompts of its forks and its one-token probes, from its bundled source (the compaction's
# also live, above); a header, when sent, decides.
FROM_SOURCE += [
    (
        "claude code partial compaction",
        CC,
        _cc_fork(
            "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n- Do NOT use Read ...\n\n"
            "Your task is to create a detailed summary of the RECENT portion of the conversation"
        ),
        {"session_id": "cc", "request_kind": "compaction"},
    ),
    (
        "claude code side question",
        CC,
        _cc_fork(
            [
                {
                    "type": "text",
                    "text": "<system-reminder>This is a side question from the user. You must answer",
                },
                {"type": "text", "text": "what does this function return?"},
            ]
        ),
        {"session_id": "cc", "request_kind": "side_reply"},
    ),
    (
        "claude code prompt suggestion",
        CC,
        _cc_fork(
            "[SUGGESTION MODE: Suggest what the user might naturally type next into Claude Code.]\n\nFIRST:"
        ),
        {"request_kind": "auxiliary"},
    ),
    (
        "claude code away summary",
        CC,
        _cc_fork("The user stepped away and is coming back. Recap in under 40 words, 1-2 plain sentences"),
        {"request_kind": "auxiliary"},
    ),
    (
        "claude code agent summary",
        {**CC, "x-claude-code-agent-id": "a3"},
        _cc_fork("Describe your most recent action in 3-5 words using present tense (-ing)."),
        {"session_id": "cc#a3", "request_kind": "auxiliary"},
    ),
    (
        "claude code session name",
        CC,
        _cc_fork(
            "Generate a short kebab-case name (2-4 words) that captures the main topic of this conversation."
        ),
        {"request_kind": "auxiliary"},
    ),
    (
        "claude code resume cache warm",
        CC,
        {"max_tokens": 1, "messages": [{"role": "user", "content": "Fix the failing test."}]},
        {"session_id": "cc", "request_kind": "auxiliary"},
    ),
    (
        "claude code model check, by metadata",
        {},
        {
            "max_tokens": 1,
            "metadata": {"user_id": json.dumps({"session_id": "cc"})},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        },
        {"session_id": "cc", "request_kind": "auxiliary"},
    ),
    (
        "claude code turn with tool results",
        CC,
        _cc_fork([{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}], max_tokens=32000),
        {"session_id": "cc", "request_kind": None},
    ),
    (
        "claude code: only the last user message (and what a resumption follows) is read",
        CC,
        {
            "messages": [
                {
                    "role": "user",
                    "content": "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools. (pasted)",
                },
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "Now fix it."},
                {"role": "assistant", "content": "cut"},
                {"role": "user", "content": "Output token limit hit. Resume directly."},
            ]
        },
        {"session_id": "cc", "request_kind": None},
    ),
    (
        "claude code: the header decides",
        {**CC, "x-claude-code-request-class": "main"},
        _cc_fork("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."),
        {"request_kind": "main", "agent_role": "main"},
    ),
    (
        "the compaction prompt outside claude code is nothing",
        {"x-session-id": "s"},
        _cc_fork("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."),
        {"session_id": "s", "request_kind": None},
    ),
]


@pytest.mark.parametrize(
    ("name", "headers", "body", "expected"), FROM_SOURCE, ids=[c[0] for c in FROM_SOURCE]
)
def test_harness_fields_from_source(
    name: str, headers: dict[str, str], body: dict[str, Any], expected: dict[str, Any]
) -> None:
    h = parse_hints(headers, body)
    for field, value in expected.items():
        assert getattr(h, field) == value, field


HARNESS_BAD: list[tuple[dict[str, str], dict[str, Any], str]] = [
    ({}, {"metadata": {"user_id": json.dumps({"session_id": ""})}}, "metadata.user_id.session_id"),
    ({"x-codex-turn-metadata": _codex_meta(thread_id="x" * 300)}, {}, "x-codex-turn-metadata.thread_id"),
    ({"thread-id": "t", "x-codex-parent-thread-id": "bad\x01"}, {}, "x-codex-parent-thread-id"),
    (
        {"x-claude-code-session-id": "cc", "x-claude-code-request-class": ""},
        {},
        "x-claude-code-request-class",
    ),
]


@pytest.mark.parametrize(("headers", "body", "field"), HARNESS_BAD)
def test_invalid_harness_ids_name_the_field(
    headers: dict[str, str], body: dict[str, Any], field: str
) -> None:
    with pytest.raises(HintError) as err:
        parse_hints(headers, body)
    assert err.value.field == field


# -- unknown fields of our own dialect -----------------------------------------------------------
def test_unknown_agent_hints_fields_and_headers_are_named_with_the_nearest_known_one() -> None:
    problems = unknown_hints(
        {"x-agent-sesion-id": "s", "x-agent-session-id": "s", "x-agent-frobnicate": "1"},
        {"agent_hints": {"sesion_end": True, "session_id": "s", "zzz": 1}},
    )
    assert [(p.field, str(p)) for p in problems] == [
        (
            "agent_hints.sesion_end",
            "invalid hint 'agent_hints.sesion_end': unknown field; did you mean 'session_end'?",
        ),
        ("agent_hints.zzz", "invalid hint 'agent_hints.zzz': unknown field"),
        (
            "x-agent-sesion-id",
            "invalid hint 'x-agent-sesion-id': unknown hint header; did you mean 'x-agent-session-id'?",
        ),
        ("x-agent-frobnicate", "invalid hint 'x-agent-frobnicate': unknown hint header"),
    ]


def test_other_dialects_objects_and_our_known_fields_pass() -> None:
    body = {
        "agent_hints": {k: None for k in AGENT_HINT_FIELDS},
        "nvext": {"agent_hints": {"osl": 5, "something_new": 1}, "other": 2},
        "metadata": {"user_id": "x", "anything": 1},
        "vllm_xargs": {"agentic_context": {"new_field": 1}},
        "client_metadata": {"whatever": 1},
    }
    headers = {h: "1" for h in HEADER_NAMES if h.startswith("x-agent-")} | {"x-agentgw-key": "k"}
    assert unknown_hints(headers, body) == []
