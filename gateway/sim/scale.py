"""Scaled-down traces for a fidelity check against real (tiny, CPU) engines.

``scale_plays(plays, max_context, block_size)`` shrinks every request's input by one factor per
play, ``f = max_context_fill * max_context / max(input + output)`` (outputs are capped at
``max_output``), so that the longest request fits the small context, and re-blocks the prompt at
the new ``block_size``: new block ``j`` covers original tokens from ``j * block_size / f``, and its
hash chains the original block hash found there. Two requests that shared an original prefix of
``B`` blocks share about ``B * orig_block * f / block_size`` new blocks, so the prefix structure
(and the ideal reuse, up to rounding) survives. Dependencies and recorded gaps are kept as they
are: the same think times, the same subagent spawns and joins.

``to_weka(play)`` writes a scaled play back in the Weka JSON format (``hash_ids`` per new block),
so the same file can drive both this simulator and a live replay against real engines, where a
client turns each hash id into a fixed block of token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from gateway.sim.traces import HashChainer, Play, TraceRequest

__all__ = ["scale_plays", "to_weka", "weka_json"]


def scale_plays(
    plays: Sequence[Play],
    max_context: int = 4096,
    block_size: int = 128,
    max_output: int = 64,
    max_context_fill: float = 0.9,
) -> list[Play]:
    chainer = HashChainer()
    out = []
    for play in plays:
        longest = max(r.input_tokens + min(r.output_tokens, max_output) for r in play.requests)
        f = min(1.0, max_context_fill * max_context / max(1, longest))
        root = chainer.root("scaled:" + play.play_id)
        reqs = []
        for r in play.requests:
            out_tok = max(1, min(r.output_tokens, max_output))
            n_in = max(1, min(max_context - out_tok, round(r.input_tokens * f)))
            ids = []
            for j in range(n_in // block_size):
                orig = int(j * block_size / f) // play.block_size
                ids.append(r.hashes[orig] if orig < len(r.hashes) else -(orig + 1))
            hashes = chainer.chain(root, ids, memo_key=(play.play_id, r.stream))
            reqs.append(
                TraceRequest(
                    idx=r.idx,
                    stream=r.stream,
                    t=r.t,
                    input_tokens=n_in,
                    output_tokens=out_tok,
                    hashes=hashes,
                    api_time=r.api_time,
                    model=r.model,
                    deps=list(r.deps),
                    gap_s=r.gap_s,
                )
            )
        out.append(replace(play, block_size=block_size, requests=reqs))
    return out


def to_weka(play: Play, scope: str = "local") -> dict[str, object]:
    """A play as a Weka JSON object (subagents nested under their stream, times absolute).
    ``scope``: the file's ``hash_id_scope``; ``global`` when its hash ids name the same blocks
    in other files too (synthetic plays sharing a system prompt)."""
    top: list[dict[str, object]] = []
    subs: dict[str, dict[str, object]] = {}
    for r in play.requests:
        row = {
            "t": r.t,
            "type": "n",
            "model": r.model,
            "in": r.input_tokens,
            "out": r.output_tokens,
            "hash_ids": list(r.hashes),
            "api_time": r.api_time,
            "think_time": r.gap_s,
        }
        if r.stream == "root":
            top.append(row)
            continue
        if r.stream not in subs:
            subs[r.stream] = {"t": r.t, "type": "subagent", "agent_id": r.stream, "requests": []}
            top.append(subs[r.stream])
        inner = subs[r.stream]["requests"]
        assert isinstance(inner, list)
        inner.append(row)
    return {"id": play.play_id, "block_size": play.block_size, "hash_id_scope": scope, "requests": top}


def weka_json(play: Play, scope: str = "local") -> dict[str, Any]:
    """:func:`to_weka` plus the fields aiperf's Weka schema requires (trace
    ``models``; subagent ``subagent_type``, ``status``, ``models``): readable by both."""
    d = to_weka(play, scope)
    models = sorted({r.model or "unknown" for r in play.requests})
    d["models"] = models
    d.setdefault("tool_tokens", 0)
    d.setdefault("system_tokens", 0)
    for e in cast(list[dict[str, Any]], d["requests"]):  # to_weka builds it as a list of dicts
        if e.get("type") == "subagent":
            e.setdefault("subagent_type", "Explore")
            e.setdefault("status", "completed")
            e.setdefault("models", models)
        else:
            e["model"] = e.get("model") or models[0]
    return d
