"""Workload traces -> plays of dependent requests with chained block hashes.

A *play* is one recorded agent session (one Weka file): a root stream of turns and, for each
subagent, a child stream. Every request carries its dependencies, so a replay can keep the
recorded gaps while the served latencies change:

- within a stream, turn k waits for turn k-1 to complete, then for the recorded gap
  ``max(0, t_k - (t_{k-1} + api_time_{k-1}))`` (the tool / think time);
- a subagent's first request is spawned by the last root request before it in file order: on that
  request's *dispatch* plus ``t_first - t_parent`` when it started while the parent was still
  running, else on its *completion* plus ``t_first - end(parent)``;
- the first root request that starts after a subagent ended (by the recorded times) also waits
  for the subagent's last request to complete (a join).

These are the rules of Dynamo's Weka importer (``lib/data-gen/src/weka.rs``), minus its chain
splitting. Subagent timestamps are relative to the parent entry's ``t`` unless already absolute.

Block hashes: trace hash ids name 64-token blocks within one file (one namespace per file, shared
by its subagents). :class:`HashChainer` maps a sequence of ids to chained integers, so equal
prefixes within a file give equal hashes and files never collide: what a vLLM block-hash chain
gives a real engine. A partial last block has no id and is never reused.

Loaders: :func:`load_weka` (a folder or a file), :func:`load_mooncake` (jsonl, 512-token blocks,
global scope, one open-loop request per line) and :func:`synth_agentx` (AgentX-shaped plays whose
statistics are parameters).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.core.block_hash import common_prefix_len

__all__ = [
    "AgentxShape",
    "Dep",
    "HashChainer",
    "Play",
    "TraceRequest",
    "ideal_hit_rate",
    "load_mooncake",
    "load_weka",
    "synth_agentx",
    "trace_stats",
]

COMPLETION = "completion"
DISPATCH = "dispatch"
JOIN_EPS_S = 1e-6


@dataclass(frozen=True, slots=True)
class Dep:
    """Request ``on`` (an index in the play) must reach ``trigger``; then wait ``delay_s``."""

    on: int
    trigger: str
    delay_s: float


@dataclass(slots=True)
class TraceRequest:
    idx: int
    """Position in ``Play.requests``."""
    stream: str
    """``root`` or the subagent's id."""
    t: float
    """Recorded start, seconds from the play's start (absolute for subagents too)."""
    input_tokens: int
    output_tokens: int
    hashes: list[int]
    """Chained block hashes of the prompt's full blocks."""
    api_time: float = 0.0
    model: str = ""
    deps: list[Dep] = field(default_factory=list)
    gap_s: float = 0.0
    """The recorded think / tool time before this request (the hint ``expected_tool_latency``)."""

    @property
    def end(self) -> float:
        return self.t + self.api_time


@dataclass(slots=True)
class Play:
    play_id: str
    block_size: int
    requests: list[TraceRequest]
    subagents: dict[str, int] = field(default_factory=dict)
    """Subagent stream id -> fan-out of its spawn (how many subagents share the same parent turn)."""
    start_s: float = 0.0
    """For open-loop traces (Mooncake): the recorded arrival of the play."""

    def session_id(self, stream: str) -> str:
        return self.play_id if stream == "root" else f"{self.play_id}#{stream}"


class HashChainer:
    """Maps a block-id sequence to chained ints: ``h_i = intern((h_{i-1}, id_i))``. Interning (not
    hashing) makes the result collision free and small; a per-stream memo of the previous request
    makes a turn cost O(new blocks)."""

    def __init__(self) -> None:
        self._table: dict[tuple[int, int], int] = {}
        self._next = 1
        self._memo: dict[object, tuple[list[int], list[int]]] = {}

    def root(self, namespace: str) -> int:
        return self._intern(0, hash(("ns", namespace)) & ((1 << 62) - 1))

    def _intern(self, parent: int, block_id: int) -> int:
        key = (parent, block_id)
        h = self._table.get(key)
        if h is None:
            h = self._table[key] = self._next
            self._next += 1
        return h

    def chain(self, root: int, ids: Sequence[int], memo_key: object = None) -> list[int]:
        keep, out = 0, []
        if memo_key is not None and memo_key in self._memo:
            prev_ids, prev_hashes = self._memo[memo_key]
            keep = common_prefix_len(prev_ids, ids)
            out = prev_hashes[:keep]
        parent = out[-1] if out else root
        table, intern = self._table, self._intern
        for b in ids[keep:]:
            h = table.get((parent, b))
            parent = h if h is not None else intern(parent, b)
            out.append(parent)
        if memo_key is not None:
            self._memo[memo_key] = (list(ids), out)
        return out


#: The hash-id namespace of every file whose ``hash_id_scope`` is ``global`` (written by
#: :mod:`gateway.sim.synth`: the plays share a system prompt, so equal ids across files are
#: equal blocks).
GLOBAL_SCOPE = "global"


def _weka_requests(
    d: dict[str, Any], chainer: HashChainer, ns: str
) -> tuple[list[TraceRequest], dict[str, int]]:
    root = chainer.root(GLOBAL_SCOPE if d.get("hash_id_scope") == GLOBAL_SCOPE else ns)
    reqs: list[TraceRequest] = []
    last_root: int | None = None  # index of the last root request so far (file order)
    pending_joins: list[tuple[float, int]] = []  # (subagent end, its last request)
    prev_in_stream: dict[str, int] = {}
    fan: dict[int | None, list[str]] = {}
    subagents: dict[str, int] = {}

    def add(stream: str, x: dict[str, Any], t: float) -> TraceRequest:
        r = TraceRequest(
            idx=len(reqs),
            stream=stream,
            t=t,
            input_tokens=int(x["in"]),
            output_tokens=max(1, int(x["out"])),
            hashes=chainer.chain(root, x.get("hash_ids") or [], memo_key=(ns, stream)),
            api_time=float(x.get("api_time") or 0.0),
            model=x.get("model", ""),
        )
        p = prev_in_stream.get(stream)
        if p is not None:
            r.gap_s = max(0.0, t - reqs[p].end)
            r.deps.append(Dep(p, COMPLETION, r.gap_s))
        prev_in_stream[stream] = r.idx
        reqs.append(r)
        return r

    for entry in d["requests"]:
        if entry["type"] != "subagent":
            r = add("root", entry, float(entry["t"]))
            still = []
            for end, last in pending_joins:
                if r.t + JOIN_EPS_S >= end:
                    r.deps.append(Dep(last, COMPLETION, 0.0))
                else:
                    still.append((end, last))
            pending_joins = still
            last_root = r.idx
            continue
        sid = str(entry.get("agent_id") or f"sub{len(subagents)}")
        while sid in subagents:
            sid += "'"
        subagents[sid] = 0
        fan.setdefault(last_root, []).append(sid)
        t0 = float(entry["t"])
        first: TraceRequest | None = None
        for x in entry["requests"]:
            t = float(x["t"])
            if t + JOIN_EPS_S < t0:
                t += t0  # relative to the parent entry
            r = add(sid, x, t)
            if first is None:
                first = r
                if last_root is not None:
                    parent = reqs[last_root]
                    if r.t < parent.end:
                        r.deps.append(Dep(parent.idx, DISPATCH, max(0.0, r.t - parent.t)))
                    else:
                        r.deps.append(Dep(parent.idx, COMPLETION, max(0.0, r.t - parent.end)))
                    r.gap_s = r.deps[-1].delay_s
        if first is not None:
            last_req = reqs[-1]
            pending_joins.append((max(q.end for q in reqs[first.idx :]), last_req.idx))
    for sids in fan.values():
        for s in sids:
            subagents[s] = len(sids)
    return reqs, subagents


def load_weka(path: str | Path, chainer: HashChainer | None = None) -> list[Play]:
    """Load one Weka/AgentX JSON file or every ``*.json`` of a folder (sorted by name). Hash ids
    name blocks within their file (``hash_id_scope`` ``local``, the Weka traces) or across every
    file of scope ``global``."""
    p = Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    chainer = chainer or HashChainer()
    plays = []
    for f in files:
        d = json.loads(f.read_text())
        if "requests" not in d:
            continue
        play_id = str(d.get("id") or f.stem)
        reqs, subs = _weka_requests(d, chainer, play_id)
        plays.append(Play(play_id, int(d.get("block_size", 64)), reqs, subs))
    return plays


def load_mooncake(path: str | Path, block_size: int = 512, limit: int | None = None) -> list[Play]:
    """Mooncake jsonl: one play per request (no session ids), arrival ``timestamp`` ms, global
    hash scope (ids chained from one shared root)."""
    chainer = HashChainer()
    root = chainer.root("mooncake")
    plays = []
    with open(path) as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            x = json.loads(line)
            r = TraceRequest(
                idx=0,
                stream="root",
                t=0.0,
                input_tokens=int(x["input_length"]),
                output_tokens=max(1, int(x["output_length"])),
                hashes=chainer.chain(root, x.get("hash_ids") or []),
            )
            plays.append(Play(f"mc{i}", block_size, [r], start_s=float(x["timestamp"]) / 1000.0))
    return plays


@dataclass(frozen=True, slots=True)
class AgentxShape:
    """Statistics of an AgentX-like workload; defaults are the published AgentX figures."""

    turns_median: int = 43
    input_median: int = 142_000
    """Median input tokens per request (the context grows roughly linearly to ~2x this)."""
    first_input: int = 16_000
    """System prompt + tools + first user message."""
    output_median: int = 444
    gap_median_s: float = 10.0
    api_time_s: float = 6.5
    subagent_share: float = 0.44
    rollouts_median: int = 4
    subagent_turns_median: int = 12
    subagent_first_input: int = 9_000
    system_tokens: int = 4_000
    """Shared across plays (same agent harness): the same first blocks in every play."""
    block_size: int = 64


def _lognormal(rng: random.Random, median: float, sigma: float = 0.6) -> float:
    return median * rng.lognormvariate(0.0, sigma)


def synth_agentx(n_plays: int, seed: int = 0, shape: AgentxShape | None = None) -> list[Play]:
    """AgentX-shaped plays: each turn appends the last output and a tool result to the context;
    44% of plays spawn a fan-out of subagents (median 4) that start from the parent's system
    prompt. Deterministic in ``seed``."""
    s = shape or AgentxShape()
    rng = random.Random(seed)
    chainer = HashChainer()
    bs = s.block_size
    plays = []
    system_ids = list(range(1, s.system_tokens // bs + 1))
    for p in range(n_plays):
        pid = f"synth{p:04d}"
        root = chainer.root("synth")  # one namespace: the system prompt is shared across plays
        next_id = [1_000_000 * (p + 1)]

        def fresh(n: int, _next: list[int] = next_id) -> list[int]:
            out = list(range(_next[0], _next[0] + n))
            _next[0] += n
            return out

        turns = max(2, round(_lognormal(rng, s.turns_median, 0.5)))
        target_final = max(s.first_input * 2, _lognormal(rng, 2 * s.input_median, 0.4))
        growth = (target_final - s.first_input) / max(1, turns - 1)
        reqs: list[TraceRequest] = []
        ids = system_ids + fresh(max(1, (s.first_input - s.system_tokens) // bs))
        tokens = s.first_input
        t = 0.0
        subagents: dict[str, int] = {}
        spawn_turn = rng.randrange(1, turns) if rng.random() < s.subagent_share else -1
        joins: list[Dep] = []
        for k in range(turns):
            if k:
                add = max(bs, round(_lognormal(rng, growth, 0.8)))
                tokens += add
                ids = ids + fresh(add // bs)
            out = max(1, round(_lognormal(rng, s.output_median, 0.9)))
            r = TraceRequest(len(reqs), "root", t, tokens, out, chainer.chain(root, ids), s.api_time_s)
            if reqs:
                prev_root = max(q.idx for q in reqs if q.stream == "root")
                r.gap_s = max(0.0, t - reqs[prev_root].end)
                r.deps.append(Dep(prev_root, COMPLETION, r.gap_s))
            r.deps.extend(joins)
            joins = []
            reqs.append(r)
            t = r.end
            if k == spawn_turn:
                n_sub = max(1, round(_lognormal(rng, s.rollouts_median, 0.5)))
                for j in range(n_sub):
                    sid = f"agent_{j:03d}"
                    subagents[sid] = n_sub
                    sub_ids = system_ids + fresh(max(1, (s.subagent_first_input - s.system_tokens) // bs))
                    sub_tokens = s.subagent_first_input
                    st = r.end + 1.0
                    prev: TraceRequest | None = None
                    for q in range(max(1, round(_lognormal(rng, s.subagent_turns_median, 0.5)))):
                        if q:
                            add = max(bs, round(_lognormal(rng, 2_000, 0.8)))
                            sub_tokens += add
                            sub_ids = sub_ids + fresh(add // bs)
                        out = max(1, round(_lognormal(rng, s.output_median, 0.9)))
                        sr = TraceRequest(
                            len(reqs),
                            sid,
                            st,
                            sub_tokens,
                            out,
                            chainer.chain(root, sub_ids),
                            s.api_time_s / 2,
                        )
                        pred, trig = (r.idx, 1.0) if prev is None else (prev.idx, max(0.0, st - prev.end))
                        sr.gap_s = trig
                        sr.deps.append(Dep(pred, COMPLETION, trig))
                        reqs.append(sr)
                        prev = sr
                        st = sr.end + _lognormal(rng, s.gap_median_s / 2)
                    assert prev is not None
                    joins.append(Dep(prev.idx, COMPLETION, 0.0))
                    t = max(t, prev.end)
            t += _lognormal(rng, s.gap_median_s)
        plays.append(Play(pid, bs, reqs, subagents))
    return plays


def ideal_hit_rate(plays: Iterable[Play], order: str = "time") -> tuple[int, int]:
    """(hit tokens, input tokens) with an infinite cache per play namespace: a request hits the
    longest prefix of its block chain seen before it (by recorded start time). A partial last
    block is never a hit (it has no hash)."""
    hit = total = 0
    for play in plays:
        seen: set[int] = set()
        order_ = sorted(play.requests, key=lambda r: (r.t, r.stream != "root", r.idx))
        for r in order_:
            total += r.input_tokens
            h = r.hashes
            n = _prefix_in(h, seen)
            hit += n * play.block_size
            seen.update(h)
    return hit, total


def _prefix_in(h: Sequence[int], seen: set[int]) -> int:
    if not h or h[0] not in seen:
        return 0
    lo, hi = 1, len(h)
    while lo < hi:
        mid = (lo + hi) // 2
        if h[mid] in seen:
            lo = mid + 1
        else:
            hi = mid
    return lo


def trace_stats(plays: Sequence[Play]) -> dict[str, float]:
    reqs = [r for p in plays for r in p.requests]
    subs = sum(1 for r in reqs if r.stream != "root")
    ins = sorted(r.input_tokens for r in reqs)
    outs = sorted(r.output_tokens for r in reqs)
    turns = sorted(sum(1 for r in p.requests if r.stream == "root") for p in plays)
    hit, total = ideal_hit_rate(plays)
    return {
        "plays": len(plays),
        "requests": len(reqs),
        "subagent_requests": subs,
        "plays_with_subagents": sum(1 for p in plays if p.subagents),
        "turns_median": turns[len(turns) // 2] if turns else 0,
        "input_median": ins[len(ins) // 2] if ins else 0,
        "output_median": outs[len(outs) // 2] if outs else 0,
        "input_tokens": total,
        "output_tokens": sum(outs),
        "ideal_hit_rate": hit / total if total else 0.0,
    }
