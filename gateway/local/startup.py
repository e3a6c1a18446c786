"""`agentgw serve`'s local engines starting while the gateway already listens.

:class:`EngineStartup` starts the engine processes and waits for them in a thread, saying what it
is doing at least every ``every_s`` seconds (each waiting engine's last log line and where its log
is), and once all are up, where to point an SDK, Claude Code and Codex. If an engine fails (its
process exits, or it is not up after ``timeout_s``), it says why, stops the rest and calls
``on_failure`` (the server then shuts down, and ``agentgw serve`` exits 1). Meanwhile the gateway
answers: ``/health`` 200, ``/ready`` 503 naming the engines it waits for, generation requests 503
with ``Retry-After`` (gateway/service/cluster.py: an engine that never answered is *starting*).

Sync code: threads and the engines' blocking probes, never on the gateway's event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from gateway.local.engines import EngineError, LocalEngine
from gateway.local.harness import DEFAULT_URL, HarnessMissing, harness_clients

__all__ = ["EngineStartup", "where_to_point"]

_POLL_S = 0.5
_LINE_CHARS = 70


def where_to_point(url: str, model: str, logs: Path) -> list[str]:
    """The lines that say how to use a gateway on ``url`` serving ``model``."""
    env = "" if url == DEFAULT_URL else f"AGENTGW_URL={url} "
    try:
        harness_clients()
        install = ""
    except HarnessMissing:
        install = "   (first: ./scripts/setup.sh --harnesses)"
    return [
        f'  OpenAI SDK:  OpenAI(base_url="{url}/v1", api_key="unused"), model "{model}"',
        f'  Claude Code: {env}.venv/bin/agentgw claude -p "hello"{install}',
        f'  Codex:       {env}.venv/bin/agentgw codex exec --skip-git-repo-check "hello"{install}',
        f"  dashboard:   {url}/dashboard   engine logs: {logs}   docs/harnesses.md",
    ]


class EngineStartup:
    """Start ``engines`` (not started yet) and wait for them in a thread; see the module doc."""

    def __init__(
        self,
        engines: Sequence[LocalEngine],
        say: Callable[[str], None],
        ready_lines: Sequence[str] = (),
        every_s: float = 10.0,
        timeout_s: float = 600.0,
    ) -> None:
        self.engines = list(engines)
        self.say = say
        self.ready_lines = list(ready_lines)
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.on_failure: Callable[[], None] = lambda: None
        self._stopping = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._wait, name="engine-startup", daemon=True)

    def start(self) -> None:
        """Start every engine process (raises EngineError if one cannot be started) and the
        thread that waits for them."""
        self._t0 = time.monotonic()
        for engine in self.engines:
            engine.start()
        self._thread.start()

    def stop(self) -> None:
        """The gateway is stopping: the waiter ends without reporting the engines it stops."""
        self._stopping.set()
        self._thread.join(timeout=5)

    def _wait(self) -> None:
        try:
            self._wait_all()
        except BaseException as exc:
            if self._stopping.is_set():
                return
            self.error = exc
            self.say(f"an engine failed to start: {exc}")
            self.on_failure()

    def _wait_all(self) -> None:
        pending = list(self.engines)
        next_note = self._t0 + self.every_s
        deadline = self._t0 + self.timeout_s
        while pending and not self._stopping.is_set():
            for engine in list(pending):
                if engine.ready_now():
                    pending.remove(engine)
                    self.say(f"{engine.spec.name} is up ({self._elapsed()} s)")
            now = time.monotonic()
            if pending and now >= deadline:
                raise EngineError(
                    f"{', '.join(e.spec.name for e in pending)} not up after {self.timeout_s:.0f} s; "
                    f"see {pending[0].spec.log_path}:\n{pending[0].failure_log()}"
                )
            if pending and now >= next_note:
                next_note = now + self.every_s
                self.say(self._progress(pending))
            if pending:
                self._stopping.wait(_POLL_S)
        if not pending and not self._stopping.is_set():
            self.ready.set()
            n = len(self.engines)
            self.say(f"ready in {self._elapsed()} s ({n} engine{'s' if n != 1 else ''}):")
            for line in self.ready_lines:
                self.say(line)

    def _elapsed(self) -> int:
        return round(time.monotonic() - self._t0)

    def _progress(self, pending: list[LocalEngine]) -> str:
        """One line: how long, how many are up, each waiting engine's last log line, the logs."""
        up = len(self.engines) - len(pending)
        doing = "; ".join(f"{e.spec.name}: {_clip(e.last_log_line() or 'starting')}" for e in pending)
        logs = _logs_of(pending)
        return f"engines starting ({self._elapsed()} s, {up} of {len(self.engines)} up; {doing}; logs {logs})"


def _clip(text: str) -> str:
    return text if len(text) <= _LINE_CHARS else text[: _LINE_CHARS - 3] + "..."


def _logs_of(engines: Sequence[LocalEngine]) -> str:
    folders = {e.spec.log_path.parent for e in engines}
    if len(folders) == 1:
        return str(folders.pop() / "<engine>.log")
    return ", ".join(str(e.spec.log_path) for e in engines)
