"""The agent-loop tests' stack: what `agentgw serve` starts without a config (the embedded
default's engines, from `gateway.local.embedded`), fronted by a gateway; one per package."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.local.embedded import start_local_engines, stop_all
from gateway.local.engines import LocalEngine
from tests.agents.loop_support import EngineHandle
from tests.conftest import ServedGateway, wait_ready


@dataclass
class Stack:
    engines: list[LocalEngine]
    config: dict[str, Any]

    def handles(self) -> dict[str, EngineHandle]:
        out = {}
        for pool in self.config["pools"]:
            for e in pool["engines"]:
                out[e["name"]] = EngineHandle(e["url"], e.get("control_url"), self.control_token)
        return out

    @property
    def control_token(self) -> str | None:
        return self.config.get("migration", {}).get("control_token")


@pytest.fixture(scope="package")
def stack(tiny_llama: Path, workdir: Path) -> Iterator[Stack]:
    engines, config = start_local_engines(home=workdir / "agents", model_dir=tiny_llama, timeout_s=300)
    try:
        yield Stack(engines, config)
    finally:
        stop_all(engines)


@pytest.fixture(scope="package")
def gateway(stack: Stack) -> Iterator[ServedGateway]:
    config = {**stack.config, "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5}}
    with ServedGateway(config) as gw:
        wait_ready(gw.url)
        yield gw
