"""The embedded default: a tiny local model, local vLLM engines, and a config that fronts them.

``agentgw serve`` with no config builds the tiny model if it is missing, starts the engines of a
:class:`~gateway.local.layout.LocalLayout` (default: :data:`~gateway.local.layout.DEFAULT`, what
``agentgw plan`` recommends for 3 engines; prefix caching, ``--enforce-eager``, KV events on ZMQ,
a small KV cache), waits until they are healthy and returns the gateway config for them (its
pools as the layout says). The caller stops the engines on exit (:func:`stop_all`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gateway.local.engines import HASH_SEED, EngineSpec, LocalEngine, free_ports, start_engines
from gateway.local.layout import DEFAULT, LocalLayout
from gateway.local.tiny_model import build_tiny_model

DEFAULT_HOME = Path(os.environ.get("AGENTGW_HOME", Path.home() / ".cache" / "agentgw"))
SERVED_NAMES = {"llama": "tiny-llama", "gemma3": "tiny-gemma3", "qwen3_next": "tiny-qwen3-next"}


def start_local_engines(
    layout: LocalLayout = DEFAULT,
    arch: str = "llama",
    home: Path = DEFAULT_HOME,
    kv_cache_gib: int = 1,
    max_model_len: int = 32768,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 240.0,
) -> tuple[list[LocalEngine], dict[str, Any]]:
    """Start the engines and wait until they are ready; return them and the gateway config (as a
    dict) that fronts them."""
    specs, data = plan_local_engines(layout, arch, home, kv_cache_gib, max_model_len, extra_args)
    return start_engines(specs, timeout_s=timeout_s), data


def plan_local_engines(
    layout: LocalLayout = DEFAULT,
    arch: str = "llama",
    home: Path = DEFAULT_HOME,
    kv_cache_gib: int = 1,
    max_model_len: int = 32768,
    extra_args: tuple[str, ...] = (),
) -> tuple[list[EngineSpec], dict[str, Any]]:
    """Build the tiny model if it is missing and choose the engines' ports: their specs (nothing
    started yet) and the gateway config (as a dict) that fronts them, so the gateway can listen
    while they start (``agentgw serve``)."""
    model_dir = build_tiny_model(home / "models" / SERVED_NAMES[arch], arch)
    ports = free_ports(2 * layout.engines)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    specs = []
    for i, name in enumerate(layout.names):
        specs.append(
            EngineSpec(
                name=name,
                model_dir=model_dir,
                served_model_name=SERVED_NAMES[arch],
                port=ports[2 * i],
                kv_events_port=ports[2 * i + 1],
                log_path=logs / f"{name}.log",
                kv_cache_gib=kv_cache_gib,
                max_model_len=max_model_len,
                extra_args=extra_args,
            )
        )
    return specs, config_for(specs, model_dir, layout)


def config_for(specs: list[EngineSpec], model_dir: Path, layout: LocalLayout) -> dict[str, Any]:
    """``pools`` and ``models`` for the engines of ``specs`` (one per layout engine, in order)."""

    def engine(s: EngineSpec) -> dict[str, Any]:
        return {"name": s.name, "url": s.url, "model": s.served_model_name, "kv_events": s.kv_events_endpoint}

    pools = layout.pools([engine(s) for s in specs])
    model = {
        "name": specs[0].served_model_name,
        "tokenizer": str(model_dir),
        "block_size": 128,
        "hash_seed": HASH_SEED,
    }
    return {"pools": pools, "models": [model]}


def stop_all(engines: list[LocalEngine]) -> None:
    for e in engines:
        e.stop()
