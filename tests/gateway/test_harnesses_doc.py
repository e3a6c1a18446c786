"""docs/harnesses.md runs: its bash blocks (Claude Code, Codex, curl) with bash in one scratch home
folder, the real clients on the PATH; its Python blocks (the OpenAI and Anthropic SDKs) in one
namespace; all in document order against a real gateway. Each harness's requests reach the
gateway (its request counter per route) and answer 2xx."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from gateway.local.harness import harness_clients
from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "harnesses.md"
_COUNTER = re.compile(r"^agentgw_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.M)


def requests_ok(url: str) -> dict[str, float]:
    """The gateway's 2xx requests per route."""
    out: dict[str, float] = {}
    for labels, value in _COUNTER.findall(httpx.get(url + "/metrics", timeout=10).text):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("status", "").startswith("2"):
            out[fields["route"]] = out.get(fields["route"], 0.0) + float(value)
    return out


def test_harnesses_doc_commands_run(gateway: ServedGateway, tmp_path: Path) -> None:
    blocks = re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), flags=re.S)
    assert [lang for lang, _ in blocks].count("bash") >= 3 and len(blocks) >= 6
    bin_dir = harness_clients().claude.parent  # refuses a missing or differently versioned install
    home = tmp_path / "home"
    home.mkdir()
    # none of this machine's accounts or settings: the doc's own exports configure the clients
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "CLAUDE_"))
    }
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "DO_NOT_TRACK": "1", "NO_COLOR": "1"}
    env |= {"BASE_URL": gateway.url, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"}
    namespace: dict[str, object] = {"BASE_URL": gateway.url}
    before = requests_ok(gateway.url)
    for i, (lang, code) in enumerate(blocks):
        where = f"{DOC.name}[block {i}, {lang}]"
        if lang == "python":
            exec(compile(code, where, "exec"), namespace)
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            env=env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{where}: {done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        assert done.stdout.strip(), f"{where} printed nothing"
    after = requests_ok(gateway.url)
    grew = {route: after.get(route, 0.0) - before.get(route, 0.0) for route in after}
    # two turns each of Claude Code and Codex, the chat harness's two, the SDKs' own
    assert grew.get("/v1/messages", 0) >= 2 + 2, grew
    assert grew.get("/v1/responses", 0) >= 2 + 3, grew
    assert grew.get("/v1/chat/completions", 0) >= 2, grew
