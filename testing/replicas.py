"""Several gateway replicas behind a real load balancer on loopback, for the tests and benchmarks:
:class:`Nginx` (Debian's nginx 1.22, configured by :func:`gateway.local.balancer.nginx_conf`) in
front of N :class:`GatewayReplica` (``agentgw serve`` processes that share one Redis). Used by
the balancer test (tests/benchmarks/test_balancer.py), the membership test and
``python -m benchmarks.replicas``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.local.balancer import nginx_conf
from gateway.local.engines import free_ports

__all__ = ["GatewayReplica", "Nginx", "nginx_conf"]


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class Nginx:
    """A real nginx (Debian's 1.22) as the replicas' balancer, its files under ``workdir``."""

    def __init__(self, workdir: Path, upstreams: Sequence[str], max_body_bytes: int = 32 << 20) -> None:
        exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
        if exe is None:
            raise FileNotFoundError("nginx is not installed (./scripts/setup.sh installs Debian's)")
        self.exe = exe
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.dir / "nginx.conf"
        self.conf.write_text(
            nginx_conf(f"127.0.0.1:{self.port}", upstreams, max_body_bytes, prefix=str(self.dir))
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def access_log(self) -> Path:
        return self.dir / "access.log"

    def start(self) -> Nginx:
        err = open(self.dir / "stderr.log", "ab")  # noqa: SIM115 (nginx's own output)
        self.proc = subprocess.Popen(
            [
                self.exe,
                "-p",
                str(self.dir),
                "-e",
                str(self.dir / "error.log"),
                "-c",
                str(self.conf),
                "-g",
                "daemon off;",
            ],
            stdout=err,
            stderr=err,
        )
        err.close()
        _wait_port(self.port, 10, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGQUIT)  # graceful: finish what is in flight
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayReplica:
    """One ``agentgw serve`` process on a fixed loopback port (a restart reuses it, as a
    balancer's upstream list expects)."""

    def __init__(
        self,
        name: str,
        config: Mapping[str, Any],
        workdir: Path,
        env: Mapping[str, str] | None = None,
        log_level: str = "warning",
    ) -> None:
        self.name = name
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.addr = f"127.0.0.1:{self.port}"
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / f"{name}.yaml"
        data = dict(config)
        data["listen"] = {"host": "127.0.0.1", "port": self.port}
        # it may hold the control token and keys: readable by this user only
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(data, sort_keys=False))
        self.log_path = self.dir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, wait_ready_s: float = 60.0) -> GatewayReplica:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child's output)
        cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(self.config_path)]
        self.proc = subprocess.Popen(
            [*cmd, "--log-level", self.log_level], stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        self.starts += 1
        _wait_port(self.port, wait_ready_s, self.proc)
        self.wait_ready(wait_ready_s)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                if r.status_code == 200:
                    body: dict[str, Any] = r.json()
                    return body
                last = r.text
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.name} not ready after {timeout_s} s: {last}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop it the hard way (SIGKILL: nothing drains, connections drop) or with ``sig``."""
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""
