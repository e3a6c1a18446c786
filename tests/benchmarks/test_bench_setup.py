"""`make bench` installs what the benchmarks need before running them: scripts/bench-setup.sh puts
wrk on PATH and vllm-router, at the version docs/benchmarks.md measured, where
benchmarks/overhead.py looks for it (.bench-venv)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import overhead

REPO = Path(__file__).resolve().parents[2]


def test_make_bench_runs_the_bench_setup_before_any_benchmark() -> None:
    steps = subprocess.run(
        ["make", "-n", "bench"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    lines = steps.splitlines()
    setup = lines.index("./scripts/bench-setup.sh")
    first_benchmark = next(i for i, line in enumerate(lines) if "-m benchmarks." in line)
    assert setup < first_benchmark


def test_bench_setup_installs_wrk_and_the_vllm_router_the_overhead_benchmark_finds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = (REPO / "scripts" / "bench-setup.sh").read_text()
    assert re.search(r"apt-get install .*\bwrk\b", script)
    version = re.search(r"^VLLM_ROUTER_VERSION=(\S+)$", script, re.M)
    assert version is not None
    assert f"vllm-router {version.group(1)}" in (REPO / "docs" / "benchmarks.md").read_text()
    assert (
        '"vllm-router==$VLLM_ROUTER_VERSION"' in script and ".bench-venv/bin/python -m pip install" in script
    )
    # where the script installs it is where the benchmark looks first
    monkeypatch.delenv("AGENTGW_VLLM_ROUTER_BIN", raising=False)
    installed = tmp_path / ".bench-venv" / "bin" / "vllm-router"
    installed.parent.mkdir(parents=True)
    installed.touch()
    monkeypatch.setattr(overhead, "REPO", tmp_path)
    assert overhead._default_vllm_router_bin() == str(installed)
