"""scripts/setup.sh: what each command installs (its --dry-run lists the parts each option needs:
running installs no test tool) and scripts/progress.sh: a line at least every EVERY seconds
while an install step runs, saying what it does and where its log is; a failed step shows its
log's end and its status."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"

TEST_ONLY = {
    "redis-server",
    "nginx-light",
    "libibverbs1",
    "chromium",
    "chromium-driver",
    "docker.io",
    "docker-compose",
    "debootstrap",
}
HARNESSES = {"nodejs", "npm", "@anthropic-ai/claude-code@2.1.328", "@openai/codex@0.169.0"}


def parts(*options: str) -> dict[str, str]:
    """``setup.sh OPTIONS --dry-run``: part name -> kind (apt, pip, npm)."""
    done = subprocess.run(
        [str(SETUP), *options, "--dry-run"], capture_output=True, text=True, timeout=120, check=True
    )
    out = {}
    for line in done.stdout.splitlines():
        assert line.startswith("setup: "), line
        kind, rest = line.removeprefix("setup: ").split(" ", 1)
        name, state = rest.rsplit(": ", 1)
        assert state in ("present", "missing"), line
        out[name] = kind
    return out


def test_running_installs_only_what_running_needs() -> None:
    run = parts()
    assert run == {
        "python3": "apt",
        "python3-venv": "apt",
        "libnuma1": "apt",
        ".venv: agentgw[engine]": "pip",
    }


def test_harnesses_and_the_test_command_add_their_parts() -> None:
    harnesses = parts("--harnesses")
    assert set(harnesses) == {"python3", "python3-venv", "libnuma1", ".venv: agentgw[engine]"} | HARNESSES
    test = parts("--test")
    assert (
        set(test)
        == {"python3", "python3-venv", "libnuma1", ".venv: agentgw[engine,store,dev]"} | HARNESSES | TEST_ONLY
    )
    assert {n for n, kind in test.items() if kind == "apt"} >= TEST_ONLY


def _step(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    script = (
        f'. scripts/progress.sh; LOGS={tmp_path}/logs EVERY=1; step demo "counting" {command}; echo after'
    )
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_step_says_what_it_does_while_it_runs(tmp_path: Path) -> None:
    done = _step(tmp_path, "bash -c 'for i in 1 2 3 4; do echo line $i; sleep 1; done'")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    log = tmp_path / "logs" / "setup-demo.log"
    assert lines[0] == f"setup: counting (log {log})"
    progress = [line for line in lines if line.startswith("setup: counting: ") and "; line " in line]
    assert len(progress) >= 2, lines  # 4 s of work, a line every second (EVERY=1)
    assert lines[-2].startswith("setup: counting: done in ") and lines[-1] == "after"
    assert log.read_text() == "line 1\nline 2\nline 3\nline 4\n"


def test_a_failed_step_shows_its_log_and_exits_with_its_status(tmp_path: Path) -> None:
    done = _step(tmp_path, "bash -c 'echo the reason; exit 7'")
    assert done.returncode == 7
    assert "after" not in done.stdout
    assert "setup: counting FAILED (exit 7)" in done.stderr and "the reason" in done.stderr
