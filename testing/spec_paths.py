"""A session's next turn under speculative decoding, by where its prefix's KV came from.

Shared by `tests/engine_ext/test_spec_paths.py` (the path tests and their mutation) and
`benchmarks/offload.py --speculation` (the table in docs/engine_ext.md). The cluster: two vLLM
engines (``a`` and ``b``) with engine_ext's host and Mooncake tiers on one master, serving the
`llama_ctx` tiny model with a drafter, and a gateway whose first-turn pool is ``a`` and whose
warm pool is ``b`` (so the planner moves a first turn's session to ``b`` in its tool gap).

Paths (each a fresh session: a first turn of `PROMPT` tokens, then a second turn of the first
turn, its output and 60 new tokens):

- ``recompute``: the second turn under a ``cache_salt`` nothing was stored under (every prefix
  token computed);
- ``local hit``: the second turn on ``a`` right after the first (device prefix cache);
- ``host reload``: on ``a`` after other prompts evicted the prefix from the device cache;
- ``Mooncake reload``: on ``b``, which never saw the session (its connector loads the prefix
  from the Mooncake tier through its host tier);
- ``planner move``: through the gateway; the first turn lands on ``a``, the planner moves the
  session to ``b`` during a 20 s tool gap hint (Mooncake -> ``b``'s host tier -> its device
  cache), the second turn runs on ``b``.

Each returns the turn as served and the recompute of the same prompt on the same engine: the
greedy tokens must match, and the counters say which source served the prefix.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from testing.engine_metrics import vllm_counters

__all__ = [
    "GATEWAY_HIT",
    "MODEL",
    "NUM_SPEC",
    "OUTPUT",
    "PATHS",
    "PROMPT",
    "Endpoint",
    "SpecCluster",
    "Turn",
    "gateway_config",
    "run_path",
]

MODEL = "tiny-llama-ctx"
NUM_SPEC = 3
PROMPT = 1400  # 10 full blocks of 128 tokens and a part
OUTPUT = 48
BLOCK = 128
PATHS = ("recompute", "local hit", "host reload", "Mooncake reload", "planner move")
GATEWAY_HIT = "local hit via the gateway"  # the planner move's baseline: the same hop, a local hit

_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_DRAFTS = "vllm:spec_decode_num_drafts_total"


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    control_url: str
    kv_events: str | None = None


@dataclass(frozen=True)
class SpecCluster:
    a: Endpoint
    b: Endpoint
    gateway_url: str
    control_token: str
    vocab: int
    tool_gap_s: float = 0.0
    """How long after a first turn's end its session's next turn arrives (at least until the
    planner's move is done): the tool run the move hides in."""


@dataclass
class Turn:
    tokens: list[int]
    ttft_s: float
    accepted: float  # accepted draft tokens
    drafts: float  # drafting steps
    sources: dict[str, float] = field(default_factory=dict)  # prompt tokens by source
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def per_step(self) -> float:
        """Accepted drafts per drafting step (at most `NUM_SPEC`)."""
        return self.accepted / self.drafts if self.drafts else 0.0


def turn(engine: Endpoint, prompt: list[int], via: str | None = None, **extra: Any) -> Turn:
    """One streamed greedy completion on ``engine`` (through ``via``, a gateway, when given) with
    its TTFT and ``engine``'s counters (one request at a time: the deltas are its own)."""
    before = vllm_counters(engine.url)
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": OUTPUT,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    body.update(extra)
    tokens: list[int] = []
    first: float | None = None
    start = time.perf_counter()
    with httpx.stream("POST", f"{via or engine.url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code}: {r.read().decode(errors='replace')}")
        headers = {k: v for k, v in r.headers.items() if k.startswith("x-agentgw")}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise AssertionError(f"stream error: {chunk}")
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter() - start
            tokens += ids
    after = vllm_counters(engine.url)
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    return Turn(
        tokens,
        first if first is not None else float("nan"),
        after.get(_ACCEPTED, 0.0) - before.get(_ACCEPTED, 0.0),
        after.get(_DRAFTS, 0.0) - before.get(_DRAFTS, 0.0),
        {s: after.get(f"source:{s}", 0.0) - before.get(f"source:{s}", 0.0) for s in sources},
        headers,
    )


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab - 16) for _ in range(n)]


def _settle() -> None:
    """Stores run at the start of the next engine step, then asynchronously to Mooncake."""
    time.sleep(1.5)


def _mooncake_loaded(c: SpecCluster, e: Endpoint) -> float:
    r = httpx.get(
        f"{e.control_url}/v1/kv/stats", headers={"Authorization": f"Bearer {c.control_token}"}, timeout=30
    )
    r.raise_for_status()
    return float(r.json()["tiers"]["MooncakeTier"]["loaded_bytes"])


def _first_turn(c: SpecCluster, rng: random.Random) -> tuple[list[int], list[int]]:
    first = _tokens(rng, PROMPT, c.vocab)
    out = turn(c.a, first).tokens
    _settle()
    return first, first + out + _tokens(rng, 60, c.vocab)


def recompute(e: Endpoint, prompt: list[int]) -> Turn:
    t = turn(e, prompt, cache_salt=f"recompute-{random.random()}")
    assert t.sources["local_compute"] == len(prompt), t.sources
    return t


def _local_hit(c: SpecCluster, rng: random.Random) -> tuple[Turn, Turn]:
    _, second = _first_turn(c, rng)
    t = turn(c.a, second)
    assert t.sources["local_cache_hit"] >= 10 * BLOCK and t.sources["external_kv_transfer"] == 0, t.sources
    return t, recompute(c.a, second)


def _recompute(c: SpecCluster, rng: random.Random) -> tuple[Turn, Turn]:
    _, second = _first_turn(c, rng)
    ref = recompute(c.a, second)
    return ref, ref


def _host_reload(c: SpecCluster, rng: random.Random) -> tuple[Turn, Turn]:
    _, second = _first_turn(c, rng)
    for _ in range(6):  # other sessions' prompts evict it from a's device cache
        turn(c.a, _tokens(rng, PROMPT, c.vocab), max_tokens=1)
    loaded = _mooncake_loaded(c, c.a)
    t = turn(c.a, second)
    assert t.sources["external_kv_transfer"] >= 10 * BLOCK and t.sources["local_cache_hit"] == 0, t.sources
    assert _mooncake_loaded(c, c.a) == loaded  # the host tier served it
    return t, recompute(c.a, second)


def _mooncake_reload(c: SpecCluster, rng: random.Random) -> tuple[Turn, Turn]:
    _, second = _first_turn(c, rng)
    loaded = _mooncake_loaded(c, c.b)
    t = turn(c.b, second)
    assert t.sources["external_kv_transfer"] >= 10 * BLOCK and t.sources["local_cache_hit"] == 0, t.sources
    assert _mooncake_loaded(c, c.b) > loaded
    return t, recompute(c.b, second)


def _moved(c: SpecCluster, rng: random.Random) -> tuple[str, list[int], Turn]:
    sid = f"spec-move-{rng.random()}"
    first = _tokens(rng, PROMPT, c.vocab)
    t1 = turn(
        c.a, first, via=c.gateway_url, agent_hints={"session_id": sid, "expected_tool_latency_ms": 20000}
    )
    assert t1.headers["x-agentgw-engine"] == c.a.name, t1.headers
    ended = time.monotonic()
    mig = _wait_migration(c.gateway_url, sid)
    assert (mig["kind"], mig["state"], mig["targets"]) == ("move", "done", [c.b.name]), mig
    time.sleep(max(0.0, c.tool_gap_s - (time.monotonic() - ended)))
    second = first + t1.tokens + _tokens(rng, 60, c.vocab)
    t = turn(c.b, second, via=c.gateway_url, agent_hints={"session_id": sid})
    assert t.headers["x-agentgw-engine"] == c.b.name, t.headers
    # the move's prefetch loaded the prefix into b's cache during the gap (Mooncake -> host tier
    # -> device): the turn computes only what followed the first turn's last full block
    assert t.sources["local_compute"] < 2 * BLOCK, t.sources
    return sid, second, t


def _planner_move(c: SpecCluster, rng: random.Random) -> tuple[Turn, Turn]:
    _, second, t = _moved(c, rng)
    return t, recompute(c.b, second)


def _gateway_hit(c: SpecCluster, rng: random.Random) -> tuple[Turn, Turn]:
    """The moved session's second turn sent again through the gateway: a local hit on ``b``, what
    the gateway's hop adds to a turn's TTFT (the planner move's row goes through it too)."""
    sid, second, _ = _moved(c, rng)
    t = turn(c.b, second, via=c.gateway_url, agent_hints={"session_id": sid})
    assert t.headers["x-agentgw-engine"] == c.b.name, t.headers
    assert t.sources["local_cache_hit"] >= 10 * BLOCK, t.sources
    return t, recompute(c.b, second)


def _wait_migration(gateway_url: str, sid: str, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = httpx.get(f"{gateway_url}/v1/agent/sessions/{sid}", timeout=10).json()
        m = state.get("migration")
        if m and m["state"] != "running":
            return dict(m)
        time.sleep(0.25)
    raise AssertionError(f"the migration of {sid} did not finish: {state}")


_RUN: dict[str, Callable[[SpecCluster, random.Random], tuple[Turn, Turn]]] = {
    "recompute": _recompute,
    "local hit": _local_hit,
    "host reload": _host_reload,
    "Mooncake reload": _mooncake_reload,
    "planner move": _planner_move,
    "local hit via the gateway": _gateway_hit,
}


def run_path(c: SpecCluster, name: str, seed: int) -> tuple[Turn, Turn]:
    """One fresh session's second turn by path ``name``, and its recompute on the same engine."""
    return _RUN[name](c, random.Random(seed))


def gateway_config(
    c_a: Endpoint, c_b: Endpoint, tokenizer: str, control_token: str, hash_seed: str
) -> dict[str, Any]:
    """The gateway in front of the two engines: ``a`` first-turn pool, ``b`` warm pool, migrations
    on (as in tests/migrations)."""

    def eng(e: Endpoint) -> dict[str, Any]:
        return {
            "name": e.name,
            "url": e.url,
            "model": MODEL,
            "control_url": e.control_url,
            "kv_events": e.kv_events,
        }

    return {
        "pools": [
            {"name": "first_turn", "role": "first_turn", "engines": [eng(c_a)]},
            {"name": "warm", "role": "warm", "engines": [eng(c_b)]},
        ],
        "models": [{"name": MODEL, "tokenizer": tokenizer, "block_size": BLOCK, "hash_seed": hash_seed}],
        "routing": {"split": "wall", "first_turn_threshold_tokens": 512},
        "migration": {"control_token": control_token, "default_gap_s": 5},
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "health_timeout_s": 1},
    }
