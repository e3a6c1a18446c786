"""Event-loop lag: how much later than asked this process's event loop runs its timers.

A task sleeps ``interval_s`` again and again and records how late it woke. When the loop is
saturated (a burst of thousands of requests on a shared core), every timer fires late and at
once, an upstream connect or a health probe included: the time such a timeout measured is the
gateway's own delay, not the engine's. :meth:`LoopLag.excuses` tells the cluster so, and it does
not eject an engine for a timeout the loop's lag explains (a refused or reset connection still
ejects at once). Bounded: one slot per beat over ``window_s``.
"""

from __future__ import annotations

import asyncio
from collections import deque

from gateway.service.tasks import cancel_and_wait


class LoopLag:
    """Beats every ``interval_s``; :meth:`late` is the worst lateness over the last ``window_s``
    (or the current one, when the next beat is overdue)."""

    def __init__(self, interval_s: float = 0.05, window_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self._beats: deque[tuple[float, float]] = deque(maxlen=max(1, int(window_s / interval_s) + 1))
        self._last: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.excused = 0
        """Timeouts :meth:`excuses` attributed to the loop's lag (a counter, for tests and logs)."""

    def late(self, now: float | None = None) -> float:
        """Seconds the loop ran late recently (0 before the first beat)."""
        if self._last is None:
            return 0.0
        if now is None:
            now = asyncio.get_running_loop().time()
        worst = max(0.0, now - self._last - self.interval_s)  # the beat due now has not run yet
        for at, lateness in self._beats:
            if now - at <= self.window_s and lateness > worst:
                worst = lateness
        return worst

    def excuses(self, timeout_s: float) -> bool:
        """Did the loop lag enough lately (half of ``timeout_s``) to explain a timeout of
        ``timeout_s``? Counts the ones it excuses."""
        if self._task is None or self.late() < timeout_s / 2:
            return False
        self.excused += 1
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        while True:
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self._beats.append((now, max(0.0, now - self._last - self.interval_s)))
            self._last = now

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
