"""The chaos run's short form in CI (benchmarks/chaos.py, ``--engines stand-in``): 3 gateway
replicas behind nginx sharing a real redis-server, a real mooncake_master, 3 stand-in engines,
agent sessions with subagents and Responses chains, and the overlapping faults (a replica
SIGKILLed mid-run, Redis restarted empty, an engine paused then resumed, an engine SIGKILLed,
mooncake_master SIGKILLed and restarted). The run's own invariants must hold (exit status 0), and
the report must show every fault hit, recovered from, and traffic through all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]


def test_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    argv = [sys.executable, "-m", "benchmarks.chaos", "--engines", "stand-in", "--duration", "36"]
    argv += ["--repeats", "1", "--json", str(out)]
    r = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert out.exists(), r.stdout + r.stderr
    (run,) = json.loads(out.read_text())["runs"]
    faults = [f["fault"] for f in run["faults"]]
    assert len(faults) == 5 and faults[0].startswith("SIGKILL replica") and "redis" in faults[1], faults
    assert all(f["recover_s"] is not None for f in run["faults"]), run["faults"]
    assert run["ok"] > 0 and run["chain_links"] > run["chains_broken"], run
    assert (
        run["requests_sent"]
        == run["ok"]
        + run["cut_with_error"]
        + run["cut_by_replica_kill"]
        + run["cut_silently"]
        + run["failed_before_start"]
        + run["refused_4xx"]
    ), run
    assert run["violations"] == [] and r.returncode == 0, r.stdout[-3000:]
