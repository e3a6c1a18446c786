"""The three narrow protocols every routing policy implements, and the composed profile.

A profile is: filters (each narrows the engine list) -> weighted scorers (each maps an engine to a
score in [0, 1]) -> a picker (chooses one candidate and names the reason). Scoring reads the
snapshot and never mutates anything; state that feeds it (prefix indexes, sessions) is updated
elsewhere, by events and outcomes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.core.types import Candidate, EngineView, RouteRequest, Snapshot


class Filter(Protocol):
    @property
    def name(self) -> str: ...

    def filter(
        self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]
    ) -> Sequence[EngineView]: ...


class Scorer(Protocol):
    """Scores every candidate at once (some scores are relative to the others), each in [0, 1]."""

    @property
    def name(self) -> str: ...

    def score(self, req: RouteRequest, snap: Snapshot, engines: Sequence[EngineView]) -> Sequence[float]: ...


@dataclass(frozen=True, slots=True)
class Pick:
    candidate: Candidate
    reason: str
    ttft_s: float | None = None
    """The picker's predicted TTFT of the turn on the chosen engine (None: it predicts none)."""
    tok_s: float | None = None
    """The picker's predicted decode speed of the turn there (tokens/s)."""


class Picker(Protocol):
    @property
    def name(self) -> str: ...

    def pick(self, req: RouteRequest, snap: Snapshot, candidates: Sequence[Candidate]) -> Pick: ...


@dataclass(frozen=True, slots=True)
class Weighted:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[Weighted, ...]
    picker: Picker


def stable_hash(text: str) -> int:
    """A process-independent 64-bit FNV-1a hash (Python's ``hash`` is salted per process)."""
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h
