"""The real coding-agent clients that scripts/setup.sh installs (gateway.local.harness) run against one
local engine as it starts by default (tool calling on): `claude -p` posts Anthropic Messages with
12 tools, `codex exec` posts Responses with 9 tools; each exits 0 with an answer printed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.local.engines import LocalEngine
from gateway.local.harness import claude_argv, claude_env, codex_argv, codex_env, harness_clients
from tests.conftest import MODEL, engine_metric

pytestmark = pytest.mark.engine

TIMEOUT_S = 300


def run(argv: list[str], env: dict[str, str], home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=home, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_claude_code_and_codex_complete_a_prompt_against_one_engine(
    cluster: dict[str, LocalEngine], tmp_path: Path
) -> None:
    clients = harness_clients()  # refuses a missing or differently versioned install
    engine = cluster["warm1"]
    prompts_before = engine_metric(engine.url, "vllm:prompt_tokens_total")

    home = tmp_path / "claude"
    claude = run(claude_argv(clients, "say hello", MODEL), claude_env(engine.url, home), home)
    assert claude.returncode == 0, claude.stderr[-2000:]
    assert claude.stdout.strip()

    home = tmp_path / "codex"
    codex = run(codex_argv(clients, "say hello", MODEL), codex_env(engine.url + "/v1", home), home)
    assert codex.returncode == 0, codex.stderr[-2000:]
    assert codex.stdout.strip()

    # both sent their full agent prompts (system text and tool schemas: thousands of tokens each)
    assert engine_metric(engine.url, "vllm:prompt_tokens_total") - prompts_before > 2 * 5000
