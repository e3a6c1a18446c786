"""Start and stop a real ``redis-server`` on loopback for the gateway's shared session store
(``agentgw serve --sessions redis``): no persistence (sessions are soft state), its own port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from gateway.local.engines import HOST, free_ports

__all__ = ["INSTALL_HINT", "LocalRedis"]

INSTALL_HINT = "apt-get install redis-server (Debian/Ubuntu), or brew install redis"


class LocalRedis:
    def __init__(self, log_path: Path | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(f"redis-server is not installed: {INSTALL_HINT}")
        (self.port,) = free_ports(1)
        self._cmd = [binary, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no"]
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        out = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(self._cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex((HOST, self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError("redis-server did not accept connections")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
