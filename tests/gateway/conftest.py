"""The gateway tests' gateway, in front of the shared three-engine ``cluster`` (tests/conftest.py:
1 first-turn + 2 warm real engines, stopped after the last test that uses it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.local.engines import LocalEngine
from tests.conftest import ServedGateway, cluster_config, wait_ready


@pytest.fixture(scope="package")
def gateway(cluster: dict[str, LocalEngine], tiny_llama: Path) -> Iterator[ServedGateway]:
    with ServedGateway(cluster_config(cluster, tiny_llama)) as gw:
        wait_ready(gw.url)
        yield gw
