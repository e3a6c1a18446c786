"""Graceful shutdown: what the gateway does between SIGTERM and exiting.

On SIGTERM (:class:`gateway.api.server.GatewayServer`) the drain *begins*: the listener stays
open, but every new request gets a 503 ``shutting_down`` with ``Retry-After`` in its API's error
shape (and ``connection: close``), ``/ready`` a 503 saying ``draining``, ``/health`` still 200.
The requests in flight (each a :class:`Flight`) may finish until ``drain.deadline_s`` after the
signal; then each one left is *cut*: a started stream ends with its API's error event (Chat and
Completions: an error chunk then ``data: [DONE]``; Messages: ``event: error``; Responses:
``response.failed``), a request not answered yet gets the 503. Then uvicorn closes the listener
and the connections, the lifespan stops the services, and the process exits (0). A second
SIGTERM (or SIGINT) cuts at once.

Only the generation routes are flights (the session and admin routes are short).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.api.errors import ApiError

log = logging.getLogger("agentgw.drain")

CUT_GRACE_S = 5.0
"""After the cut, how long the cut requests get to write their error events."""


class Flight:
    """One generation request in flight: its task, and whether the drain cut it."""

    __slots__ = ("cut", "responded", "task")

    def __init__(self, task: asyncio.Task[object] | None) -> None:
        self.task = task
        self.cut = False
        self.responded = False
        """The response's status line was sent (a cut then ends the body, never sends a new one)."""


class Drain:
    def __init__(
        self, deadline_s: float, retry_after_s: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.deadline_s = deadline_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.draining = False
        self.hurry = False
        """A second signal: cut now."""
        self.began_at: float | None = None
        self.flights: set[Flight] = set()
        self.finished = 0
        """Flights that ended by themselves while draining."""
        self.cut = 0

    # -- requests ---------------------------------------------------------------------------------
    def enter(self) -> Flight:
        f = Flight(asyncio.current_task())
        self.flights.add(f)
        return f

    def leave(self, f: Flight) -> None:
        self.flights.discard(f)
        if self.draining and not f.cut:
            self.finished += 1

    def error(self) -> ApiError:
        """What a request gets while draining, or when the deadline cut it before its answer."""
        return ApiError(
            503, "the gateway is shutting down; retry", None, "shutting_down", retry_after=self.retry_after_s
        )

    def stream_message(self) -> str:
        return f"the gateway is shutting down: the drain deadline of {self.deadline_s:g} s passed"

    # -- shutdown ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start draining (safe in a signal handler: attribute writes only). A second call hurries."""
        if self.draining:
            self.hurry = True
            return
        self.draining = True
        self.began_at = self.clock()

    async def run(self, poll_s: float = 0.05) -> int:
        """Wait for the flights until the deadline, cut the ones left, give them
        :data:`CUT_GRACE_S` to write their error events; returns how many were cut."""
        if not self.draining:
            self.begin()
        assert self.began_at is not None
        deadline = self.began_at + self.deadline_s
        if self.flights:
            log.warning("drain: %d request(s) in flight; deadline %g s", len(self.flights), self.deadline_s)
        while self.flights and not self.hurry and self.clock() < deadline:
            await asyncio.sleep(poll_s)
        left = [f for f in self.flights if f.task is not None and not f.task.done()]
        for f in left:
            f.cut = True
            assert f.task is not None
            f.task.cancel()
        self.cut += len(left)
        grace = self.clock() + CUT_GRACE_S
        while self.flights and self.clock() < grace:
            await asyncio.sleep(poll_s)
        log.warning("drain: %d request(s) finished, %d cut at the deadline", self.finished, len(left))
        return len(left)
