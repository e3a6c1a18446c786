"""Hybrid models across engines through the Mooncake tier: engine B continues a session that ran
on engine A by loading every cache group's KV (sliding-window and full attention for Gemma3,
linear-attention state and full attention for Qwen3-Next) from Mooncake, not by recomputing it.

One pair of engines per architecture (module-scoped, parametrized: pytest stops the Gemma3 pair
before it starts the Qwen3-Next pair, so at most two engines run at a time).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.local.engines import free_ports
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import SERVE_ARGS, build_tiny_model
from tests.engine_ext.offload_support import (
    HYBRIDS,
    Engine,
    complete,
    delta,
    metrics,
    plugin_engine,
    plugin_kv,
    running_engines,
    tier_stats,
    tokens,
)

pytestmark = [pytest.mark.engine, pytest.mark.store]

PORTS = range(23000, 23200)
# Hit granularity: Gemma3's 128-token blocks; Qwen3-Next's linear-attention state is kept (and
# loaded) only at 1152-token "align" boundaries.
ALIGN = {"gemma3": 128, "qwen3_next": 1152}


def wait_stores_settled(engine: Engine, quiet_s: float = 1.0, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll the tier's counters until no store has completed for `quiet_s`."""
    deadline = time.monotonic() + timeout_s
    last = tier_stats(engine)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = tier_stats(engine)
        if now["stored_chunks"] != last["stored_chunks"]:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return now
    return last


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid_pair(
    request: pytest.FixtureRequest,
    models_dir: Path,
    mooncake: MooncakeMaster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Engine, Engine]]:
    arch: str = request.param
    root = tmp_path_factory.mktemp(f"hybrid-mooncake-{arch}")
    model = build_tiny_model(models_dir / f"tiny-{arch.replace('_', '-')}", arch)
    blocks = HYBRIDS[arch][0]
    ports = free_ports(4, PORTS)
    specs = []
    for i, name in enumerate(("a", "b")):
        kv = plugin_kv(64 << 20, ports[2 + i], mooncake=mooncake)
        specs.append(
            plugin_engine(
                f"{arch}-{name}", model, root, ports[i], kv, device_blocks=blocks, serve_args=SERVE_ARGS[arch]
            )
        )
    with running_engines(specs, ports[2:4]) as engines:
        a, b = engines.values()
        yield arch, a, b


def test_engine_b_continues_a_hybrid_session_from_engine_a_via_mooncake(
    hybrid_pair: tuple[str, Engine, Engine],
) -> None:
    arch, a, b = hybrid_pair
    _, prompt_len, _ = HYBRIDS[arch]
    rng = random.Random(len(arch) * 104729)
    turn1 = tokens(rng, prompt_len)
    out1, _ = complete(a, turn1)
    stored_a = wait_stores_settled(a)
    assert stored_a["stored_chunks"] > 0, stored_a

    turn2 = turn1 + out1 + tokens(rng, 60)
    before, mc_before = metrics(b), tier_stats(b)
    out_b, lp_b = complete(b, turn2)
    after, mc_after = metrics(b), tier_stats(b)
    loaded = delta(after, before, "source:external_kv_transfer")
    computed = delta(after, before, "source:local_compute")
    report: dict[str, Any] = {
        "arch": arch,
        "turn2_tokens": len(turn2),
        "external_kv_transfer": loaded,
        "local_compute": computed,
        "local_cache_hit": delta(after, before, "source:local_cache_hit"),
        "b_loaded_chunks": mc_after["loaded_chunks"] - mc_before["loaded_chunks"],
        "b_load_failures": mc_after["load_failures"] - mc_before["load_failures"],
        "b_lookup_hits": mc_after["lookup_hits"] - mc_before["lookup_hits"],
        "a_stored_chunks": stored_a["stored_chunks"],
    }
    print(f"hybrid via Mooncake: {report}")

    # The session's prefix (its prompt and the block-aligned part of its output) came from
    # Mooncake: nothing from B's own caches, nothing recomputed but the unaligned tail.
    assert report["local_cache_hit"] == 0, report
    assert report["b_load_failures"] == 0, report
    assert report["b_loaded_chunks"] > 0, report
    assert loaded >= (prompt_len // ALIGN[arch]) * ALIGN[arch], report
    assert loaded + computed == len(turn2), report

    # Greedy output equals a full recompute of the same prompt (prompt_logprobs skips every cache).
    ref, ref_lp = complete(a, turn2, reference=True)
    assert out_b == ref
    assert lp_b == pytest.approx(ref_lp, abs=2e-2)
