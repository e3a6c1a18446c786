"""Loopback helpers of the tests and benchmarks: a free port, waiting for a server to answer."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request

__all__ = ["free_port", "wait_http_ok"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from below the ephemeral range
    (`gateway.local.engines.free_port`: a bind(0) elsewhere cannot take it before our server binds)."""
    from gateway.local.engines import free_port as pick

    return pick()


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; raise ``RuntimeError`` on timeout or if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered 200")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s (last: {last})")
