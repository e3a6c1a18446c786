"""Retention policies: which offered chunks a tier keeps. Pure: no I/O, no clock, bounded.

A tier calls `select(offer)` with the chunks one store job offers (in prefix order, each with
its KV cache group) and stores only the returned keys; `observe_lookup(key)` tells the policy
a request asked for a chunk.

- `IntervalRetention` (save the prompt-end cache at each turn): every attention chunk of the
  turn's delta is kept; for recurrent-state groups (`state_groups`, e.g. Qwen3-Next's linear
  attention, whose "chunk" is a state checkpoint) only the last checkpoint of the job, i.e.
  the state at the end of the turn, is kept. Parameters: `state_groups`.
- `SelectiveRetention` (Marconi-style): a chunk is kept only once its prefix has been seen a
  second time: a lookup or an earlier offer of the same key counts as a sighting, and the
  offer that brings the count to `min_sightings` (default 2) is admitted. Sightings live in
  an LRU table of at most `capacity` keys. Parameters: `min_sightings`, `capacity`,
  `state_groups` (state checkpoints follow the same last-of-job rule as above).

Formula (selective): keep(k) <=> sightings(k) + 1 >= min_sightings, where sightings counts
lookups and offers of k still in the table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["IntervalRetention", "Offer", "RetentionPolicy", "SelectiveRetention", "make_retention"]


@dataclass(frozen=True)
class Offer:
    key: bytes
    group: int


class RetentionPolicy(Protocol):
    def select(self, offer: Sequence[Offer]) -> list[bytes]: ...
    def observe_lookup(self, key: bytes) -> None: ...


def _last_state_checkpoints(offer: Sequence[Offer], state_groups: frozenset[int]) -> set[bytes]:
    """Keys to drop: every state-group checkpoint except the last one of its group in the job."""
    last: dict[int, bytes] = {}
    for o in offer:
        if o.group in state_groups:
            last[o.group] = o.key
    keep = set(last.values())
    return {o.key for o in offer if o.group in state_groups and o.key not in keep}


@dataclass
class IntervalRetention:
    state_groups: frozenset[int] = frozenset()

    def select(self, offer: Sequence[Offer]) -> list[bytes]:
        dropped = _last_state_checkpoints(offer, self.state_groups)
        return [o.key for o in offer if o.key not in dropped]

    def observe_lookup(self, key: bytes) -> None:
        return None


@dataclass
class SelectiveRetention:
    min_sightings: int = 2
    capacity: int = 100_000
    state_groups: frozenset[int] = frozenset()
    _seen: OrderedDict[bytes, int] = field(default_factory=OrderedDict)

    def _sight(self, key: bytes) -> int:
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return count

    def select(self, offer: Sequence[Offer]) -> list[bytes]:
        dropped = _last_state_checkpoints(offer, self.state_groups)
        kept = []
        for o in offer:
            if self._sight(o.key) >= self.min_sightings and o.key not in dropped:
                kept.append(o.key)
        return kept

    def observe_lookup(self, key: bytes) -> None:
        self._sight(key)

    def sightings(self, key: bytes) -> int:
        return self._seen.get(key, 0)


def make_retention(config: dict[str, Any] | None) -> RetentionPolicy:
    """`{"policy": "interval" | "selective", ...parameters}` -> a policy (default: interval)."""
    config = dict(config or {})
    name = config.pop("policy", "interval")
    state_groups = frozenset(int(g) for g in config.pop("state_groups", ()))
    if name == "interval":
        if config:
            raise ValueError(f"unknown interval retention parameters: {sorted(config)}")
        return IntervalRetention(state_groups=state_groups)
    if name == "selective":
        unknown = set(config) - {"min_sightings", "capacity"}
        if unknown:
            raise ValueError(f"unknown selective retention parameters: {sorted(unknown)}")
        # only min_sightings / capacity (checked above); Any: mypy matches ** against every field
        params: dict[str, Any] = {k: int(v) for k, v in config.items()}
        return SelectiveRetention(state_groups=state_groups, **params)
    raise ValueError(f"unknown retention policy {name!r}; expected 'interval' or 'selective'")


def offers(keys: Iterable[bytes], group_of: Any) -> list[Offer]:
    return [Offer(k, group_of(k)) for k in keys]
