"""The real coding-agent clients, Claude Code and Codex CLI, as `scripts/setup.sh` installs them.

Setup installs the npm packages at the pinned versions below into `.agentgw/npm` (git-ignored;
`AGENTGW_NPM_PREFIX` overrides). `harness_clients()` returns the two executables, refusing a
missing or differently versioned install. `claude_env()` and `codex_env()` give each client an
environment that talks only to `base_url` (a gateway or one vLLM engine on loopback): its own
home folder, telemetry, error reporting and update checks off. `claude_argv()` / `codex_argv()`
build the non-interactive commands (`claude -p`, `codex exec`); run them with `cwd=home`.

    clients = harness_clients()
    env = claude_env("http://127.0.0.1:8000", home)
    subprocess.run(claude_argv(clients, "say hello", "tiny-llama"), env=env, cwd=home, timeout=300)

`agentgw claude ARGS...` / `agentgw codex ARGS...` (:func:`run_client`) run the installed client
against a running gateway (``AGENTGW_URL``, default ``http://127.0.0.1:8000``) in the user's own
working folder and HOME: base URL, key (``AGENTGW_API_KEY``, else ``unused``), the gateway's model
and ``PATH`` set for that one process (Codex through ``-c`` overrides, so ``~/.codex/config.toml``
is not touched).

Sync stdlib only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = [
    "CLAUDE_CODE_PACKAGE",
    "CLAUDE_CODE_VERSION",
    "CODEX_PACKAGE",
    "CODEX_VERSION",
    "DEFAULT_URL",
    "MULTI_AGENT_V1",
    "GatewayUnavailable",
    "HarnessClients",
    "HarnessMissing",
    "claude_argv",
    "claude_env",
    "client_command",
    "codex_argv",
    "codex_env",
    "gateway_url",
    "harness_clients",
    "npm_prefix",
    "run_client",
    "served_model",
]

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.328"
CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.169.0"

MULTI_AGENT_V1 = {"multi_agent": True, "multi_agent_v2": False}
"""Codex 0.169's feature flags for its v1 subagent tools (`multi_agent_v1__spawn_agent`,
`..._wait_agent`, ...), pinned: `multi_agent` is on by default but deprecated, v2 off by default."""

_REPO = Path(__file__).resolve().parents[2]
PROVIDER = "agentgw"  # the Codex model provider written by codex_env()


class HarnessMissing(FileNotFoundError):
    """A client is not installed, or not at the pinned version."""


@dataclass(frozen=True)
class HarnessClients:
    claude: Path
    codex: Path


def npm_prefix() -> Path:
    """Where setup installs the clients."""
    return Path(os.environ.get("AGENTGW_NPM_PREFIX", _REPO / ".agentgw" / "npm"))


class GatewayUnavailable(RuntimeError):
    """No gateway answers at the URL, or it serves no model yet."""


DEFAULT_URL = "http://127.0.0.1:8000"


def _installed(prefix: Path, package: str, version: str, command: str) -> Path:
    manifest = prefix / "node_modules" / package / "package.json"
    exe = prefix / "node_modules" / ".bin" / command
    try:
        found = json.loads(manifest.read_text(encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError):
        found = None
    if found != version or not os.access(exe, os.X_OK):
        raise HarnessMissing(
            f"{package}@{version} is not installed in {prefix} (found {found or 'nothing'}): "
            "run ./scripts/setup.sh --harnesses"
        )
    return exe


def harness_clients(prefix: Path | None = None) -> HarnessClients:
    """The `claude` and `codex` executables at the pinned versions; HarnessMissing otherwise."""
    prefix = npm_prefix() if prefix is None else prefix
    return HarnessClients(
        claude=_installed(prefix, CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION, "claude"),
        codex=_installed(prefix, CODEX_PACKAGE, CODEX_VERSION, "codex"),
    )


def _offline_base(home: Path, base: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "CLAUDE_"))]:
        del env[key]  # nothing of the caller's own accounts or settings leaks in
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "DO_NOT_TRACK": "1", "NO_COLOR": "1"}
    return env


def claude_env(
    base_url: str,
    home: Path,
    base: Mapping[str, str] | None = None,
    max_output_tokens: int | None = None,
    small_model: str | None = None,
) -> dict[str, str]:
    """Claude Code talking only to `base_url` (the Anthropic API root, without `/v1`).

    `max_output_tokens` replaces its `max_tokens` (32000 by default: a random-weight model rarely
    stops before the context is full). `small_model` maps its small fast model (a Claude Haiku by
    default, which a local gateway does not serve) to a served one."""
    home.mkdir(parents=True, exist_ok=True)
    limit = {} if max_output_tokens is None else {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)}
    if small_model is not None:
        limit |= {"ANTHROPIC_SMALL_FAST_MODEL": small_model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": small_model}
    return (
        _offline_base(home, base)
        | limit
        | {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": "agentgw-local",
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            # off: telemetry, error reporting, /bug, the auto-updater (all of it "nonessential traffic")
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_BUG_COMMAND": "1",
        }
    )


def claude_argv(clients: HarnessClients, prompt: str, model: str, *extra: str) -> list[str]:
    """`claude -p PROMPT --model MODEL` (add `--continue` in `extra` for the next turn)."""
    return [str(clients.claude), "-p", prompt, "--model", model, *extra]


def codex_env(
    base_url: str,
    home: Path,
    base: Mapping[str, str] | None = None,
    features: Mapping[str, bool] | None = None,
    http_headers: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Codex talking only to `base_url` (the OpenAI API root, with `/v1`) over the Responses API.

    Writes `home/.codex/config.toml`: the provider, and analytics, feedback and the update check
    off; `features` pins feature flags (`[features]`), e.g. `MULTI_AGENT_V1` for its subagent tools;
    `http_headers` are sent with every request to the provider.
    """
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    provider = {"name": PROVIDER, "base_url": base_url, "wire_api": "responses", "env_key": "OPENAI_API_KEY"}
    lines = [
        f"model_provider = {json.dumps(PROVIDER)}",
        "check_for_update_on_startup = false",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        f"[model_providers.{PROVIDER}]",
        *(f"{k} = {json.dumps(v)}" for k, v in provider.items()),
        *(
            [
                f"http_headers = {{ {', '.join(f'{json.dumps(k)} = {json.dumps(v)}' for k, v in http_headers.items())} }}"
            ]
            if http_headers
            else []
        ),
        "",
    ]
    if features:
        lines += ["[features]", *(f"{k} = {json.dumps(v)}" for k, v in features.items()), ""]
    (codex_home / "config.toml").write_text("\n".join(lines), encoding="utf-8")
    return _offline_base(home, base) | {"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "agentgw-local"}


def codex_argv(clients: HarnessClients, prompt: str, model: str, *extra: str) -> list[str]:
    """`codex exec --skip-git-repo-check -m MODEL PROMPT` (`extra` goes after `exec`, e.g. `resume --last`)."""
    return [str(clients.codex), "exec", *extra, "--skip-git-repo-check", "-m", model, prompt]


# -- `agentgw claude` / `agentgw codex` ----------------------------------------------------------
def gateway_url(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return (env.get("AGENTGW_URL") or DEFAULT_URL).rstrip("/")


def served_model(url: str, key: str, timeout_s: float = 10.0) -> str:
    """The first model the gateway at ``url`` serves now (``GET /v1/models``)."""
    try:
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s)
        r.raise_for_status()
        models = [m["id"] for m in json.loads(r.content)["data"]]
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as exc:
        raise GatewayUnavailable(
            f"no gateway answers at {url} ({exc}); start one with ./scripts/run.sh, or set AGENTGW_URL"
        ) from None
    if not models:
        raise GatewayUnavailable(
            f"the gateway at {url} serves no model yet: its engines are starting (GET {url}/ready)"
        )
    return str(models[0])


def _has_option(args: list[str], *names: str) -> bool:
    return any(a in names or a.startswith(tuple(f"{n}=" for n in names)) for a in args)


_QUIET = {
    # the gateway is local: no telemetry, error reports or update checks to the vendor
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
}


def client_command(
    name: str,
    args: list[str],
    exe: Path,
    url: str,
    key: str,
    model: str,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run client ``name`` (claude | codex) with ``args``
    against the gateway at ``url``; the caller's own variables are kept except those set here
    (the user's settings of the quiet switches win)."""
    env = dict(os.environ if environ is None else environ)
    env["PATH"] = f"{exe.parent}{os.pathsep}{env.get('PATH', '/usr/local/bin:/usr/bin:/bin')}"
    if name == "claude":
        env |= {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key}
        if not _has_option(args, "--model") and not env.get("ANTHROPIC_MODEL"):
            env["ANTHROPIC_MODEL"] = model
        for k, v in _QUIET.items():
            env.setdefault(k, v)
        return [str(exe), *args], env
    if name != "codex":
        raise ValueError(f"unknown client {name!r}")
    p = f"model_providers.{PROVIDER}"
    overrides = [
        f'model_provider="{PROVIDER}"',
        f'{p}.name="{PROVIDER}"',
        f"{p}.base_url={json.dumps(url + '/v1')}",
        f'{p}.wire_api="responses"',
        f'{p}.env_key="AGENTGW_API_KEY"',
        "analytics.enabled=false",
        "feedback.enabled=false",
        "check_for_update_on_startup=false",
    ]
    if not _has_option(args, "-m", "--model"):
        overrides.append(f"model={json.dumps(model)}")
    env["AGENTGW_API_KEY"] = key
    return [str(exe), *(a for o in overrides for a in ("-c", o)), *args], env


def run_client(name: str, args: list[str]) -> int:
    """`agentgw claude|codex ARGS...`: replace this process with the client (see the module doc);
    a missing install or gateway is a one-line message and exit status 2 or 1."""
    import sys

    package, version = (
        (CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION) if name == "claude" else (CODEX_PACKAGE, CODEX_VERSION)
    )
    try:
        exe = _installed(npm_prefix(), package, version, name)
    except HarnessMissing as exc:
        print(f"agentgw {name}: {exc}", file=sys.stderr)
        return 2
    url = gateway_url()
    key = os.environ.get("AGENTGW_API_KEY") or "unused"
    try:
        model = served_model(url, key)
    except GatewayUnavailable as exc:
        print(f"agentgw {name}: {exc}", file=sys.stderr)
        return 1
    argv, env = client_command(name, args, exe, url, key, model)
    os.execve(argv[0], argv, env)
    return 0  # not reached
