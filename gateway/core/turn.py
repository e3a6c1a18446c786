"""The turn pipeline: one request of an agent session, from what is known about it to a routing
input, and from a decision and an outcome to the session record. Pure: the caller passes the
clock, the records and the prefix matches in.

The gateway service (``gateway/service/turns.py``) and the simulator (``gateway/sim/cluster.py``)
both run a turn as::

    req, snap = prepare(turn, record, parent, matches, parent_matches, engines, siblings)
    decision = router.route(req, snap)
    record = place(record, decision, turn, now)         # and adopt(parent, child) for a subagent
    siblings.add(parent, decision.engine)
    ... the engine serves the turn ...
    record = settle(record, decision.engine, served_on, ok, now, turn)
    siblings.remove(parent, decision.engine)

so what the simulator measures is what the gateway runs. Which prefix index a turn is matched
against is :func:`index_for`: exact block hashes go to the index fed by the engines' KV events,
anything else to the approximate index fed by the routing decisions themselves.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.core.hints import AgentHints
from gateway.core.sessions import MAX_HASHES, SessionRecord
from gateway.core.types import Decision, EngineView, PrefixMatch, RouteRequest, SessionView, Snapshot

__all__ = [
    "HomeLedger",
    "IndexKind",
    "Siblings",
    "Turn",
    "adopt",
    "approx_hashes",
    "decision_dict",
    "index_for",
    "owner_decision",
    "place",
    "prepare",
    "restarts",
    "settle",
]


class IndexKind(StrEnum):
    PRECISE = "precise"
    """Exact vLLM block hashes, matched against the index fed by KV events."""
    APPROX = "approx"
    """Hashes of text chunks (or of exact blocks with no KV events), fed by routing decisions."""


def index_for(exact: bool, kv_events: bool) -> IndexKind:
    """Exact hashes are matched against what the engines say they hold, when they say it;
    otherwise the gateway can only remember where it sent each prefix."""
    return IndexKind.PRECISE if exact and kv_events else IndexKind.APPROX


def approx_hashes(text: str, chunk_chars: int, salt: str | None = None) -> list[int]:
    """A hash chain over fixed-size chunks of the prompt text (a partial last chunk is not
    hashed): ``d_i = BLAKE2b-64(d_{i-1} + utf8(chunk_i))``, ``d_{-1} = b""``, each hash
    ``d_i`` read big-endian. Stable across processes and replicas (not Python's per-process
    ``hash``), so records shared through Redis mean the same thing on every replica.

    ``salt`` (a tenant's prefix-cache salt) starts the chain at ``d_{-1} = BLAKE2b-64(salt)``,
    as vLLM's ``cache_salt`` enters its first block hash: the same text under two salts shares
    no hash, so one tenant's matches never reveal what another sent.

    One pass: an ASCII text (characters = bytes) is encoded once and hashed through memoryview
    slices; the digests are read as integers in one ``struct`` call at the end."""
    n = (len(text) // chunk_chars) * chunk_chars  # chunks by characters, as the token estimate
    if n == 0:
        return []
    b2 = hashlib.blake2b
    digests: list[bytes] = []
    push = digests.append
    prev = b"" if salt is None else b2(b"agentgw-approx-salt\0" + salt.encode(), digest_size=8).digest()
    if text.isascii():
        data = memoryview(text.encode("ascii"))
        for i in range(0, n, chunk_chars):
            h = b2(prev, digest_size=8)
            h.update(data[i : i + chunk_chars])
            prev = h.digest()
            push(prev)
    else:
        for i in range(0, n, chunk_chars):
            prev = b2(
                prev + text[i : i + chunk_chars].encode("utf-8", "surrogatepass"), digest_size=8
            ).digest()
            push(prev)
    return list(struct.unpack(f">{len(digests)}Q", b"".join(digests)))


@dataclass(frozen=True, slots=True)
class Turn:
    """What the pipeline knows about one request before routing it."""

    model: str
    prompt_tokens: int
    block_size: int
    hints: AgentHints
    hashes: Sequence[int]
    """The prompt's block hashes (exact or approximate, see :func:`index_for`)."""
    seq: int = 0
    exact: bool = True
    """Whether ``hashes`` are exact (the model's tokens) or approximate (its text: the analysis
    fell back, e.g. it could not finish in time under load). The two kinds never compare."""


def restarts(record: SessionRecord | None, turn: Turn) -> bool:
    """Whether ``turn`` restarts its session: the session has a completed turn of the same model
    and the new prompt shares no block with that turn's prompt (a client that reuses a session id
    for an unrelated conversation). A restarted session is placed as a new one: no home, no
    turns, no history. Prompts shorter than a block say nothing (no hashes on either side)."""
    if record is None or record.ended or record.turns == 0 or not turn.hashes:
        return False
    if record.model is not None and record.model != turn.model:
        return False  # another model's hashes are not comparable
    if record.hashes_exact is not None and record.hashes_exact != turn.exact:
        return False  # exact against approximate hashes: equal prompts would differ
    first = record.first_hash
    if first is None and 0 < len(record.prefix_hashes) < MAX_HASHES:
        first = record.prefix_hashes[0]  # a record written before first_hash, not truncated
    return first is not None and turn.hashes[0] != first


def prepare(
    turn: Turn,
    record: SessionRecord | None,
    parent: SessionRecord | None,
    matches: dict[str, PrefixMatch],
    parent_matches: dict[str, PrefixMatch],
    engines: tuple[EngineView, ...],
    siblings: dict[str, int],
) -> tuple[RouteRequest, Snapshot]:
    """The router's input for a turn. ``record`` is the session's record (None for a new or
    session-less turn; an ended record counts as none), ``parent`` the parent session's."""
    h = turn.hints
    sid = h.session_id
    if record is not None and (record.ended or restarts(record, turn)):
        record = None
    view = None
    if sid is not None:
        view = SessionView(
            session_id=sid,
            home=record.home if record else None,
            pool=record.pool if record else None,
            turns=record.turns if record else 0,
            context_tokens=record.context_tokens if record else 0,
            parent_home=parent.home if parent is not None else None,
        )
    req = RouteRequest(
        model=turn.model,
        prompt_tokens=turn.prompt_tokens,
        block_size=turn.block_size,
        session_id=sid,
        parent_session_id=h.parent_session_id,
        is_subagent=h.is_subagent,
        fan_out=h.fan_out or 0,
        interactive=h.interactive,
        priority=h.priority,
        seq=turn.seq,
    )
    snap = Snapshot(
        engines=engines,
        matches=matches,
        session=view,
        parent_matches=parent_matches,
        siblings=siblings,
    )
    return req, snap


def owner_decision(req: RouteRequest, snap: Snapshot, engine: str, profile: str) -> Decision | None:
    """A turn that only ``engine`` can serve (it holds state the turn continues, e.g. a stored
    response): that engine if it is healthy and serves the model, else None. A constraint, not
    a score: no other engine would answer correctly."""
    for e in snap.engines:
        if e.name == engine and e.healthy and req.model in e.models:
            match = snap.matches.get(engine)
            cached = min(req.prompt_tokens, match.blocks * req.block_size) if match else 0
            return Decision(engine, e.pool, "owner", profile, cached, req.prompt_tokens - cached)
    return None


def decision_dict(d: Decision) -> dict[str, Any]:
    """A decision with its explanation, as stored in the session record and shown by the API."""
    return {
        "engine": d.engine,
        "pool": d.pool,
        "reason": d.reason,
        "profile": d.profile,
        "cached_tokens_est": d.cached_tokens,
        "uncached_tokens_est": d.uncached_tokens,
        "candidates": [
            {"engine": c.engine, "pool": c.pool, "total": round(c.total, 6), "scores": c.scores}
            for c in d.candidates
        ],
        "fallbacks": list(d.fallbacks),
        "predicted_ttft_ms": d.predicted_ttft_ms,
        "predicted_tok_s": d.predicted_tok_s,
    }


def predicted_misses(d: Decision, ttft_ms: float, tok_s: float) -> tuple[str, ...]:
    """The SLO bounds the decision is predicted to miss: ``ttft`` (predicted TTFT past
    ``ttft_ms``) and ``tok_s`` (predicted decode speed under ``tok_s``; 0: no bound). A
    profile that predicts nothing misses nothing."""
    out = []
    if d.predicted_ttft_ms is not None and d.predicted_ttft_ms > ttft_ms:
        out.append("ttft")
    if d.predicted_tok_s is not None and tok_s > 0 and d.predicted_tok_s < tok_s:
        out.append("tok_s")
    return tuple(out)


def place(record: SessionRecord | None, decision: Decision, turn: Turn, now: float) -> SessionRecord:
    """The session's record once the turn is placed: its new home, one more turn in flight."""
    h = turn.hints
    assert h.session_id is not None, "place() is for session turns"
    if record is None or record.ended or restarts(record, turn):
        record = SessionRecord(h.session_id, created=now, last_activity=now)
    record.home, record.pool = decision.engine, decision.pool
    record.model = turn.model
    record.parent = h.parent_session_id or record.parent
    record.inflight += 1
    record.cached_tokens_est = decision.cached_tokens
    if h.expected_tool_latency_ms is not None:
        record.expected_gap_s = h.expected_tool_latency_ms / 1000
    record.last_decision = decision_dict(decision)
    return record


def adopt(parent: SessionRecord | None, child: str) -> SessionRecord | None:
    """The parent's record with ``child`` among its children (None: nothing to write)."""
    if parent is None or child in parent.children:
        return None
    parent.add_child(child)
    return parent


def settle(
    record: SessionRecord | None,
    planned: str,
    served_on: str | None,
    ok: bool,
    now: float,
    turn: Turn,
) -> SessionRecord | None:
    """The session's record once the turn is over. ``served_on`` is the engine that answered
    (None: no engine did); a retry on another engine moves the home unless a newer placement
    already did. Only a successful turn counts in the history."""
    if record is None:
        return None
    record.inflight = max(0, record.inflight - 1)
    if served_on is not None and served_on != planned and record.home == planned:
        record.home = served_on
    if ok:
        record.record_turn(now, turn.prompt_tokens, list(turn.hashes), turn.exact)
    return record


class Siblings:
    """In-flight requests of each parent's subagents, per engine (for spreading a fan-out).
    Bounded: beyond ``max_parents`` parents the oldest entry is dropped."""

    def __init__(self, max_parents: int = 10_000) -> None:
        self.max_parents = max_parents
        self._by_parent: dict[str, Counter[str]] = {}

    def __len__(self) -> int:
        return len(self._by_parent)

    def view(self, parent: str | None) -> dict[str, int]:
        if parent is None:
            return {}
        c = self._by_parent.get(parent)
        return dict(c) if c else {}

    def add(self, parent: str, engine: str) -> None:
        self._by_parent.setdefault(parent, Counter())[engine] += 1
        if len(self._by_parent) > self.max_parents:
            self._by_parent.pop(next(iter(self._by_parent)))

    def remove(self, parent: str, engine: str) -> None:
        c = self._by_parent.get(parent)
        if c is None:
            return
        c[engine] -= 1
        if c[engine] <= 0:
            del c[engine]
        if not c:
            del self._by_parent[parent]


@dataclass(slots=True)
class _Home:
    engine: str
    tokens: int
    last: float
    inflight: int
    next_at: float | None = None
    """When the session's next turn is expected (its last turn's end + the expected gap)."""
    growth: int = 0
    """How much its context grew at its last turn (the growth to expect of the next one)."""


#: How many typical turn windows a turn in flight is projected to hold its KV (its output length
#: is unknown until it ends; AgentX outputs are lognormal around 444 tokens, p90 ~3x the median).
INFLIGHT_WINDOWS = 3


class HomeLedger:
    """Context tokens of the live sessions homed on each engine (``EngineView.homed_tokens``, the
    ``home_load`` scorer's input): a session is live while it has a turn in flight or had one in
    the last ``live_s`` seconds. Totals are kept incrementally (O(1) per turn; expiry is lazy,
    oldest first). Bounded: beyond ``capacity`` sessions the least recently active is dropped.
    Per gateway replica: each counts the turns it placed."""

    def __init__(self, live_s: float = 30.0, capacity: int = 100_000) -> None:
        self.live_s = live_s
        self.capacity = capacity
        self._homes: OrderedDict[str, _Home] = OrderedDict()
        self._tokens: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._homes)

    def placed(self, session_id: str, engine: str, now: float) -> None:
        h = self._homes.pop(session_id, None)
        if h is None:
            h = _Home(engine, 0, now, 0)
        else:
            self._tokens[h.engine] -= h.tokens
            h.engine = engine
        h.inflight += 1
        h.last = now
        self._tokens[engine] += h.tokens
        self._homes[session_id] = h
        while len(self._homes) > self.capacity:
            self._drop(next(iter(self._homes)))

    def settled(
        self, session_id: str, engine: str, context_tokens: int, now: float, gap_s: float | None = None
    ) -> None:
        """The session's turn on ``engine`` is over; ``gap_s``: when its next turn is expected."""
        h = self._homes.pop(session_id, None)
        if h is None:
            return
        self._tokens[h.engine] -= h.tokens
        h.growth = max(0, context_tokens - h.tokens) if h.tokens > 0 else 0
        h.engine, h.tokens, h.last, h.inflight = engine, context_tokens, now, max(0, h.inflight - 1)
        h.next_at = now + gap_s if gap_s is not None else None
        self._tokens[engine] += context_tokens
        self._homes[session_id] = h

    def next_tokens(self, session_id: str) -> int:
        """The session's expected next context: its last plus its last growth (0: unknown)."""
        h = self._homes.get(session_id)
        return h.tokens + h.growth if h is not None else 0

    def expect(self, session_id: str, next_at: float) -> None:
        """The session's next turn is expected at ``next_at`` (the planner's gap estimate)."""
        h = self._homes.get(session_id)
        if h is not None:
            h.next_at = next_at

    def expected_at(self, at: float, window_s: float, exclude: str | None = None) -> dict[str, int]:
        """Per engine, the context tokens of the sessions homed there whose turns are expected to
        hold KV in ``[at, at + window_s]``: an idle session's next turn from its ``next_at`` for
        ``window_s`` (unknown: not counted); a turn in flight (placed at ``last``), whose output is
        not known yet, until ``last + INFLIGHT_WINDOWS * window_s`` (a long answer decodes for
        several typical turns). ``exclude``: a session to leave out (the one being planned).
        O(sessions)."""
        out: dict[str, int] = {}
        for sid, h in self._homes.items():
            if sid == exclude or h.tokens <= 0:
                continue
            if h.inflight > 0:
                start, end = h.last, h.last + INFLIGHT_WINDOWS * window_s
            elif h.next_at is not None:
                start, end = h.next_at, h.next_at + window_s
            else:
                continue
            if start <= at + window_s and end >= at:
                out[h.engine] = out.get(h.engine, 0) + h.tokens
        return out

    def ended(self, session_id: str) -> None:
        if session_id in self._homes:
            self._drop(session_id)

    def on_engine(self, engine: str) -> list[str]:
        """The sessions homed on ``engine`` (live or not yet expired), oldest activity first."""
        return [sid for sid, h in self._homes.items() if h.engine == engine]

    def moved(self, session_id: str, engine: str) -> None:
        """The session was re-homed on ``engine`` between turns (its tokens go with it)."""
        h = self._homes.get(session_id)
        if h is None or h.engine == engine:
            return
        self._tokens[h.engine] -= h.tokens
        if self._tokens[h.engine] <= 0:
            del self._tokens[h.engine]
        h.engine = engine
        self._tokens[engine] += h.tokens

    def homed(self, now: float) -> Counter[str]:
        """Tokens homed per engine now (read-only for the caller)."""
        horizon = now - self.live_s
        for _ in range(len(self._homes)):
            sid, h = next(iter(self._homes.items()))
            if h.last >= horizon:
                break
            if h.inflight > 0:
                self._homes.move_to_end(sid)  # stale but busy: still live
                continue
            self._drop(sid)
        return self._tokens

    def _drop(self, session_id: str) -> None:
        h = self._homes.pop(session_id)
        self._tokens[h.engine] -= h.tokens
        if self._tokens[h.engine] <= 0:
            del self._tokens[h.engine]
