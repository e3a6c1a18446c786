"""The harness-client helper: pins shared with scripts/setup.sh, a refused install, offline environments."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from gateway.local import harness
from gateway.local.engines import free_ports
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


# -- `agentgw claude` / `agentgw codex` ------------------------------------------------------------
def test_the_claude_wrapper_sets_url_key_model_and_path_and_keeps_home_and_the_users_choices(
    tmp_path: Path,
) -> None:
    exe = tmp_path / "bin" / "claude"
    user = {"PATH": "/usr/bin", "HOME": "/home/me", "DISABLE_TELEMETRY": "0", "ANTHROPIC_API_KEY": "real"}
    argv, env = harness.client_command("claude", ["-p", "hi"], exe, "http://h:1", "k", "tiny-llama", user)
    assert argv == [str(exe), "-p", "hi"]
    assert env["ANTHROPIC_BASE_URL"] == "http://h:1" and env["ANTHROPIC_API_KEY"] == "k"
    assert env["ANTHROPIC_MODEL"] == "tiny-llama" and env["HOME"] == "/home/me"
    assert env["PATH"] == f"{exe.parent}:/usr/bin"
    assert env["DISABLE_TELEMETRY"] == "0" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    _, env = harness.client_command(
        "claude", ["--model", "other"], exe, "http://h:1", "k", "tiny-llama", user
    )
    assert "ANTHROPIC_MODEL" not in env


def test_the_codex_wrapper_passes_its_provider_as_overrides_before_the_users_arguments(
    tmp_path: Path,
) -> None:
    exe = tmp_path / "bin" / "codex"
    user = {"PATH": "/usr/bin", "HOME": "/home/me"}
    args = ["exec", "--skip-git-repo-check", "hi"]
    argv, env = harness.client_command("codex", args, exe, "http://h:1", "k", "tiny-llama", user)
    assert argv[0] == str(exe) and argv[-3:] == args
    overrides = dict(o.split("=", 1) for o in argv[2:-3:2])
    assert all(flag == "-c" for flag in argv[1:-3:2])
    assert overrides["model_provider"] == '"agentgw"' and overrides["model"] == '"tiny-llama"'
    assert overrides["model_providers.agentgw.base_url"] == '"http://h:1/v1"'
    assert overrides["model_providers.agentgw.wire_api"] == '"responses"'
    assert env["AGENTGW_API_KEY"] == "k" and env["HOME"] == "/home/me"
    argv, _ = harness.client_command("codex", ["exec", "-m", "x", "hi"], exe, "http://h:1", "k", "m", user)
    assert not any(a.startswith("model=") for a in argv)


def test_the_wrappers_say_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    monkeypatch.setenv("AGENTGW_NPM_PREFIX", str(tmp_path / "npm"))
    assert main(["codex", "exec", "hi"]) == 2
    assert "@openai/codex@0.169.0 is not installed" in capsys.readouterr().err
    fake_install(tmp_path / "npm", harness.CLAUDE_CODE_PACKAGE, harness.CLAUDE_CODE_VERSION, "claude")
    port = free_ports(1)[0]  # nothing listens there
    monkeypatch.setenv("AGENTGW_URL", f"http://127.0.0.1:{port}")
    assert main(["claude", "-p", "hi"]) == 1
    assert f"no gateway answers at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_claude_small_model_and_codex_features_and_headers_are_set_when_asked(tmp_path: Path) -> None:
    env = claude_env("http://x", tmp_path / "c", {"PATH": "/bin"}, small_model="tiny-agent")
    assert env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "tiny-agent"
    assert "ANTHROPIC_SMALL_FAST_MODEL" not in claude_env("http://x", tmp_path / "c", {"PATH": "/bin"})
    env = codex_env(
        "http://x/v1", tmp_path / "x", {"PATH": "/bin"}, features=harness.MULTI_AGENT_V1,
        http_headers={"x-session-id": "s-1"},
    )  # fmt: skip
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    assert config["features"] == {"multi_agent": True, "multi_agent_v2": False}
    assert config["model_providers"][harness.PROVIDER]["http_headers"] == {"x-session-id": "s-1"}
