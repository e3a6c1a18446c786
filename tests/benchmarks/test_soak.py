"""A short soak (benchmarks/soak.py) in CI: 6 concurrent hinted agent sessions with subagents and
tool gaps, ~24 s, through an `agentgw serve` subprocess in front of 3 stand-in engines, with two
engines SIGKILLed and restarted and the real redis-server stopped and started during the run.
Invariants: no request lost before it started, every cut stream ends with an error event, no 5xx
from the session API, every session idle past the TTL is gone, the gateway's RSS bounded, the
gateway exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_with_engine_kills_and_a_redis_bounce_keeps_the_invariants(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "benchmarks.soak", "--sessions", "6", "--duration", "24"]
    argv += ["--kill-every", "12", "--redis-every", "16", "--ttl", "4", "--json", str(out)]
    r = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert [f["fault"] for f in rep["faults"]] == ["kill engine0", "stop redis", "kill engine1"], rep
    assert rep["failed_before_start"] == 0, rep["reasons"]
    assert rep["cut_silently"] == 0, rep["reasons"]
    assert rep["side_5xx"] == 0, rep["reasons"]
    assert rep["ok"] > 0 and rep["ok"] + rep["cut_with_error"] == rep["requests_sent"], rep
    assert rep["sessions_idle_past_ttl"] > 0 and rep["sessions_past_ttl_still_there"] == 0, rep
    assert rep["rss_start_mib"] and rep["rss_end_mib"] - rep["rss_start_mib"] < 150, rep
    assert rep["gateway_exit"] == 0
    assert rep["violations"] == [] and r.returncode == 0, r.stdout
