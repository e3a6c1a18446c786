"""Helpers shared by the benchmark scripts: child processes pinned to a core, readiness, /proc reads.

Linux only: CPU time and peak RSS come from ``/proc/PID``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from testing.net import free_port as free_port
from testing.net import wait_http_ok as wait_http_ok

__all__ = [
    "ManagedProcess",
    "cpu_seconds",
    "default_weka_traces",
    "free_port",
    "peak_rss_kib",
    "percentile",
    "pin_prefix",
    "port_is_free",
    "process_tree",
    "wait_http_ok",
]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_REPO = Path(__file__).resolve().parents[1]


def default_weka_traces() -> Path:
    """The Weka trace folder: ``shared/traces/weka`` in the checkout or beside it (all 48 sessions),
    else the 3 sessions vendored for the tests (``tests/data/traces/weka``)."""
    for base in (_REPO / "shared", _REPO.parent / "shared"):
        if (base / "traces" / "weka").is_dir():
            return base / "traces" / "weka"
    return _REPO / "tests" / "data" / "traces" / "weka"


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pin_prefix(core: int | None) -> list[str]:
    """``taskset -c CORE`` when pinning is asked for and possible, else nothing."""
    if core is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(core)]


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants that are alive now."""
    out = [pid]
    i = 0
    while i < len(out):
        p = out[i]
        i += 1
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                out.extend(int(c) for c in task.read_text().split())
    return out


def cpu_seconds(pid: int, descendants: bool = True) -> float:
    """User + system CPU time of ``pid`` and (unless told not to) its live descendants."""
    total = 0
    for p in process_tree(pid) if descendants else [pid]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _CLK_TCK


def peak_rss_kib(pid: int) -> int:
    """Peak resident set size (``VmHWM``) of ``pid`` and its live descendants, summed, in KiB."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
                    break
    return total


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of an ascending list, nearest-rank; NaN when empty."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


class ManagedProcess:
    """A child process with its output in a log file, stopped with SIGTERM then SIGKILL."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        """The server's pid: the child of ``taskset`` (which execs, so the same pid)."""
        return self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, timeout_s: float = 5.0) -> None:
        """Signal the child's own process group (it was started in a new session), then reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
        self._log.close()


def one_pool_config(specs: list[Any], model_dir: Path, block_size: int = 128, **extra: Any) -> dict[str, Any]:
    """A gateway configuration over the local engines of ``specs`` (``EngineSpec``s serving the
    tiny Llama): one pool of every engine with its KV-event endpoint, the model with its
    tokenizer, block size and vLLM's hash seed; ``extra`` adds top-level sections."""
    from gateway.local.engines import HASH_SEED

    engines = [
        {"name": s.name, "url": s.url, "model": "tiny-llama", "kv_events": s.kv_events_endpoint}
        for s in specs
    ]
    return {
        "pools": [{"name": "default", "role": "any", "engines": engines}],
        "models": [
            {
                "name": "tiny-llama",
                "tokenizer": str(model_dir),
                "block_size": block_size,
                "hash_seed": HASH_SEED,
            }
        ],
        **extra,
    }
