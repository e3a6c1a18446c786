"""docs/hints.md runs: its Python blocks are executed in order against a real gateway."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "hints.md"


def test_hints_doc_examples_run(gateway: ServedGateway) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace: dict[str, object] = {"BASE_URL": gateway.url}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)
