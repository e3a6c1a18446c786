"""Prompts: what a parsed request says about itself before routing. The agent hints (from every
dialect), the prompt's block hashes (exact through the model's tokenizer, else approximate over
the prompt text) and which prefix index they belong to, bundled as a core
:class:`~gateway.core.turn.Turn`.

Auxiliary requests are not the session's next turn: a harness's compaction (the conversation
summarised to start a shorter one), a title or side question, a memory pass, a cache prewarm
(``request_kind`` in :data:`AUXILIARY_KINDS`, from Codex's ``x-codex-turn-metadata`` or Claude
Code's ``x-claude-code-request-class``, which it sends only when asked to; else from its default
body: :func:`gateway.core.hints.claude_code_request_kind`). Their hints lose the session and its
parent, so they are routed as session-less requests (by where their prefix is cached, and load)
and never place or settle the session: its home, turns, prefix hashes, kept token ids, pins and
planned migrations stay as the last real turn left them.

Read-only: nothing here changes state the router reads (the dry run of ``/debug/route`` uses it
as the real path does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import orjson

from gateway.analysis import Analysis, AnalysisRequest, AnalysisSkipped, PromptAnalyzer
from gateway.config import GatewayConfig
from gateway.core.hints import (
    HEADER_NAMES,
    OUR_HEADER_PREFIX,
    AgentHints,
    HintError,
    parse_hints,
    unknown_hints,
)
from gateway.core.turn import IndexKind, Turn, approx_hashes, index_for
from gateway.service.metrics import GatewayMetrics
from gateway.service.tenants import ANONYMOUS, Tenant
from gateway.wire.openai import ParsedRequest

__all__ = ["AUXILIARY_KINDS", "PromptRead", "Prompts", "without_session"]

_HINT_HEADER_BYTES = frozenset(h.encode() for h in HEADER_NAMES)
_OUR_PREFIX = OUR_HEADER_PREFIX.encode()

#: ``request_kind`` values that mark a request as not the session's next turn (Codex:
#: ``compaction``, ``memory``, ``prewarm``; Claude Code: ``compaction``, ``auxiliary``,
#: ``side_reply``, by its header or its default body). Kinds not listed (``turn``, ``main``,
#: ``subagent``, ``workflow``, anything new) are turns, as before.
AUXILIARY_KINDS = frozenset({"compaction", "auxiliary", "side_reply", "memory", "prewarm"})
_SESSION_FIELDS = ("session_id", "parent_session_id", "session_end")


def without_session(hints: AgentHints) -> AgentHints:
    """An auxiliary request's hints: the same, less the session, its parent and its end."""
    sources = {k: v for k, v in hints.sources.items() if k not in _SESSION_FIELDS}
    return replace(hints, session_id=None, parent_session_id=None, session_end=False, sources=sources)


@dataclass(slots=True)
class PromptRead:
    turn: Turn
    index: IndexKind
    exact: bool
    """True when tokens and hashes are exact (a tokenizer is configured for the model)."""
    warning: str | None = None
    tokens: Sequence[int] = ()
    """The prompt's token ids when the session's are kept (exact analysis, a session id, moves
    on): :meth:`Prompts.remember` keeps them once the turn is admitted."""


def prompt_text(parsed: ParsedRequest) -> str:
    """The prompt as text, the approximate hashes' input: each message's role and text content."""
    body = parsed.prompt if parsed.prompt is not None else parsed.body
    if parsed.kind == "chat":
        parts = []
        for m in body["messages"]:
            c = m.get("content")
            if isinstance(c, list):
                c = "\n".join(t for p in c if isinstance(p, dict) and isinstance(t := p.get("text"), str))
            parts.append(f"<{m.get('role')}>{c if isinstance(c, str) else ''}")
        return "".join(parts)
    p = body["prompt"]
    return p if isinstance(p, str) else orjson.dumps(p).decode()


class Prompts:
    def __init__(self, config: GatewayConfig, kv_events: bool, metrics: GatewayMetrics) -> None:
        self.config = config
        self.kv_events = kv_events
        """Whether any engine publishes KV events (the precise index is fed)."""
        self.metrics = metrics
        self.analyzer = PromptAnalyzer(config.models, config.analysis, metrics)
        """Exact tokens and hashes, off the event loop."""
        self.block_sizes = {m.name: m.block_size for m in config.models}
        self.keeps_tokens = config.migration.enabled and any(
            e.control_url for p in config.pools for e in p.engines
        )
        """Whether a session's token ids are ever read (KV prefetch to an engine_ext engine):
        when not, analysis workers send back only counts and block hashes."""
        self._seq = 0

    def hints(
        self, parsed: ParsedRequest, headers: Sequence[tuple[bytes, bytes]], tenant: Tenant = ANONYMOUS
    ) -> tuple[AgentHints, str | None]:
        """The request's hints, their ids in the tenant's namespace (none for an auxiliary
        request); an invalid hint is a :class:`HintError` under ``on_invalid: reject``, else
        ignored with a warning."""
        hints, warning = self._hints(parsed, headers)
        if hints.request_kind in AUXILIARY_KINDS:
            hints = without_session(hints)
        if hints.session_id is not None or hints.parent_session_id is not None:
            sid, pid = hints.session_id, hints.parent_session_id
            hints = replace(
                hints,
                session_id=tenant.namespace(sid) if sid is not None else None,
                parent_session_id=tenant.namespace(pid) if pid is not None else None,
            )
        return hints, warning

    def _hints(
        self, parsed: ParsedRequest, headers: Sequence[tuple[bytes, bytes]]
    ) -> tuple[AgentHints, str | None]:
        hdrs = {}
        for k, v in headers:
            if k in _HINT_HEADER_BYTES or k.startswith(_OUR_PREFIX):  # an unknown X-Agent-* too
                try:  # UTF-8 as clients send it (an id "café" is printable); else byte for byte
                    hdrs[k.decode("latin-1")] = v.decode("utf-8")
                except UnicodeDecodeError:
                    hdrs[k.decode("latin-1")] = v.decode("latin-1")
        reject = self.config.hints.on_invalid == "reject"
        warning = None
        if hdrs or "agent_hints" in parsed.body:
            unknown = unknown_hints(hdrs, parsed.body)
            if unknown and reject:
                raise unknown[0]
            # ignore: the known hints still count; each unknown name is in the warning
            warning = "; ".join(str(u) for u in unknown) or None
        try:
            return parse_hints(hdrs, parsed.body), warning
        except HintError as exc:
            if reject:
                raise
            return AgentHints(), "; ".join(w for w in (warning, str(exc)) if w)

    def exact_for(self, model: str) -> bool:
        """Whether ``model``'s prompts get exact hashes (its tokenizer is configured)."""
        return model in self.analyzer.models

    async def read(
        self,
        parsed: ParsedRequest,
        headers: Sequence[tuple[bytes, bytes]],
        dry_run: bool = False,
        tenant: Tenant = ANONYMOUS,
    ) -> PromptRead:
        """``dry_run``: the same reading without counting a request (round-robin's counter) or
        returning the session's tokens to keep. It writes nothing of the session (the caller keeps
        the tokens once the turn is admitted: :meth:`remember`). A prompt that cannot be analysed exactly in time (or
        at all: it depends on state held by the engine) is hashed approximately, and counted."""
        hints, warning = self.hints(parsed, headers, tenant)
        info: Analysis | None = None
        keep = False
        if not parsed.exact:
            if self.exact_for(parsed.model):
                self.metrics.count_analysis_skipped("engine_state")
        else:
            body, raw = (parsed.body, parsed.raw) if parsed.prompt is None else (parsed.prompt, None)
            keep = not dry_run and self.keeps_tokens and hints.session_id is not None
            try:
                info = await self.analyzer.analyze(
                    AnalysisRequest(parsed.model, parsed.kind, body, raw, keep)
                )
            except AnalysisSkipped:
                info = None  # counted by the analyzer
        if info is not None:
            n_tokens, hashes, block_size = info.num_tokens, info.hashes, info.block_size
        else:
            # in the tenant's namespace like the exact hashes (salted through cache_salt):
            # a match on another tenant's text would tell the caller what that tenant sent
            chunk = self.config.routing.approx_chunk_chars
            hashes = approx_hashes(prompt_text(parsed), chunk, tenant.cache_salt)
            n_tokens = parsed.text_chars // 4
            block_size = max(1, self.config.routing.approx_chunk_chars // 4)
        exact = info is not None
        seq = self._seq
        if not dry_run:
            self._seq += 1
        turn = Turn(parsed.model, n_tokens, block_size, hints, hashes, seq, exact)
        tokens = info.tokens if info is not None and keep else ()
        return PromptRead(turn, index_for(exact, self.kv_events), exact, warning, tokens)

    def block_size(self, model: str) -> int:
        return self.block_sizes.get(model, 128)

    def session_tokens(self, session_id: str) -> list[int] | None:
        """The session's last prompt token ids, when exact and kept (for a KV prefetch)."""
        return self.analyzer.session_tokens(session_id)

    def remember(self, session_id: str, tokens: Sequence[int]) -> None:
        """Keep an admitted turn's prompt tokens as its session's (for a KV prefetch)."""
        self.analyzer.remember(session_id, tokens)

    def forget(self, session_id: str) -> None:
        self.analyzer.forget(session_id)

    async def aclose(self) -> None:
        await self.analyzer.aclose()
