"""The gateway tests' engines: one package-scoped cluster (1 first-turn + 2 warm real engines),
stopped when the last gateway test finished so later packages have the memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.local.engines import LocalEngine
from tests.conftest import ServedGateway, cluster_config, three_engines, wait_ready


@pytest.fixture(scope="package")
def cluster(tiny_llama: Path, workdir: Path) -> Iterator[dict[str, LocalEngine]]:
    """Three real engines: one first-turn, two warm (priority scheduling on), with the embedded
    default's 32K context (coding-agent prompts are 15-19K tokens with the tiny tokenizer)."""
    with three_engines(tiny_llama, workdir) as engines:
        yield engines


@pytest.fixture(scope="package")
def gateway(cluster: dict[str, LocalEngine], tiny_llama: Path) -> Iterator[ServedGateway]:
    with ServedGateway(cluster_config(cluster, tiny_llama)) as gw:
        wait_ready(gw.url)
        yield gw
