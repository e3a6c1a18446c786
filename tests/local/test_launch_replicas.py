"""docker-compose.yml's replicas profile: deploy/launch.py's ``gateway INDEX`` (its own port, keys
required) and ``balancer`` (a real nginx over the replicas, as testing/replicas.py
configures it)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.local.engines import free_ports
from testing.net import wait_http_ok
from tests.local.test_layout import ROOT, compose, launch_module


def test_compose_runs_three_replicas_behind_a_balancer() -> None:
    services = compose()["services"]
    replicas = {n: s for n, s in services.items() if "replicas" in s.get("profiles", []) and n != "balancer"}
    assert sorted(s["command"] for s in replicas.values()) == [["gateway", str(i)] for i in range(3)]
    assert (
        services["balancer"]["command"] == ["balancer"]
        and services["balancer"]["environment"]["REPLICAS"] == "3"
    )


def test_a_replica_listens_on_its_port_and_requires_a_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    launch = launch_module()
    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(launch, "HEALTH_FILE", tmp_path / "health")
    ran: list[list[str]] = []
    monkeypatch.setattr(launch, "_exec", lambda cmd, env=None: ran.append(cmd))
    monkeypatch.setenv("REPLICA_PORT_BASE", "9100")
    monkeypatch.delenv("API_KEY", raising=False)
    with pytest.raises(SystemExit, match="API_KEY"):
        launch.run_gateway(launch.Layout.from_env(), 2)
    monkeypatch.setenv("API_KEY", "k")
    launch.run_gateway(launch.Layout.from_env(), 2)
    config: dict[str, Any] = yaml.safe_load((tmp_path / "agentgw-compose.yaml").read_text())
    assert config["listen"]["port"] == 9102
    assert config["auth"] == {"tenants": [{"name": "default", "key_env": ["API_KEY"]}]}
    assert ran and ran[0][:2] == ["agentgw", "serve"]


def test_an_engine_gets_its_control_token_through_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """compose's engines: the launcher put the control token in ``--kv-transfer-config``, in the
    engine's arguments, readable by every local user from /proc/<pid>/cmdline. Now it goes in the
    engine's environment; the gateway's config file, which holds it, is readable by its user only."""
    launch = launch_module()
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text("{}")
    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(launch, "HEALTH_FILE", tmp_path / "health")
    ran: list[tuple[list[str], dict[str, str] | None]] = []
    monkeypatch.setattr(launch, "_exec", lambda cmd, env=None: ran.append((cmd, env)))
    monkeypatch.setenv("MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("CONTROL_TOKEN", "tok-4f3a9")
    monkeypatch.setenv("ENGINES", "2")
    layout = launch.Layout.from_env()
    launch.run_engine(layout, layout.engine_names[0])
    (cmd, env) = ran[-1]
    assert not any("tok-4f3a9" in a for a in cmd), cmd
    assert env is not None and env["AGENTGW_CONTROL_TOKEN"] == "tok-4f3a9"
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["control_port"] > 0
    launch.run_gateway(layout)
    path = tmp_path / "agentgw-compose.yaml"
    assert path.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(path.read_text())["migration"]["control_token"] == "tok-4f3a9"


def _adjacent_free_ports() -> int:
    """A port P with P and P + 1 free (the replicas are REPLICA_PORT_BASE + i)."""
    for _ in range(100):
        p = free_ports(1)[0]
        with socket.socket() as s1, socket.socket() as s2:
            try:
                s1.bind(("127.0.0.1", p))
                s2.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two adjacent free ports")


def test_the_balancer_spreads_requests_over_the_replicas(tmp_path: Path) -> None:
    base, port = _adjacent_free_ports(), free_ports(1)[0]
    stand_ins = [
        subprocess.Popen(
            [sys.executable, "-m", "testing.fake_engine", "--port", str(base + i), "--model", "m"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(2)
    ]
    env = {
        "PATH": "/usr/sbin:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "TMPDIR": str(tmp_path),
        "REPLICAS": "2",
        "REPLICA_PORT_BASE": str(base),
        "BALANCER_PORT": str(port),
    }
    proc = subprocess.Popen([sys.executable, str(ROOT / "deploy" / "launch.py"), "balancer"], env=env)
    try:
        for u in [f"http://127.0.0.1:{base + i}/health" for i in range(2)] + [
            f"http://127.0.0.1:{port}/health"
        ]:
            wait_http_ok(u, 10)
        seen = {
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).headers["x-upstream-addr"]
            for _ in range(6)
        }
        assert seen == {f"127.0.0.1:{base + i}" for i in range(2)}
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(10)
        for p in stand_ins:
            p.terminate()
            p.wait(10)
