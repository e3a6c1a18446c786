"""The session table: placement and history of each agent session, bounded by capacity and TTL.

A record holds the home engine and pool, turns, last activity, context length, parent and
children, a prefix summary (the last prompt's block hashes, for subagent placement and the
planner) and the last decision with its reasons. ``now`` is always passed in (seconds).

Eviction: a record idle for longer than ``ttl_s`` is gone (checked on access and by ``expire``);
beyond ``capacity`` records the least recently active goes first.

Namespaces (tenants): an id ``"<ns>:<local>"`` whose ``<ns>`` has a quota belongs to that
namespace; a namespace past its quota loses its own least recently active record, so one tenant
never pushes out another's. With quotas, the capacity evicts records of no namespace first (the
quotas sum to at most the capacity, so only they can overflow it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_CHILDREN = 64
MAX_HASHES = 4096


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    home: str | None = None
    pool: str | None = None
    turns: int = 0
    created: float = 0.0
    last_activity: float = 0.0
    context_tokens: int = 0
    cached_tokens_est: int = 0
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    prefix_hashes: list[int] = field(default_factory=list)
    """External block hashes of the last prompt (capped at MAX_HASHES)."""
    expected_gap_s: float | None = None
    """Hinted time until the next turn (tool latency), if any."""
    observed_gaps: list[float] = field(default_factory=list)
    inflight: int = 0
    ended: bool = False
    last_decision: dict[str, Any] | None = None
    model: str | None = None
    """The model of the session's last turn (its prefix hashes are that model's)."""
    first_hash: int | None = None
    """The last prompt's first block hash (``prefix_hashes`` keeps only the last MAX_HASHES):
    a turn that does not start with it shares no prefix with the last one."""
    hashes_exact: bool | None = None
    """Whether ``prefix_hashes`` and ``first_hash`` are exact (None: a record written before the
    kind was kept). A turn whose analysis fell back to approximate hashes leaves exact ones in
    place: the index, the planner and the restart check read them as exact."""

    def add_child(self, child: str) -> None:
        if child not in self.children:
            self.children.append(child)
            del self.children[:-MAX_CHILDREN]

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "home": self.home,
            "pool": self.pool,
            "turns": self.turns,
            "created": self.created,
            "last_activity": self.last_activity,
            "context_tokens": self.context_tokens,
            "cached_tokens_est": self.cached_tokens_est,
            "parent": self.parent,
            "children": list(self.children),
            "prefix_hashes": list(self.prefix_hashes),
            "expected_gap_s": self.expected_gap_s,
            "observed_gaps": list(self.observed_gaps),
            "inflight": self.inflight,
            "ended": self.ended,
            "last_decision": self.last_decision,
            "model": self.model,
            "first_hash": self.first_hash,
            "hashes_exact": self.hashes_exact,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionRecord:
        return cls(**{k: d[k] for k in cls.__slots__ if k in d})

    def record_turn(self, now: float, context_tokens: int, hashes: list[int], exact: bool = True) -> None:
        if self.turns and self.last_activity:
            self.observed_gaps.append(max(0.0, now - self.last_activity))
            del self.observed_gaps[:-16]
        self.turns += 1
        self.last_activity = now
        self.context_tokens = context_tokens
        if self.hashes_exact and not exact:
            return  # an approximate turn does not replace the exact hashes
        self.prefix_hashes = hashes[-MAX_HASHES:] if len(hashes) > MAX_HASHES else list(hashes)
        self.first_hash = hashes[0] if hashes else None
        self.hashes_exact = exact

    def expected_gap(self) -> float | None:
        """The hinted gap, else the median observed gap, else None."""
        if self.expected_gap_s is not None:
            return self.expected_gap_s
        if not self.observed_gaps:
            return None
        s = sorted(self.observed_gaps)
        return s[len(s) // 2]


Mutation = Callable[[SessionRecord | None], SessionRecord | None]
"""A read-modify-write of one session record (None in: none live; None out: write nothing)."""


def hints_only(rec: SessionRecord) -> bool:
    """A record only hints made: ``POST /v1/agent/sessions/{id}/hints`` on a replica that did not
    know the session (no turn placed it: no home)."""
    return rec.home is None and rec.turns == 0 and not rec.ended


def _lend_hints(to: SessionRecord, hinted: SessionRecord) -> SessionRecord:
    if hinted.expected_gap_s is not None:
        to.expected_gap_s = hinted.expected_gap_s
    to.parent = to.parent or hinted.parent
    to.last_activity = max(to.last_activity, hinted.last_activity)
    return to


def reconcile(local: SessionRecord, remote: SessionRecord | None) -> SessionRecord | None:
    """Two copies of a session after an outage or a loss (this replica's, the store's): the
    record to write, or None to leave the store's. The more recently active copy wins, except
    that a copy only hints made never replaces one a turn placed: the placed one is kept, with
    the hints (a hint sent to a replica that missed the session meanwhile would otherwise
    erase its home)."""
    if remote is None:
        return local
    if hints_only(remote) and not hints_only(local):
        return _lend_hints(local, remote)
    if hints_only(local) and not hints_only(remote):
        return _lend_hints(remote, local)
    return None if remote.last_activity > local.last_activity else local


def namespace_of(session_id: str, quotas: Mapping[str, int]) -> str:
    """The namespace of ``session_id`` ("" when it is none with a quota)."""
    ns, sep, _ = session_id.partition(":")
    return ns if sep and ns in quotas else ""


class SessionTable:
    def __init__(
        self, capacity: int = 100_000, ttl_s: float = 3600.0, quotas: Mapping[str, int] | None = None
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.quotas = dict(quotas or {})
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()
        self._buckets: dict[str, OrderedDict[str, None]] = {}
        """With quotas: each namespace's ids, least recently written first ("": no namespace)."""
        self.evicted_quota = 0
        self.evicted_capacity = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._records

    def namespace_count(self, ns: str) -> int:
        return len(self._buckets.get(ns, ()))

    def get(self, session_id: str, now: float) -> SessionRecord | None:
        rec = self._records.get(session_id)
        if rec is None:
            return None
        if now - rec.last_activity > self.ttl_s:
            self._drop(session_id)
            self.expired += 1
            return None
        return rec

    def get_or_create(self, session_id: str, now: float) -> SessionRecord:
        rec = self.get(session_id, now)
        if rec is None:
            rec = SessionRecord(session_id, created=now, last_activity=now)
            self.put(rec)
        return rec

    def put(self, rec: SessionRecord) -> list[SessionRecord]:
        """Insert or refresh; returns the records evicted (the namespace's quota, the capacity)."""
        sid = rec.session_id
        self._records[sid] = rec
        self._records.move_to_end(sid)
        evicted = []
        if self.quotas:
            ns = namespace_of(sid, self.quotas)
            bucket = self._buckets.setdefault(ns, OrderedDict())
            bucket[sid] = None
            bucket.move_to_end(sid)
            limit = self.quotas.get(ns)
            while limit is not None and len(bucket) > limit:
                old, _ = bucket.popitem(last=False)
                evicted.append(self._records.pop(old))
                self.evicted_quota += 1
        while len(self._records) > self.capacity:
            unnamed = self._buckets.get("")
            if unnamed:
                old, _ = unnamed.popitem(last=False)
                evicted.append(self._records.pop(old))
            else:
                _, first = self._records.popitem(last=False)
                self._unbucket(first.session_id)
                evicted.append(first)
            self.evicted_capacity += 1
        return evicted

    def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None:
        """Read-modify-write one record: ``fn`` gets it (None: none live) and returns what to
        store (None: nothing); returns what was stored."""
        rec = fn(self.get(session_id, now))
        if rec is not None:
            self.put(rec)
        return rec

    def touch(self, session_id: str) -> None:
        if session_id in self._records:
            self._records.move_to_end(session_id)

    def remove(self, session_id: str) -> SessionRecord | None:
        return self._drop(session_id)

    def expire(self, now: float) -> list[SessionRecord]:
        """Drop every record idle for longer than the TTL (oldest first; stops at the first fresh
        one since the order is by last activity)."""
        gone = []
        while self._records:
            sid, rec = next(iter(self._records.items()))
            if now - rec.last_activity <= self.ttl_s:
                break
            self._drop(sid)
            gone.append(rec)
        self.expired += len(gone)
        return gone

    def _drop(self, session_id: str) -> SessionRecord | None:
        rec = self._records.pop(session_id, None)
        if rec is not None:
            self._unbucket(session_id)
        return rec

    def _unbucket(self, session_id: str) -> None:
        if self.quotas:
            bucket = self._buckets.get(namespace_of(session_id, self.quotas))
            if bucket is not None:
                bucket.pop(session_id, None)
