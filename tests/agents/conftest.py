"""The agent-loop tests' stack: what `agentgw serve` starts without a config (the embedded
default, `gateway.local.embedded.start_local_stack`: engines with engine_ext's host tier, device
pins and control API, serving `tiny-agent` with the scripted decoder), fronted by a gateway; one
per package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.local.embedded import LocalStack, start_local_stack
from tests.agents.loop_support import EngineHandle
from tests.conftest import ServedGateway, wait_ready


def handles(stack: LocalStack) -> dict[str, EngineHandle]:
    """Each engine's API and control API (with the token the stack generated)."""
    token = stack.config.get("migration", {}).get("control_token")
    return {
        e["name"]: EngineHandle(e["url"], e.get("control_url"), token)
        for pool in stack.config["pools"]
        for e in pool["engines"]
    }


@pytest.fixture(scope="package")
def stack(tiny_llama: Path, workdir: Path) -> Iterator[LocalStack]:
    stack = start_local_stack(home=workdir / "agents", model_dir=tiny_llama, timeout_s=300)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="package")
def gateway(stack: LocalStack) -> Iterator[ServedGateway]:
    config = {**stack.config, "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5}}
    with ServedGateway(config) as gw:
        wait_ready(gw.url)
        yield gw
