"""docs/harnesses.md runs: its bash blocks (Claude Code, Codex, curl) with bash in one scratch home
folder, the real clients on the PATH; its Python blocks (the OpenAI and Anthropic SDKs) in one
namespace; all in document order against a real gateway. Each harness's requests reach the
gateway (its request counter per route) and answer 2xx.

The counters are read once every request has left the gateway: the relay counts a request after
it has sent the last byte of the answer (``gateway/api/relay.py``, in its ``finally``), so a client
that has read its whole answer can be faster than the count. A request gives its admission slot
back only after it is counted, so ``agentgw_admission_inflight`` at 0 (every client here has read
its answer, so every request has started) is the event that says all are counted. Reading the
counters straight after the last block raced with the last request's count (CI, stop 16:
"/v1/responses 2xx count 4 < 5")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.local.harness import harness_clients
from tests.conftest import ServedGateway

pytestmark = pytest.mark.engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "harnesses.md"
_COUNTER = re.compile(r"^agentgw_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.M)
_INFLIGHT = re.compile(r"^agentgw_admission_inflight ([0-9.e+]+)$", re.M)
#: Polls of /metrics before giving up on requests leaving the gateway (a stuck one fails the test).
MAX_POLLS = 600


def requests_done(url: str) -> dict[tuple[str, str], float]:
    """The gateway's requests per (route, status), once no request holds an admission slot (each
    is counted before it gives its slot back)."""
    for _ in range(MAX_POLLS):
        text = httpx.get(url + "/metrics", timeout=10).text
        m = _INFLIGHT.search(text)
        assert m is not None, "agentgw_admission_inflight is missing from /metrics"
        if float(m.group(1)) == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"requests still in the gateway after {MAX_POLLS} polls")
    out: dict[tuple[str, str], float] = {}
    for labels, value in _COUNTER.findall(text):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = (fields.get("route", ""), fields.get("status", ""))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def test_harnesses_doc_commands_run(
    gateway: ServedGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block as written; what the doc tells a user to set is all that is set: `.venv/bin`
    (where `agentgw` is) on the PATH and AGENTGW_URL (the gateway is not on port 8000 here)."""
    blocks = re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), flags=re.S)
    assert [lang for lang, _ in blocks].count("bash") >= 3 and len(blocks) >= 6
    harness_clients()  # refuses a missing or differently versioned install (setup.sh --harnesses)
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "agentgw").exists(), f"no agentgw in {venv_bin}"
    home = tmp_path / "home"
    home.mkdir()
    # none of this machine's accounts or settings: the doc's own commands configure the clients
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "CLAUDE_", "AGENTGW_"))
    }
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "DO_NOT_TRACK": "1", "NO_COLOR": "1"}
    env |= {"AGENTGW_URL": gateway.url, "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"}
    namespace: dict[str, object] = {}
    monkeypatch.setenv("AGENTGW_URL", gateway.url)  # the Python blocks read it as a user's shell has it
    before = requests_done(gateway.url)
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
    after = requests_done(gateway.url)
    grew = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}

    print("requests that grew, by (route, status):", grew)

    def ok(route: str) -> float:
        return sum(n for (r, status), n in grew.items() if r == route and status.startswith("2"))

    # two turns each of Claude Code and Codex, the chat harness's two, the SDKs' own (every
    # (route, status) that grew is in the message: a 499 would be a client that left early)
    assert ok("/v1/messages") >= 2 + 2, grew
    assert ok("/v1/responses") >= 2 + 3, grew
    assert ok("/v1/chat/completions") >= 2, grew
