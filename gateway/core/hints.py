"""Every agent-hint dialect -> one :class:`AgentHints`.

Sources, highest precedence first (a field takes the first source that sets it):

1. ours, body: ``agent_hints`` {session_id, parent_session_id, agent_id, agent_role,
   turn_index, expected_tool_latency_ms, fan_out, latency_class, session_end, priority,
   kv_retention_ttl_s}
2. ours, headers: ``X-Agent-Session-Id``, ``X-Agent-Parent-Session-Id``, ``X-Agent-Id``,
   ``X-Agent-Role``, ``X-Agent-Turn``, ``X-Agent-Tool-Latency-Ms``, ``X-Agent-Fan-Out``,
   ``X-Agent-Latency-Class``, ``X-Agent-Session-End``, ``X-Agent-Priority``
3. Dynamo: ``X-Dynamo-Session-ID``, ``X-Dynamo-Parent-Session-ID``, ``X-Dynamo-Session-Final``,
   body ``nvext.agent_hints`` {priority, osl, speculative_prefill}
4. the Rust vLLM router: body ``vllm_xargs.agentic_context`` {session_id, parent_session_id /
   parent_ids, agent_role, expected_resume (s), kv_retention_ttl_seconds, priority}
5. vLLM: header ``X-Session-ID``, body ``session_id``
6. Claude Code: ``x-claude-code-session-id`` (else the ``session_id`` inside body
   ``metadata.user_id``, a JSON string), ``x-claude-code-agent-id``,
   ``x-claude-code-parent-agent-id`` (a subagent's session is ``<session>#<agent>``, its parent
   ``<session>#<parent agent>`` or ``<session>`` for the main agent),
   ``x-claude-code-request-class`` (main | subagent | workflow | compaction | auxiliary |
   side_reply: ``request_kind``; subagent / workflow mark a subagent; sent only with
   ``CLAUDE_CODE_GATEWAY_HINT_HEADERS=1``), else the kind its default body shows
   (:func:`claude_code_request_kind`: its compaction and helper prompts, a one-token probe)
7. Codex: the thread is the session: ``thread-id``, else ``x-codex-turn-metadata`` (JSON; header,
   else body ``client_metadata``) ``thread_id``, else ``session-id`` / metadata ``session_id``
   (the root thread's id, shared by its subagents); a subagent's parent is
   ``x-codex-parent-thread-id`` or metadata ``parent_thread_id``; ``x-openai-subagent`` (review |
   compact | memory_consolidation | collab_spawn | a label) or metadata ``subagent_kind`` marks a
   subagent; a fork (metadata ``forked_from_thread_id``) is a main agent whose parent is the thread
   it forked from; metadata ``agent_name`` -> ``agent_id``, ``turn_id``, ``request_kind`` (turn |
   prewarm | compaction | memory)
8. aiperf: ``X-Correlation-ID``
9. OpenAI: ``prompt_cache_key``, then ``user`` as a last resort.

Validation: ids are 1-256 printable characters; numbers are bounded (see ``_RANGES``). An invalid
value raises :class:`HintError` naming the field as the client wrote it. A field of our own
dialect that no hint has (a key of ``agent_hints`` or an ``X-Agent-*`` header not listed above,
usually a typo) is found by :func:`unknown_hints`, with the nearest known name; other dialects'
objects (``nvext``, ``metadata``, ``vllm_xargs``, ...) are theirs and are not checked.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

MAX_ID_LEN = 256

_RANGES: dict[str, tuple[float, float]] = {
    "turn_index": (0, 1_000_000),
    "expected_tool_latency_ms": (0, 7 * 24 * 3600 * 1000),
    "fan_out": (0, 1024),
    "priority": (-1_000_000, 1_000_000),
    "kv_retention_ttl_s": (0, 7 * 24 * 3600),
    "osl": (0, 10_000_000),
}

#: Body keys that only the gateway understands: removed before forwarding.
GATEWAY_BODY_KEYS = ("agent_hints", "nvext")
#: Header names (lowercase) that carry hints: never forwarded to engines.
HINT_HEADERS = frozenset(
    {
        "x-agent-session-id",
        "x-agent-parent-session-id",
        "x-agent-id",
        "x-agent-role",
        "x-agent-turn",
        "x-agent-tool-latency-ms",
        "x-agent-fan-out",
        "x-agent-latency-class",
        "x-agent-session-end",
        "x-agent-priority",
        "x-dynamo-session-id",
        "x-dynamo-parent-session-id",
        "x-dynamo-session-final",
    }
)


class HintError(ValueError):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"invalid hint '{field_name}': {message}")
        self.field = field_name


@dataclass(frozen=True, slots=True)
class AgentHints:
    session_id: str | None = None
    parent_session_id: str | None = None
    agent_id: str | None = None
    agent_role: str | None = None
    """``main`` or ``subagent``."""
    turn_index: int | None = None
    expected_tool_latency_ms: int | None = None
    fan_out: int | None = None
    latency_class: str | None = None
    """``interactive`` or ``background``."""
    session_end: bool = False
    priority: int | None = None
    kv_retention_ttl_s: float | None = None
    osl: int | None = None
    speculative_prefill: bool = False
    request_kind: str | None = None
    """What the harness says this request is, in its own words (Codex: turn, prewarm, compaction,
    memory; Claude Code: main, subagent, workflow, compaction, auxiliary, side_reply)."""
    turn_id: str | None = None
    """The harness's id for the user turn this request serves (Codex)."""
    sources: dict[str, str] = field(default_factory=dict)
    """For each set field, the dialect it came from (for explanations)."""

    @property
    def is_subagent(self) -> bool:
        return self.agent_role == "subagent" or (
            self.agent_role is None and self.parent_session_id is not None
        )

    @property
    def interactive(self) -> bool:
        if self.latency_class is not None:
            return self.latency_class == "interactive"
        return not self.is_subagent

    def merged(self, other: AgentHints) -> AgentHints:
        """``self`` with the fields ``other`` sets overriding (for out-of-band updates)."""
        changes: dict[str, Any] = {}
        for name in other.sources:
            changes[name] = getattr(other, name)
        if other.session_end:
            changes["session_end"] = True
        return replace(self, **changes, sources={**self.sources, **other.sources})


# -- value checks ------------------------------------------------------------------------------
def _id(name: str, v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str):
        raise HintError(name, "must be a string")
    text: str = v.strip()
    if not text or len(text) > MAX_ID_LEN or not text.isprintable():
        raise HintError(name, f"must be 1-{MAX_ID_LEN} printable characters")
    return text


def _num(name: str, key: str, v: Any, integer: bool = True) -> Any:
    if isinstance(v, str):
        try:
            v = float(v) if "." in v or "e" in v.lower() else int(v)
        except ValueError:
            raise HintError(name, "must be a number") from None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise HintError(name, "must be a number")
    if integer and isinstance(v, float):
        if not v.is_integer():
            raise HintError(name, "must be an integer")
        v = int(v)
    lo, hi = _RANGES[key]
    if not lo <= v <= hi:
        raise HintError(name, f"must be between {lo:g} and {hi:g}")
    return v


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(v, int):
        return v != 0
    raise HintError(name, "must be a boolean")


def _enum(name: str, v: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v.strip().lower() not in allowed:
        raise HintError(name, f"must be one of {', '.join(allowed)}")
    return v.strip().lower()


# -- parsing -----------------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def set(self, key: str, value: Any, source: str) -> None:
        if value is not None and key not in self.values:
            self.values[key] = value
            self.sources[key] = source


def _ours(b: _Builder, d: Mapping[str, Any], source: str, prefix: str) -> None:
    def name(k: str) -> str:
        return f"{prefix}{k}"

    for key in ("session_id", "parent_session_id", "agent_id"):
        if d.get(key) is not None:
            b.set(key, _id(name(key), d[key]), source)
    if d.get("agent_role") is not None:
        b.set("agent_role", _enum(name("agent_role"), d["agent_role"], ("main", "subagent")), source)
    for key in ("turn_index", "expected_tool_latency_ms", "fan_out", "priority"):
        if d.get(key) is not None:
            b.set(key, _num(name(key), key, d[key]), source)
    if d.get("kv_retention_ttl_s") is not None:
        b.set(
            "kv_retention_ttl_s",
            _num(name("kv_retention_ttl_s"), "kv_retention_ttl_s", d["kv_retention_ttl_s"], False),
            source,
        )
    if d.get("latency_class") is not None:
        b.set(
            "latency_class",
            _enum(name("latency_class"), d["latency_class"], ("interactive", "background")),
            source,
        )
    if d.get("session_end") is not None:
        b.set("session_end", _bool(name("session_end"), d["session_end"]), source)


#: The fields of ``agent_hints`` (also the body of ``POST /v1/agent/sessions/{id}/hints``).
AGENT_HINT_FIELDS = (
    "session_id",
    "parent_session_id",
    "agent_id",
    "agent_role",
    "turn_index",
    "expected_tool_latency_ms",
    "fan_out",
    "latency_class",
    "session_end",
    "priority",
    "kv_retention_ttl_s",
)
#: Our headers' prefix (lowercase): a header with it that is not one of ours is an unknown hint.
#: (``x-agentgw-*`` does not have it.)
OUR_HEADER_PREFIX = "x-agent-"

_HEADER_FIELDS = {
    "x-agent-session-id": "session_id",
    "x-agent-parent-session-id": "parent_session_id",
    "x-agent-id": "agent_id",
    "x-agent-role": "agent_role",
    "x-agent-turn": "turn_index",
    "x-agent-tool-latency-ms": "expected_tool_latency_ms",
    "x-agent-fan-out": "fan_out",
    "x-agent-latency-class": "latency_class",
    "x-agent-session-end": "session_end",
    "x-agent-priority": "priority",
}


#: Every header name (lowercase) that any dialect reads.
HEADER_NAMES = HINT_HEADERS | {
    "x-session-id",
    "x-claude-code-session-id",
    "x-claude-code-agent-id",
    "x-claude-code-parent-agent-id",
    "x-claude-code-request-class",
    "session-id",
    "thread-id",
    "x-codex-turn-metadata",
    "x-codex-parent-thread-id",
    "x-openai-subagent",
    "x-correlation-id",
}
#: Body keys that carry hints (of any dialect) and nothing of the prompt.
HINT_BODY_KEYS = (
    "agent_hints",
    "nvext",
    "vllm_xargs",
    "session_id",
    "metadata",
    "client_metadata",
    "prompt_cache_key",
    "user",
)
#: The largest harness JSON blob (``x-codex-turn-metadata``, ``metadata.user_id``) that is read.
MAX_HARNESS_JSON = 64 * 1024
CLAUDE_CODE_SUBAGENT_CLASSES = frozenset({"subagent", "workflow"})


def _json_object(text: Any) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object, or None when it is not one (a harness's own metadata:
    a shape it changes must not turn its requests away)."""
    if not isinstance(text, str) or not text.startswith("{") or len(text) > MAX_HARNESS_JSON:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _claude_code_metadata_session(body: Mapping[str, Any]) -> str | None:
    """The ``session_id`` inside Claude Code's ``metadata.user_id`` (a JSON string)."""
    metadata = body.get("metadata")
    if not isinstance(metadata, dict):
        return None
    user = _json_object(metadata.get("user_id"))
    if user is None or user.get("session_id") is None:
        return None
    return _id("metadata.user_id.session_id", user["session_id"])


#: The fixed instructions Claude Code 2.1.x appends, as a user message, to a copy of the
#: conversation for a request that is not a turn (a fork: same system, tools and history as the
#: main loop, never written to its transcript), and the ``request_kind`` each marks. Compaction
#: (``/compact``, auto and reactive compaction, partial compaction) was seen in a live capture;
#: the others are read from its bundled source (tests/core/test_hints.py builds them).
CLAUDE_CODE_FORK_PROMPTS: tuple[tuple[str, str], ...] = (
    ("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.", "compaction"),
    ("<system-reminder>This is a side question from the user.", "side_reply"),  # /btw
    ("[SUGGESTION MODE: Suggest what the user might naturally type next", "auxiliary"),
    ("The user stepped away and is coming back. Recap in under 40 words", "auxiliary"),
    ("Describe your most recent action in 3-5 words", "auxiliary"),  # agent summary
    ("Describe the agent's most recent action in 3-5 words", "auxiliary"),
    ("Generate a short kebab-case name (2-4 words) that captures the main topic", "auxiliary"),
)
_FORK_PREFIXES = tuple(p for p, _ in CLAUDE_CODE_FORK_PROMPTS)


def _fork_kind(text: str) -> str | None:
    if not text.startswith(_FORK_PREFIXES):  # one C call for the common case: no marker
        return None
    return next(k for p, k in CLAUDE_CODE_FORK_PROMPTS if text.startswith(p))


#: How Claude Code resumes a request cut by its output limit (live): a user message after the
#: cut answer; a fork so resumed keeps its prompt before it.
CLAUDE_CODE_RESUME_PROMPT = "Output token limit hit."


def _user_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str)]
    return []


def claude_code_request_kind(body: Mapping[str, Any]) -> str | None:
    """What a Claude Code request is, from what it sends by default (no request-class header):

    - ``compaction`` / ``side_reply`` / ``auxiliary``: the last user message starts with one of
      :data:`CLAUDE_CODE_FORK_PROMPTS`, or, for a fork cut by its output limit and resumed, the
      user message before Claude Code's resumption messages (:data:`CLAUDE_CODE_RESUME_PROMPT`);
    - ``auxiliary``: ``max_tokens`` 1 (a probe: the resume cache warm, the model, key and quota
      checks; a turn is never limited to one token).
    None: a turn of the main loop or of a subagent (a prompt, tool results, a resumption), as
    without the rule. Reads the last few messages only."""
    if type(body.get("max_tokens")) is int and body["max_tokens"] == 1:
        return "auxiliary"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        texts = _user_texts(m.get("content"))
        for text in texts:
            kind = _fork_kind(text)
            if kind is not None:
                return kind
        if not (texts and texts[0].startswith(CLAUDE_CODE_RESUME_PROMPT)):
            return None
    return None


def _codex_metadata(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Codex's turn metadata (the header, else body ``client_metadata``) and where it came from."""
    meta = _json_object(headers.get("x-codex-turn-metadata"))
    if meta is not None:
        return meta, "x-codex-turn-metadata"
    cm = body.get("client_metadata")
    if isinstance(cm, dict):
        meta = _json_object(cm.get("x-codex-turn-metadata"))
        if meta is not None:
            return meta, "client_metadata.x-codex-turn-metadata"
    return {}, ""


def _codex(b: _Builder, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
    meta, where = _codex_metadata(headers, body)

    def from_meta(key: str) -> str | None:
        v = meta.get(key)
        return None if v is None else _id(f"{where}.{key}", v)

    thread = _id("thread-id", headers["thread-id"]) if "thread-id" in headers else from_meta("thread_id")
    session = _id("session-id", headers["session-id"]) if "session-id" in headers else from_meta("session_id")
    b.set("session_id", thread or session, "codex")
    parent = (
        _id("x-codex-parent-thread-id", headers["x-codex-parent-thread-id"])
        if "x-codex-parent-thread-id" in headers
        else from_meta("parent_thread_id")
    )
    subagent = headers.get("x-openai-subagent")
    if subagent is not None:
        subagent = _id("x-openai-subagent", subagent)
    kind = subagent or (from_meta("subagent_kind") if meta.get("subagent_kind") is not None else None)
    forked = from_meta("forked_from_thread_id")
    if parent is not None:
        b.set("parent_session_id", parent, "codex")
    elif forked is not None:
        b.set("parent_session_id", forked, "codex")
        b.set("agent_role", "main", "codex")
    if kind is not None or parent is not None:
        b.set("agent_role", "subagent", "codex")
    if meta.get("agent_name") is not None:
        b.set("agent_id", from_meta("agent_name"), "codex")
    if meta.get("turn_id") is not None:
        b.set("turn_id", from_meta("turn_id"), "codex")
    if meta.get("request_kind") is not None:
        b.set("request_kind", from_meta("request_kind"), "codex")


def _did_you_mean(name: str, known: tuple[str, ...] | frozenset[str], prefix: str = "") -> str:
    """`; did you mean 'X'?` for the known name nearest ``name`` (compared without ``prefix``,
    which every header shares), or nothing."""
    tails = {k.removeprefix(prefix): k for k in known}
    near = difflib.get_close_matches(name.removeprefix(prefix), sorted(tails), n=1, cutoff=0.7)
    return f"; did you mean '{tails[near[0]]}'?" if near else ""


def unknown_hints(headers: Mapping[str, str], body: Mapping[str, Any]) -> list[HintError]:
    """Our own dialect's fields that no hint has: keys of ``agent_hints`` (named
    ``agent_hints.<key>``) and ``X-Agent-*`` headers (lowercase) that are not ours, each a
    :class:`HintError` with the nearest known name when there is one. Other dialects' objects
    pass unchecked. ``headers`` as for :func:`parse_hints` (lowercase names)."""
    problems = []
    ah = body.get("agent_hints")
    if isinstance(ah, dict):
        for key in ah:
            if key not in AGENT_HINT_FIELDS:
                hint = _did_you_mean(str(key), AGENT_HINT_FIELDS)
                problems.append(HintError(f"agent_hints.{key}", f"unknown field{hint}"))
    for name in headers:
        if name.startswith(OUR_HEADER_PREFIX) and name not in _HEADER_FIELDS:
            hint = _did_you_mean(name, frozenset(_HEADER_FIELDS), OUR_HEADER_PREFIX)
            problems.append(HintError(name, f"unknown hint header{hint}"))
    return problems


NO_HINTS = AgentHints()


def parse_hints(headers: Mapping[str, str], body: Mapping[str, Any]) -> AgentHints:
    """Collect hints from every dialect. ``headers`` has lowercase names (only the hint headers
    matter; see ``HEADER_NAMES``)."""
    if not headers and not any(k in body for k in HINT_BODY_KEYS):
        return NO_HINTS
    b = _Builder()
    ah = body.get("agent_hints")
    if ah is not None:
        if not isinstance(ah, dict):
            raise HintError("agent_hints", "must be an object")
        _ours(b, ah, "agent_hints", "agent_hints.")
    hdr = {f: headers[h] for h, f in _HEADER_FIELDS.items() if h in headers}
    if hdr:
        # report header names in errors
        for h, f in _HEADER_FIELDS.items():
            if h in headers:
                try:
                    _ours(_Builder(), {f: headers[h]}, "", "")
                except HintError as exc:
                    raise HintError(h, str(exc).split(": ", 1)[1]) from None
        _ours(b, hdr, "headers", "")

    # Dynamo
    if "x-dynamo-session-id" in headers:
        b.set("session_id", _id("X-Dynamo-Session-ID", headers["x-dynamo-session-id"]), "dynamo")
    if "x-dynamo-parent-session-id" in headers:
        b.set(
            "parent_session_id",
            _id("X-Dynamo-Parent-Session-ID", headers["x-dynamo-parent-session-id"]),
            "dynamo",
        )
    if "x-dynamo-session-final" in headers:
        b.set("session_end", _bool("X-Dynamo-Session-Final", headers["x-dynamo-session-final"]), "dynamo")
    nvext = body.get("nvext")
    if nvext is not None:
        if not isinstance(nvext, dict):
            raise HintError("nvext", "must be an object")
        nah = nvext.get("agent_hints")
        if nah is not None:
            if not isinstance(nah, dict):
                raise HintError("nvext.agent_hints", "must be an object")
            if nah.get("priority") is not None:
                b.set("priority", _num("nvext.agent_hints.priority", "priority", nah["priority"]), "dynamo")
            if nah.get("osl") is not None:
                b.set("osl", _num("nvext.agent_hints.osl", "osl", nah["osl"]), "dynamo")
            if nah.get("speculative_prefill") is not None:
                b.set(
                    "speculative_prefill",
                    _bool("nvext.agent_hints.speculative_prefill", nah["speculative_prefill"]),
                    "dynamo",
                )

    # the Rust vLLM router
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and xargs.get("agentic_context") is not None:
        ac = xargs["agentic_context"]
        p = "vllm_xargs.agentic_context."
        if not isinstance(ac, dict):
            raise HintError("vllm_xargs.agentic_context", "must be an object")
        if ac.get("session_id") is not None:
            b.set("session_id", _id(p + "session_id", ac["session_id"]), "vllm_router")
        parent = ac.get("parent_session_id")
        if parent is None and isinstance(ac.get("parent_ids"), list) and ac["parent_ids"]:
            parent = ac["parent_ids"][-1]
        if parent is not None:
            b.set("parent_session_id", _id(p + "parent_ids", parent), "vllm_router")
        if ac.get("agent_role") is not None:
            role = str(ac["agent_role"]).lower()
            b.set(
                "agent_role",
                "main" if role in ("main", "root", "orchestrator") else "subagent",
                "vllm_router",
            )
        if ac.get("expected_resume") is not None:
            secs = _num(p + "expected_resume", "kv_retention_ttl_s", ac["expected_resume"], False)
            b.set("expected_tool_latency_ms", int(secs * 1000), "vllm_router")
        if ac.get("kv_retention_ttl_seconds") is not None:
            b.set(
                "kv_retention_ttl_s",
                _num(
                    p + "kv_retention_ttl_seconds",
                    "kv_retention_ttl_s",
                    ac["kv_retention_ttl_seconds"],
                    False,
                ),
                "vllm_router",
            )
        if ac.get("priority") is not None:
            b.set("priority", _num(p + "priority", "priority", ac["priority"]), "vllm_router")

    # vLLM
    if "x-session-id" in headers:
        b.set("session_id", _id("X-Session-ID", headers["x-session-id"]), "vllm")
    if body.get("session_id") is not None:
        b.set("session_id", _id("session_id", body["session_id"]), "vllm")

    # Claude Code
    cc = headers.get("x-claude-code-session-id")
    cc = _id("x-claude-code-session-id", cc) if cc is not None else _claude_code_metadata_session(body)
    if cc is not None:
        agent = headers.get("x-claude-code-agent-id")
        parent_agent = headers.get("x-claude-code-parent-agent-id")
        if agent is not None:
            agent = _id("x-claude-code-agent-id", agent)
            b.set("session_id", f"{cc}#{agent}", "claude_code")
            b.set("agent_id", agent, "claude_code")
            if parent_agent is not None:
                parent_agent = _id("x-claude-code-parent-agent-id", parent_agent)
                b.set("parent_session_id", f"{cc}#{parent_agent}", "claude_code")
            else:
                b.set("parent_session_id", cc, "claude_code")
            b.set("agent_role", "subagent", "claude_code")
        else:
            b.set("session_id", cc, "claude_code")
        klass = headers.get("x-claude-code-request-class")
        if klass is not None:
            klass = _id("x-claude-code-request-class", klass).lower()
            b.set("request_kind", klass, "claude_code")
            if klass in CLAUDE_CODE_SUBAGENT_CLASSES:
                b.set("agent_role", "subagent", "claude_code")
            elif klass == "main":
                b.set("agent_role", "main", "claude_code")
        else:
            b.set("request_kind", claude_code_request_kind(body), "claude_code")

    # Codex, aiperf, OpenAI
    _codex(b, headers, body)
    if "x-correlation-id" in headers:
        b.set("session_id", _id("x-correlation-id", headers["x-correlation-id"]), "aiperf")
    for key in ("prompt_cache_key", "user"):
        if body.get(key) is not None:
            b.set("session_id", _id(key, body[key]), "openai")

    if b.values.get("agent_role") is None and b.values.get("parent_session_id") is not None:
        b.set("agent_role", "subagent", b.sources["parent_session_id"])
    return AgentHints(**b.values, sources=b.sources)
