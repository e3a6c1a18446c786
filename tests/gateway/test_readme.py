"""The README's tour runs as written against a gateway in front of real engines (its Python blocks,
with the gateway's URL for http://127.0.0.1:8000, which this shared machine cannot give a test),
and the README stays a short user document (at most 120 lines)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.conftest import ServedGateway

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_is_at_most_120_lines() -> None:
    assert len(README.read_text().splitlines()) <= 120


@pytest.mark.engine
def test_readme_python_blocks_run(gateway: ServedGateway) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for i, code in enumerate(blocks):
        assert "http://127.0.0.1:8000" in code
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("http://127.0.0.1:8000", gateway.url), f"README[{i}]", "exec"), {})
        printed = out.getvalue()
        assert "'x-agentgw-engine':" in printed and "'x-agentgw-reason':" in printed, printed
        assert "'x-agentgw-session': 'my-session'" in printed, printed
