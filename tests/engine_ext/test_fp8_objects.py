"""FP8 objects in the Mooncake tier on a real engine: bytes on the wire and greedy outputs.

One tiny-Llama engine whose Mooncake tier stores `object_format: fp8_e4m3` (e4m3 values, one
float32 scale per 128 values). A session's first turn is stored (host tier, then Mooncake); other
traffic then pushes it out of the 64-block device cache and the 24-chunk host tier, so its next
turn loads the whole prefix from Mooncake: FP8 objects, dequantized into the host tier, then
copied to the device. Measured: object bytes per chunk against the raw chunk, and the next turn's
greedy output against a full recompute of the same prompt (no KV reuse at all).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kernels
from gateway.local.engines import free_ports
from gateway.local.mooncake import MooncakeMaster
from tests.engine_ext.offload_support import (
    BLOCK,
    BLOCK_BYTES,
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

PORTS = range(23400, 23600)
HOST_CHUNKS = 24
DEVICE_BLOCKS = 64
SESSIONS = 3
PROMPT = 1400  # 10 full blocks; 40 generated tokens complete an 11th


@pytest.fixture(scope="module")
def fp8_engine(
    tiny_llama: Path, mooncake: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("fp8-engine")
    port, control_port = free_ports(2, PORTS)
    kv = plugin_kv(
        HOST_CHUNKS * BLOCK_BYTES,
        control_port,
        mooncake=mooncake,
        key_namespace="fp8-objects",
        object_format="fp8_e4m3",
    )
    spec = plugin_engine("fp8", tiny_llama, logs, port, kv, device_blocks=DEVICE_BLOCKS)
    with running_engines([spec], [control_port]) as engines:
        yield engines["fp8"]


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens two greedy outputs share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_fp8_objects_halve_the_bytes_and_keep_the_greedy_output_of_a_recompute(fp8_engine: Engine) -> None:
    rng = random.Random(8080)
    object_bytes = kernels.fp8_nbytes(BLOCK_BYTES // 2, 128)
    report = []
    for _ in range(SESSIONS):
        turn1 = tokens(rng, PROMPT)
        out1, _ = complete(fp8_engine, turn1)
        time.sleep(1.5)  # host store at the next step, then the Mooncake store
        for _ in range(8):  # 8 x 11 blocks: out of the device cache and the host tier
            complete(fp8_engine, tokens(rng, PROMPT), max_tokens=1)
        time.sleep(1.5)
        turn2 = turn1 + out1 + tokens(rng, 60)
        before, tier_before = metrics(fp8_engine), tier_stats(fp8_engine)
        out2, lp2 = complete(fp8_engine, turn2)
        after, tier_after = metrics(fp8_engine), tier_stats(fp8_engine)
        ref, lp_ref = complete(fp8_engine, turn2, reference=True)  # full recompute, no KV reuse
        loaded_chunks = tier_after["loaded_chunks"] - tier_before["loaded_chunks"]
        report.append(
            {
                "external_tokens": delta(after, before, "source:external_kv_transfer"),
                "loaded_chunks": loaded_chunks,
                "loaded_object_bytes": tier_after["loaded_object_bytes"] - tier_before["loaded_object_bytes"],
                "greedy_tokens_equal": agreement(out2, ref),
                "of": len(ref),
                "max_logprob_diff": max(abs(x - y) for x, y in zip(lp2, lp_ref, strict=True)),
            }
        )
    stats = tier_stats(fp8_engine)
    print(f"fp8 objects: {object_bytes} B per {BLOCK_BYTES} B chunk; sessions: {json.dumps(report)}")
    assert stats["load_failures"] == 0
    assert stats["stored_object_bytes"] == stats["stored_chunks"] * object_bytes
    assert stats["stored_bytes"] == stats["stored_chunks"] * BLOCK_BYTES
    for row in report:
        # the whole prefix (11 blocks) came from Mooncake as FP8 objects
        assert row["external_tokens"] == 11 * BLOCK
        assert row["loaded_chunks"] == 11
        assert row["loaded_object_bytes"] == 11 * object_bytes
        # measured: the tiny Llama's greedy output is unchanged by the FP8 round trip (40 of 40
        # tokens in each of 3 sessions), token logprobs within 0.016 of the recompute
        assert row["greedy_tokens_equal"] == row["of"]
        assert row["max_logprob_diff"] < 0.05
