"""The overload run's short form in CI (benchmarks/overload.py): three tenants' agent sessions at
1x and 10x a fleet of stand-in engines paced to a fixed capacity, through ``agentgw serve`` with
the tenants' shares. Counters only: nothing accepted is lost, every refusal names when to retry,
the gateway books those retries and serves some that come back at their time, and a 10x load
is refused far more than 1x."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_short_overload_run_refuses_with_honest_retry_times(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    argv = [sys.executable, "-m", "benchmarks.overload", "--capacity-sessions", "12", "--loads", "1,10"]
    argv += ["--duration", "8", "--targets", "agentgw", "--json", str(out)]
    r = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), r.stdout + r.stderr
    runs = json.loads(out.read_text())["runs"]
    (one,), (ten,) = runs["agentgw@1x"], runs["agentgw@10x"]
    for run in (one, ten):
        assert run["failed"] == 0, run  # every attempt was answered or refused, none lost
        assert run["named"] == run["refused"], run  # every refusal said when to come back
    assert ten["refused"] > 10 * max(1, one["refused"]) / 2, (one, ten)
    assert ten["reason_retry_booked"] > 0 and ten["reason_retry_kept"] > 0, ten
    assert ten["goodput"] > 0 and all(ten[f"ratio_{t}"] > 0 for t in ("gold", "silver", "bronze")), ten
    assert "| agentgw | 10x | 120 |" in r.stdout, r.stdout
