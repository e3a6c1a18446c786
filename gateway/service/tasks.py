"""Background tasks of the service: how one is stopped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("agentgw.tasks")


async def cancel_and_wait(task: asyncio.Task[Any] | None, timeout_s: float = 10.0) -> None:
    """Cancel ``task`` (if any) and wait until it has ended; its cancellation is not re-raised
    (an exception it ended with is).

    The cancellation is repeated every 0.1 s until the task ends: on Python 3.11 before 3.12 a
    ``cancel()`` that lands as an ``asyncio.timeout`` inside the task expires (a Redis or HTTP
    call's own timeout) comes out as ``TimeoutError``, which a loop that outlives its failures
    catches and goes on. Past ``timeout_s`` the task is left to end on its own (logged)."""
    if task is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
        if loop.time() > deadline and not task.done():
            log.warning("task %s did not end within %.0f s of its cancellation", task.get_name(), timeout_s)
            return
    if not task.cancelled():
        task.result()  # a failure of the task's own is the caller's to see, as before
