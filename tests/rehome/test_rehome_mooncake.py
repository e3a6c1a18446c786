"""A killed engine's session continues on a live engine of its pool from the Mooncake tier.

Real processes: a `mooncake_master`, a Mooncake store node (`mooncake_client` lending the store
its memory), two tiny-Llama engines running engine_ext (host tier + Mooncake tier + control API)
that lend no memory themselves (so the objects an engine wrote outlive it: an engine's own segment
goes with its process), and a gateway with migrations on. A session's turn runs on engine X,
its KV reaches Mooncake, X is SIGKILLed; the gateway ejects X, re-homes the session on Y (counted,
the session API shows the `engine_down` move), Y loads the prefix from Mooncake (vLLM's
`external_kv_transfer` prompt tokens), and the next turn runs on Y without recomputing it. Only
one engine loads from Mooncake at a time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_ext import config
from gateway.local.engines import HASH_SEED, LocalEngine, free_ports, start_engines, stop_engines
from gateway.local.mooncake import MooncakeMaster, MooncakeStoreNode
from tests.conftest import MODEL, ServedGateway, engine_metric, engine_specs, wait_ready
from tests.engine_ext.offload_support import AUTH, BLOCK, BLOCK_BYTES, CONTROL_TOKEN, HOST_CHUNKS

pytestmark = [pytest.mark.engine, pytest.mark.store]

NAMES = ("rh0", "rh1")
SYSTEM = "You are an agent that edits code carefully and explains every change. " * 10


@pytest.fixture(scope="module")
def rehome_cluster(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[LocalEngine, str]]]:
    logs = tmp_path_factory.mktemp("rehome")
    with (
        # client_ttl 60 s as in tests/conftest.py: a late heartbeat must not expire the store node,
        # whose segment every put here goes to
        MooncakeMaster(logs / "master.log", client_ttl_s=60) as master,
        MooncakeStoreNode(master, 256 << 20, logs / "store-node.log"),
    ):
        control_ports = free_ports(len(NAMES))
        specs = []
        for spec, cport in zip(engine_specs(tiny_llama, list(NAMES), logs), control_ports, strict=True):
            cfg = config.kv_transfer_config(
                HOST_CHUNKS * BLOCK_BYTES,
                control_port=cport,
                engine_url=spec.url,
                mooncake_master=master.master_address,
                mooncake_metadata=master.metadata_server,
                mooncake_segment_bytes=0,  # a pure client: its objects live on the store node
            )
            specs.append(
                type(spec)(
                    **{
                        **spec.__dict__,
                        "extra_args": ("--kv-transfer-config", json.dumps(cfg)),
                        "extra_env": {**MooncakeMaster.client_env, **config.control_env(CONTROL_TOKEN)},
                    }
                )
            )
        engines = start_engines(specs, timeout_s=400)
        try:
            yield {
                e.spec.name: (e, f"http://127.0.0.1:{c}") for e, c in zip(engines, control_ports, strict=True)
            }
        finally:
            stop_engines(engines)


@pytest.fixture(scope="module")
def rehome_gateway(
    rehome_cluster: dict[str, tuple[LocalEngine, str]], tiny_llama: Path
) -> Iterator[ServedGateway]:
    def eng(name: str) -> dict[str, Any]:
        e, control = rehome_cluster[name]
        return {
            "name": name,
            "url": e.url,
            "model": MODEL,
            "kv_events": e.spec.kv_events_endpoint,
            "control_url": control,
        }

    cfg = {
        "pools": [{"name": "warm", "role": "warm", "engines": [eng(n) for n in NAMES]}],
        "models": [
            {"name": MODEL, "tokenizer": str(tiny_llama), "block_size": BLOCK, "hash_seed": HASH_SEED}
        ],
        "migration": {"control_token": CONTROL_TOKEN, "default_gap_s": 5},
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "health_timeout_s": 1},
    }
    with ServedGateway(cfg) as gw:
        wait_ready(gw.url)
        yield gw


def post(gw: ServedGateway, messages: list[dict[str, Any]], hints: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "agent_hints": hints}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def tier(control: str) -> dict[str, Any]:
    r = httpx.get(f"{control}/v1/kv/stats", headers=AUTH, timeout=30)
    r.raise_for_status()
    return r.json()["tiers"]["MooncakeTier"]


def source(engine: LocalEngine, name: str) -> float:
    return engine_metric(engine.url, "vllm:prompt_tokens_by_source_total", {"source": name})


def rehomed(gw: ServedGateway, outcome: str) -> float:
    key = f'agentgw_sessions_rehomed_total{{outcome="{outcome}",reason="engine_down"}}'
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(key):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(fn: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.25)
    raise AssertionError(f"{what}: not reached in {timeout_s} s")


def test_killed_engines_session_continues_on_its_pool_from_mooncake(
    rehome_gateway: ServedGateway, rehome_cluster: dict[str, tuple[LocalEngine, str]]
) -> None:
    gw = rehome_gateway
    # warm the prompt analysis up (its worker processes start on first use; a turn whose analysis
    # is skipped keeps no token ids, and then the new home loads on the next turn instead)
    post(gw, [{"role": "user", "content": "warm up"}], {})
    m = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "[rehome] " + "refactor module " * 200},
    ]
    r1 = post(gw, m, {"session_id": "rh-1", "expected_tool_latency_ms": 20000})
    x = r1.headers["x-agentgw-engine"]
    (y,) = [n for n in NAMES if n != x]
    victim, x_control = rehome_cluster[x]
    survivor = rehome_cluster[y][0]
    prompt1 = r1.json()["usage"]["prompt_tokens"]
    blocks = prompt1 // BLOCK
    assert blocks >= 8, prompt1
    # turn 1's KV reaches Mooncake (every host chunk is written through to the store)
    wait_for(lambda: tier(x_control)["stored_chunks"] >= blocks, 60, "turn 1 stored in Mooncake")
    external_before = source(survivor, "external_kv_transfer")

    victim.kill()  # SIGKILL: no clean shutdown; its engine-side state is gone
    wait_for(lambda: rehomed(gw, "prefetch") + rehomed(gw, "moved") >= 1, 60, "session re-homed")
    s = httpx.get(f"{gw.url}/v1/agent/sessions/rh-1", timeout=10).json()
    assert s["home_engine"] == y and s["pool"] == "warm", s
    prefetched = rehomed(gw, "prefetch") == 1
    print(f"re-homed {x} -> {y}, prefetch={prefetched}")
    if prefetched:  # the gateway kept the token ids: the prefix is loaded during the gap
        mig = wait_for(
            lambda: (
                (mm := httpx.get(f"{gw.url}/v1/agent/sessions/rh-1", timeout=10).json()["migration"])
                and mm["state"] != "running"
                and mm
            ),
            90,
            "prefetch on the new home",
        )
        assert (mig["kind"], mig["reason"], mig["source"], mig["targets"], mig["state"]) == (
            "move",
            "engine_down",
            x,
            [y],
            "done",
        ), mig
        loaded = source(survivor, "external_kv_transfer") - external_before
        assert loaded >= (blocks - 1) * BLOCK, (loaded, blocks)  # the dead engine's prefix, from Mooncake

    # the tool gap is over: turn 2 goes to the new home and computes only what is new
    m2 = m + [
        {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "next"},
    ]
    computed_before = source(survivor, "local_compute")
    r2 = post(gw, m2, {"session_id": "rh-1"})
    assert (r2.headers["x-agentgw-engine"], r2.headers["x-agentgw-reason"]) == (y, "sticky")
    recomputed = source(survivor, "local_compute") - computed_before
    loaded = source(survivor, "external_kv_transfer") - external_before
    print(f"turn 2 on {y}: recomputed {recomputed:.0f}, loaded from Mooncake since the kill {loaded:.0f}")
    assert loaded >= (blocks - 1) * BLOCK, (loaded, blocks)  # the dead engine's prefix, from Mooncake
    assert recomputed < BLOCK + 64, (recomputed, r2.json()["usage"]["prompt_tokens"])
    assert rehomed(gw, "no_target") == 0
