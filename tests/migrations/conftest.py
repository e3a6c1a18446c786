"""Three real engines running engine_ext (host tier + Mooncake tier + control API) behind a
gateway with migrations on: 1 first-turn, 2 warm, one real mooncake_master shared by all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.config import control_env
from gateway.local.engines import HASH_SEED, LocalEngine, free_ports, start_engines, stop_engines
from gateway.local.mooncake import MooncakeMaster
from tests.conftest import MODEL, ServedGateway, engine_specs, wait_ready
from tests.engine_ext.conftest import kv_transfer_config
from tests.engine_ext.offload_support import CONTROL_TOKEN

NAMES = ("first0", "warm0", "warm1")


@pytest.fixture(scope="package")
def kv_cluster(
    tiny_llama: Path, mooncake: MooncakeMaster, workdir: Path
) -> Iterator[dict[str, tuple[LocalEngine, str]]]:
    control_ports = free_ports(len(NAMES))
    base = engine_specs(tiny_llama, list(NAMES), workdir, max_model_len=8192)
    specs = []
    for spec, cport in zip(base, control_ports, strict=True):
        cfg = kv_transfer_config(mooncake, cport, spec.port)
        specs.append(
            type(spec)(
                **{
                    **spec.__dict__,
                    "extra_args": ("--kv-transfer-config", json.dumps(cfg)),
                    "extra_env": {**MooncakeMaster.client_env, **control_env(CONTROL_TOKEN)},
                }
            )
        )
    engines = start_engines(specs, timeout_s=400)
    try:
        yield {e.spec.name: (e, f"http://127.0.0.1:{c}") for e, c in zip(engines, control_ports, strict=True)}
    finally:
        stop_engines(engines)


def kv_gateway_config(kv_cluster: dict[str, tuple[LocalEngine, str]], tiny_llama: Path) -> dict:
    def eng(name: str) -> dict:
        e, control = kv_cluster[name]
        return {
            "name": name,
            "url": e.url,
            "model": MODEL,
            "kv_events": e.spec.kv_events_endpoint,
            "control_url": control,
        }

    return {
        "pools": [
            {"name": "first_turn", "role": "first_turn", "engines": [eng("first0")]},
            {"name": "warm", "role": "warm", "engines": [eng("warm0"), eng("warm1")]},
        ],
        "models": [{"name": MODEL, "tokenizer": str(tiny_llama), "block_size": 128, "hash_seed": HASH_SEED}],
        "routing": {"split": "wall", "first_turn_threshold_tokens": 512},
        "migration": {"control_token": CONTROL_TOKEN, "default_gap_s": 5},
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "health_timeout_s": 1},
    }


@pytest.fixture(scope="package")
def kv_gateway(kv_cluster: dict[str, tuple[LocalEngine, str]], tiny_llama: Path) -> Iterator[ServedGateway]:
    with ServedGateway(kv_gateway_config(kv_cluster, tiny_llama)) as gw:
        wait_ready(gw.url)
        yield gw
