"""Constants, handles and the one engine launcher shared by the engine_ext fixtures and tests."""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine_ext import config
from gateway.local.engines import EngineSpec, LocalEngine, start_engines, stop_engines
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import VOCAB_SIZE
from testing.engine_metrics import vllm_counters

HOST_CHUNKS = 96
BLOCK_BYTES = 65536  # tiny Llama: 2 layers x 2 KV heads x 128 tokens x (K+V) x 32 dims x bf16
CONTROL_TOKEN = "test-token"
# arch -> (device blocks, prompt tokens, prompts that evict a session from the device cache)
HYBRIDS = {"gemma3": (256, 1400, 30), "qwen3_next": (64, 2400, 10)}


@dataclass(frozen=True)
class Engine:
    name: str
    url: str
    control_url: str
    local: LocalEngine
    kv_events: str | None = None


BLOCK = 128
AUTH = {"Authorization": f"Bearer {CONTROL_TOKEN}"}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, VOCAB_SIZE - 16) for _ in range(n)]


def complete(
    engine: Engine, prompt: list[int], max_tokens: int = 40, **kv: Any
) -> tuple[list[int], list[float]]:
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
    }
    if kv.pop("reference", False):
        body["prompt_logprobs"] = 1  # vLLM then skips every prefix cache: a full recompute
    if kv:
        body["kv_transfer_params"] = kv
    r = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def metrics(engine: Engine) -> dict[str, float]:
    """Counters summed over labels, except prompt_tokens_by_source which keeps its source."""
    return vllm_counters(engine.url)


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def plugin_kv(
    host_bytes: int,
    control_port: int,
    *,
    engine_port: int | None = None,
    mooncake: MooncakeMaster | None = None,
    retention: dict[str, Any] | None = None,
    **tier: Any,
) -> dict[str, Any]:
    """engine_ext's `--kv-transfer-config` for a test engine: host tier, control API on
    `control_port` (the tests' token), `engine_url` when `engine_port` is given (prefetch), and a
    Mooncake tier on `mooncake` with `retention` and any other tier fields (`key_namespace`, ...)."""
    kv = config.kv_transfer_config(
        host_bytes,
        control_port=control_port,
        engine_url=None if engine_port is None else f"http://127.0.0.1:{engine_port}",
        mooncake_master=None if mooncake is None else mooncake.master_address,
        mooncake_metadata=None if mooncake is None else mooncake.metadata_server,
        retention=retention,
    )
    if tier:
        kv["kv_connector_extra_config"]["secondary_tiers"][0].update(tier)
    return kv


def plugin_engine(
    name: str,
    model_dir: Path,
    log_dir: Path,
    port: int,
    kv: dict[str, Any],
    *,
    device_blocks: int,
    max_model_len: int = 4096,
    serve_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    kv_events_port: int | None = None,
) -> EngineSpec:
    """A tiny test engine with the plugin (`engines.py` adds the pinning scheduler) and a
    `device_blocks` device cache; the Mooncake client's environment when `kv` has a store tier."""
    env = dict(MooncakeMaster.client_env) if kv["kv_connector_extra_config"].get("secondary_tiers") else {}
    if kv["kv_connector_extra_config"].get("control_port") is not None:
        env.update(config.control_env(CONTROL_TOKEN))
    env.update(extra_env or {})
    return EngineSpec(
        name=name,
        model_dir=model_dir,
        served_model_name="tiny-llama",
        port=port,
        log_path=log_dir / f"{name}.log",
        max_model_len=max_model_len,
        num_gpu_blocks_override=device_blocks,
        extra_args=(*serve_args, "--kv-transfer-config", json.dumps(kv)),
        extra_env=env,
        kv_events_port=kv_events_port,
    )


@contextlib.contextmanager
def running_engines(specs: Sequence[EngineSpec], control_ports: Sequence[int]) -> Iterator[dict[str, Engine]]:
    """Start the engines (their control APIs on ``control_ports``), yield handles by name, stop them."""
    started = start_engines(specs, timeout_s=300)
    try:
        yield {
            s.name: Engine(s.name, s.url, f"http://127.0.0.1:{port}", e, s.kv_events_endpoint)
            for s, e, port in zip(specs, started, control_ports, strict=True)
        }
    finally:
        stop_engines(started)


def until(fn: Callable[[], Any], timeout_s: float = 60.0, every_s: float = 0.2) -> Any:
    """`fn()` once it is truthy, polled every `every_s`; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = fn()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(every_s)


_TIER_LOG = re.compile(r"object tier|[EW]\d{4} \d\d:\d\d:\d\d")


def tier_log(engine: Engine, limit: int = 30) -> str:
    """The last `limit` lines of the engine's log written by the object tier or by Mooncake's
    client at warning level or above: what a failed load assertion shows."""
    try:
        text = engine.local.spec.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    lines = [line for line in text.splitlines() if _TIER_LOG.search(line)]
    return "\n".join(lines[-limit:]) or "(no tier or Mooncake warnings)"


def tier_stats(engine: Engine) -> dict[str, float]:
    """The Mooncake tier's counters from the engine's control API."""
    r = httpx.get(f"{engine.control_url}/v1/kv/stats", headers=AUTH, timeout=30)
    r.raise_for_status()
    return r.json()["tiers"]["MooncakeTier"]
