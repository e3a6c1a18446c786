"""The gateway's own account of each engine's load, by phase: what the cost split and the role
controller read as ``EngineView.decoding`` and ``EngineView.prefill_backlog_tokens``.

A request the gateway sends to an engine is *prefilling* from the moment it is sent until its
first response body byte arrives (for a streamed answer the first token; for a non-streamed one
the whole answer, so it counts as prefilling while it decodes and as decoding only while it is
relayed), then *decoding* until it finishes. While it
prefills, its uncached prompt tokens (the routing decision's ``uncached_tokens``) count in the
engine's prefill backlog; from sending to finishing, its whole prompt counts in the engine's
in-flight tokens (the KV it holds or will hold once admitted). Callers hold one :class:`Ticket`
per request and report its phase changes; the ledger keeps four counters per engine (bounded by
the engine list), and every change is idempotent per ticket (a second ``finished`` changes
nothing).

:func:`merge` folds the ledger into an engine view. The engine's scraped ``running`` count (all
replicas' requests, late by one scrape) bounds decoding from below: ``decoding = max(own
decoding, running - own prefilling)``; the backlog is the gateway's own (an engine's metrics
count waiting requests, not their tokens), and so are the in-flight tokens (``inflight_tokens``:
they lead the scraped KV usage, which only shows a request once the engine admits it and only
at the next scrape). The simulator calls the same ledger and merge when it
replays what a gateway would see (``SimConfig.load_view="gateway"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from gateway.core.types import EngineView

__all__ = ["EngineCounts", "InflightLoad", "Ticket", "merge"]

_PREFILL, _DECODE, _DONE = 0, 1, 2


@dataclass(slots=True)
class EngineCounts:
    prefilling: int = 0
    """Requests sent whose first byte has not arrived."""
    backlog_tokens: int = 0
    """Their uncached prompt tokens."""
    decoding: int = 0
    """Requests past their first byte, not finished."""
    tokens: int = 0
    """Prompt tokens of every request sent and not finished."""


@dataclass(slots=True)
class Ticket:
    """One request's place in the ledger (held by the caller)."""

    engine: str
    uncached_tokens: int
    prompt_tokens: int = 0
    phase: int = _PREFILL

    @property
    def prefilling(self) -> bool:
        return self.phase == _PREFILL


class InflightLoad:
    def __init__(self, engines: Iterable[str]) -> None:
        self.counts: dict[str, EngineCounts] = {name: EngineCounts() for name in engines}

    def sent(self, engine: str, uncached_tokens: int, prompt_tokens: int = 0) -> Ticket:
        """A request went to ``engine``: ``uncached_tokens`` to prefill, ``prompt_tokens`` in all
        (at least the uncached ones)."""
        uncached = max(0, uncached_tokens)
        t = Ticket(engine, uncached, max(uncached, prompt_tokens))
        c = self.counts.get(engine)
        if c is None:  # not a configured engine: nothing to account
            t.phase = _DONE
            return t
        c.prefilling += 1
        c.backlog_tokens += t.uncached_tokens
        c.tokens += t.prompt_tokens
        return t

    def first_byte(self, t: Ticket, decoding: bool = True) -> bool:
        """The request's first byte arrived; ``decoding=False`` when it is also the last (a
        non-streamed answer). Returns whether anything changed."""
        if t.phase != _PREFILL:
            return False
        c = self.counts.get(t.engine)
        if c is None:  # the engine left the configuration meanwhile
            t.phase = _DONE
            return False
        c.prefilling -= 1
        c.backlog_tokens -= t.uncached_tokens
        if decoding:
            c.decoding += 1
            t.phase = _DECODE
        else:
            c.tokens -= t.prompt_tokens
            t.phase = _DONE
        return True

    def finished(self, t: Ticket) -> bool:
        """The request is over (answered, failed or abandoned). Returns whether anything changed."""
        if t.phase == _PREFILL:
            self.first_byte(t, decoding=False)
            return True
        if t.phase == _DECODE:
            c = self.counts.get(t.engine)
            t.phase = _DONE
            if c is None:  # the engine left the configuration meanwhile
                return False
            c.decoding -= 1
            c.tokens -= t.prompt_tokens
            return True
        return False

    def of(self, engine: str) -> EngineCounts:
        return self.counts.get(engine) or EngineCounts()


def merge(view: EngineView, own: EngineCounts) -> EngineView:
    """``view`` with the load fields the cost split reads, from the ledger and the scrape."""
    decoding = max(own.decoding, view.running - own.prefilling, 0)
    if (
        decoding == view.decoding
        and own.backlog_tokens == view.prefill_backlog_tokens
        and own.tokens == view.inflight_tokens
    ):
        return view
    return replace(
        view, decoding=decoding, prefill_backlog_tokens=own.backlog_tokens, inflight_tokens=own.tokens
    )
