"""A harness's auxiliary requests (a compaction between two turns, a side request) do not settle
the session: through a served gateway in front of the three real engines, a Codex-style
session's turn 1, then a request the harness marks ``request_kind: compaction`` (Codex's
``x-codex-turn-metadata``) or ``x-claude-code-request-class: compaction`` / ``auxiliary``
(Claude Code; by default, without that header, its compaction instruction), then turn 2. The
session's record (home, turns, context tokens, prefix hashes, last decision) and the token ids
kept for its KV prefetch (none without engine_ext engines) are exactly as turn 1 left them after
the compaction; turn 2 is then the session's second turn. Without the rule the compaction would
have counted as turn 2 (its prompt's hashes and size)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from gateway.core.sessions import SessionRecord
from tests.conftest import MODEL, ServedGateway

pytestmark = pytest.mark.engine

SYSTEM = "You are a coding agent working in a repository. " + "Keep the change small and tested. " * 80
#: Polls of the session record while a turn settles (it settles after its answer is sent).
MAX_POLLS = 400


def _record(gw: ServedGateway, sid: str) -> SessionRecord | None:
    svc = gw.service
    return asyncio.run_coroutine_threadsafe(svc.sessions.get(sid, svc.clock()), gw.loop).result(10)  # type: ignore[no-any-return]


def _settled(gw: ServedGateway, sid: str, turns: int) -> SessionRecord:
    """The session's record once ``turns`` turns have settled and none is in flight."""
    for _ in range(MAX_POLLS):
        rec = _record(gw, sid)
        if rec is not None and rec.turns >= turns and rec.inflight == 0:
            return rec
        time.sleep(0.05)
    raise AssertionError(f"session {sid} did not settle {turns} turn(s): {_record(gw, sid)}")


def _state(gw: ServedGateway, rec: SessionRecord) -> dict[str, Any]:
    return {
        "home": rec.home,
        "pool": rec.pool,
        "turns": rec.turns,
        "context_tokens": rec.context_tokens,
        "prefix_hashes": list(rec.prefix_hashes),
        "last_decision": rec.last_decision,
        "kept_tokens": gw.service.prompts.session_tokens(rec.session_id),
    }


def _codex_headers(thread: str, turn: str, kind: str) -> dict[str, str]:
    meta = {"session_id": thread, "thread_id": thread, "agent_name": "/root", "turn_id": turn}
    return {
        "thread-id": thread,
        "session-id": thread,
        "x-codex-turn-metadata": json.dumps(meta | {"request_kind": kind}),
    }


def _codex_body(user_turns: list[str]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for i, text in enumerate(user_turns):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        if i < len(user_turns) - 1:
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Done."}],
                }
            )
    return {"model": MODEL, "instructions": SYSTEM, "input": items, "max_output_tokens": 4, "store": False}


def test_a_codex_compaction_between_two_turns_leaves_the_session_as_it_was(gateway: ServedGateway) -> None:
    thread = "codex-aux-thread-1"
    url = f"{gateway.url}/v1/responses"
    first = ["List the files in the repository and say which one holds the tests. " * 3]
    r1 = httpx.post(url, json=_codex_body(first), headers=_codex_headers(thread, "t1", "turn"), timeout=120)
    assert r1.status_code == 200, r1.text
    assert r1.headers["x-agentgw-session"] == thread
    before = _state(gateway, _settled(gateway, thread, 1))
    assert before["turns"] == 1 and before["home"] == r1.headers["x-agentgw-engine"]
    # token ids are kept only where a KV prefetch can use them (migration on, engine_ext engines);
    # these engines have no control API, so none are kept, and the compaction must keep none
    assert before["kept_tokens"] is None and not gateway.service.prompts.keeps_tokens

    # the harness compacts: the whole history plus a summarising instruction, marked as such
    compact = _codex_body([*first, "Summarise the conversation so far for a new context window. " * 4])
    rc = httpx.post(url, json=compact, headers=_codex_headers(thread, "t1", "compaction"), timeout=120)
    assert rc.status_code == 200, rc.text
    assert "x-agentgw-session" not in rc.headers  # routed as a session-less request
    # the compaction has left the gateway (its admission slot is back) before the record is read
    for _ in range(MAX_POLLS):
        if gateway.service.admission.global_slots.used == 0:
            break
        time.sleep(0.05)
    after = _state(gateway, _record(gateway, thread) or SessionRecord(thread))
    assert after == before

    # the next real turn is the session's turn 2 (the compaction did not count as one)
    r2 = httpx.post(
        url,
        json=_codex_body([*first, "Now run the tests."]),
        headers=_codex_headers(thread, "t2", "turn"),
        timeout=120,
    )
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-agentgw-session"] == thread
    rec = _settled(gateway, thread, 2)
    assert rec.turns == 2 and rec.prefix_hashes[: len(before["prefix_hashes"])] == before["prefix_hashes"]


#: How Claude Code 2.1.328 starts its compaction instruction (a live capture:
#: tests/data/captures/claude_code_2.1.328_compact.json), the only sign of it by default.
CC_COMPACT = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n"
    "- Do NOT use Read, Bash, Grep, Glob, Edit, Write, or ANY other tool.\n\n"
    "Your task is to create a detailed summary of the conversation so far."
)


@pytest.mark.parametrize(
    ("klass", "prompt"),
    [("compaction", "Summarise."), ("auxiliary", "Summarise."), (None, CC_COMPACT)],
    ids=["class-compaction", "class-auxiliary", "default-compaction"],
)
def test_claude_code_compaction_and_auxiliary_requests_do_not_settle_the_session(
    gateway: ServedGateway, klass: str | None, prompt: str
) -> None:
    """With ``CLAUDE_CODE_GATEWAY_HINT_HEADERS=1`` the request class says so; by default (no
    class header) the compaction instruction in the last user message does."""
    sid = f"cc-aux-{klass or 'default'}"
    url = f"{gateway.url}/v1/messages"
    msgs = [{"role": "user", "content": "Fix the failing test in tests/test_a.py. " * 6}]
    body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "messages": msgs}
    r1 = httpx.post(url, json=body, headers={"x-claude-code-session-id": sid}, timeout=120)
    assert r1.status_code == 200, r1.text
    before = _state(gateway, _settled(gateway, sid, 1))
    aux = {
        **body,
        "messages": [
            *msgs,
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": prompt},
        ],
    }
    headers = {"x-claude-code-session-id": sid}
    if klass is not None:
        headers["x-claude-code-request-class"] = klass
    ra = httpx.post(url, json=aux, headers=headers, timeout=120)
    assert ra.status_code == 200, ra.text
    assert "x-agentgw-session" not in ra.headers
    for _ in range(MAX_POLLS):
        if gateway.service.admission.global_slots.used == 0:
            break
        time.sleep(0.05)
    assert _state(gateway, _record(gateway, sid) or SessionRecord(sid)) == before
    # the next real turn is the session's turn 2
    turn2 = {
        **body,
        "messages": [*msgs, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Go on."}],
    }
    r2 = httpx.post(url, json=turn2, headers={"x-claude-code-session-id": sid}, timeout=120)
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-agentgw-session"] == sid
    assert _settled(gateway, sid, 2).turns == 2
