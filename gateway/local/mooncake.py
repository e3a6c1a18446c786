"""Start and stop a real ``mooncake_master`` on loopback (tests, benchmarks, local runs).

The master keeps its metadata in memory only: a restart loses every key. Clients need
``MC_TCP_BIND_ADDRESS=127.0.0.1``; ``MooncakeMaster.client_env`` carries it.

``MooncakeStoreNode`` runs Mooncake's standalone ``mooncake_client`` lending a segment to the
store: objects the master places there outlive the engines that wrote them (an engine's own
segment goes with its process, and so do the objects in it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import ClassVar

import httpx

from gateway.local.engines import free_ports


def _terminate(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> None:
    """SIGTERM a started process, SIGKILL it after `grace_s`, and reap it."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MooncakeMaster:
    def __init__(
        self, log_path: Path | None = None, lease_ttl_ms: int = 2000, client_ttl_s: int = 30
    ) -> None:
        """``lease_ttl_ms``: the read lease a get holds on an object; ``client_ttl_s``: how long the
        master keeps a client without a heartbeat before it expires it and unmounts its segment
        (the objects in it are gone). Mooncake's default is 10; 30 here, as in deploy/launch.py:
        on a loaded 2-core machine a live client's heartbeat arrived more than 10 s late."""
        # the store extra installs it next to this interpreter (a venv that need not be activated)
        here = Path(sys.executable).parent / "mooncake_master"
        binary = str(here) if here.exists() else shutil.which("mooncake_master")
        if binary is None:
            raise FileNotFoundError("mooncake_master is not installed (pip install 'agentgw[store]')")
        self.rpc_port, self.metadata_port, self.metrics_port = free_ports(3)
        self._cmd = [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={lease_ttl_ms}",
            f"--client_ttl={client_ttl_s}",
        ]
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    #: Environment a Mooncake client (an engine with the Mooncake tier) needs on loopback.
    #: MC_TRANSFER_TIMEOUT: a batch's deadline (Mooncake's default 60 s). 20 s here, where the
    #: tiny models' batches are small: a store to a peer that never answers then fails before a
    #: gateway's 30 s first-byte timeout on the requests that wait for it (engine_ext.tiers.store).
    client_env: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "MC_STORE_CLIENT_SETUP_RETRIES": "3",
            "MC_TRANSFER_TIMEOUT": "20",
        }
    )

    def start(self, timeout_s: float = 30.0) -> MooncakeMaster:
        out = open(self._log_path, "wb") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(self._cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self._proc.returncode}")
            try:
                url = f"http://127.0.0.1:{self.metrics_port}/health"
                if httpx.get(url, timeout=1, trust_env=False).status_code == 200:
                    return self
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("mooncake_master did not become healthy")

    def stop(self) -> None:
        _terminate(self._proc)
        self._proc = None

    def capacity_bytes(self) -> int:
        """Memory the mounted segments lend the store (the master's ``master_total_capacity_bytes``)."""
        r = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2, trust_env=False)
        r.raise_for_status()
        for line in r.text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return 0

    def kill(self) -> None:
        """SIGKILL the master (a crash: no clean shutdown); ``start()`` brings it back on the same
        ports, with no keys."""
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait()
        self._proc = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class MooncakeStoreNode:
    """A ``mooncake_client`` process lending ``segment_bytes`` of memory to ``master``'s store."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int = 256 << 20, log_path: Path | None = None):
        here = Path(sys.executable).parent / "mooncake_client"
        binary = str(here) if here.exists() else shutil.which("mooncake_client")
        if binary is None:
            raise FileNotFoundError("mooncake_client is not installed (pip install 'agentgw[store]')")
        (port,) = free_ports(1)
        self.master = master
        self.segment_bytes = segment_bytes
        self._cmd = [
            binary,
            f"--master_server_address={master.master_address}",
            f"--metadata_server={master.metadata_server}",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--global_segment_size={segment_bytes // (1 << 20)}MB",
            "--local_buffer_size=0",
            "--protocol=tcp",
        ]
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> MooncakeStoreNode:
        """Start it; ready once the master counts its segment."""
        before = self.master.capacity_bytes()
        out = open(self._log_path, "wb") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            self._cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **MooncakeMaster.client_env},
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mooncake_client exited with {self._proc.returncode}")
            if self.master.capacity_bytes() >= before + self.segment_bytes:
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("mooncake_client's segment was not mounted")

    def stop(self) -> None:
        _terminate(self._proc)
        self._proc = None

    def __enter__(self) -> MooncakeStoreNode:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
