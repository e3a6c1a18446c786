"""The embedded default: a tiny local model, local vLLM engines, and a config that fronts them.

``agentgw serve`` with no config builds the tiny model if it is missing, starts ``first_turn``
+ ``warm`` local engines (prefix caching, ``--enforce-eager``, KV events on ZMQ, a small KV
cache), waits until they are healthy and returns the gateway config for them. The caller stops
the engines on exit (:func:`stop_all`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gateway.local.engines import HASH_SEED, EngineSpec, LocalEngine, free_ports, start_engines
from gateway.local.tiny_model import build_tiny_model

DEFAULT_HOME = Path(os.environ.get("AGENTGW_HOME", Path.home() / ".cache" / "agentgw"))
SERVED_NAMES = {"llama": "tiny-llama", "gemma3": "tiny-gemma3", "qwen3_next": "tiny-qwen3-next"}


def start_local_engines(
    first_turn: int = 1,
    warm: int = 2,
    arch: str = "llama",
    home: Path = DEFAULT_HOME,
    kv_cache_gib: int = 1,
    max_model_len: int = 32768,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 240.0,
) -> tuple[list[LocalEngine], dict[str, Any]]:
    """Start the engines; return them and the gateway config (as a dict) that fronts them."""
    model_dir = build_tiny_model(home / "models" / SERVED_NAMES[arch], arch)
    n = first_turn + warm
    ports = free_ports(2 * n)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    specs = []
    for i in range(n):
        role = "first" if i < first_turn else "warm"
        name = f"{role}{i if i < first_turn else i - first_turn}"
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
    engines = start_engines(specs, timeout_s=timeout_s)
    return engines, config_for(specs, model_dir, first_turn)


def config_for(specs: list[EngineSpec], model_dir: Path, first_turn: int) -> dict[str, Any]:
    def engine(s: EngineSpec) -> dict[str, Any]:
        return {"name": s.name, "url": s.url, "model": s.served_model_name, "kv_events": s.kv_events_endpoint}

    pools = []
    if first_turn:
        pools.append(
            {"name": "first_turn", "role": "first_turn", "engines": [engine(s) for s in specs[:first_turn]]}
        )
    if specs[first_turn:]:
        pools.append({"name": "warm", "role": "warm", "engines": [engine(s) for s in specs[first_turn:]]})
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
