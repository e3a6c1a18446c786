"""The harness-client helper: pins shared with scripts/setup.sh, a refused install, offline environments."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from gateway.local import harness
from gateway.local.harness import HarnessMissing, claude_env, codex_env, harness_clients

REPO = Path(__file__).resolve().parents[2]


def test_setup_installs_the_versions_the_helper_pins() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert re.search(rf"^CLAUDE_CODE_VERSION={re.escape(harness.CLAUDE_CODE_VERSION)}$", setup, re.M)
    assert re.search(rf"^CODEX_VERSION={re.escape(harness.CODEX_VERSION)}$", setup, re.M)


def fake_install(prefix: Path, package: str, version: str, command: str) -> None:
    pkg = prefix / "node_modules" / package
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"name": package, "version": version}))
    exe = prefix / "node_modules" / ".bin" / command
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)


def test_a_missing_or_other_version_is_refused_with_the_setup_hint(tmp_path: Path) -> None:
    with pytest.raises(HarnessMissing, match=r"@anthropic-ai/claude-code@.*setup\.sh"):
        harness_clients(tmp_path)
    fake_install(tmp_path, harness.CLAUDE_CODE_PACKAGE, harness.CLAUDE_CODE_VERSION, "claude")
    fake_install(tmp_path, harness.CODEX_PACKAGE, "0.1.0", "codex")
    with pytest.raises(HarnessMissing, match=r"found 0\.1\.0"):
        harness_clients(tmp_path)


def test_environments_point_at_the_base_url_with_their_own_home_and_nothing_phoning_home(
    tmp_path: Path,
) -> None:
    base = {"PATH": "/bin", "ANTHROPIC_AUTH_TOKEN": "mine", "OPENAI_BASE_URL": "https://elsewhere"}
    env = claude_env("http://127.0.0.1:9", tmp_path / "c", base)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and env["HOME"] == str(tmp_path / "c")
    assert "ANTHROPIC_AUTH_TOKEN" not in env and env["PATH"] == "/bin"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["DISABLE_TELEMETRY"] == "1"
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in env
    assert (
        claude_env("http://x", tmp_path / "c", base, max_output_tokens=64)["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]
        == "64"
    )

    env = codex_env("http://127.0.0.1:9/v1", tmp_path / "x", base)
    assert "OPENAI_BASE_URL" not in env and env["OPENAI_API_KEY"]
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    assert config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False} and config["feedback"] == {"enabled": False}
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == "http://127.0.0.1:9/v1" and provider["wire_api"] == "responses"
