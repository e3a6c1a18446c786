"""vLLM schedulers with device soft pins (`--scheduler-cls engine_ext.scheduler.PinningScheduler`).

`PinningScheduler` is vLLM's `Scheduler` plus an `engine_ext.device_pins.DevicePins` on its
block pool; `AsyncPinningScheduler` is the same on vLLM's `AsyncScheduler`, the one to load on
GPUs (async scheduling stays on; the CPU platform turns async scheduling off, so only the
synchronous one runs on the CPU engines here). What they add, all on the engine-core thread:

- at a request's end (`_free_request`), the request's cached blocks are recorded under its
  session (`kv_transfer_params.agentgw.session_id`); `pin_ttl_s > 0` pins them until then,
  `pin_ttl_s == 0` releases the pin, `release: true` ends the session (pin and record);
- `kv_cache_manager.allocate_slots` is wrapped on this instance: when it finds no room, the
  oldest pin yields and it retries, so pins go before vLLM preempts a running request;
- `schedule()` first applies the control API's queued commands and expires pins;
- `reset_prefix_cache()` releases every pin first (vLLM's reset needs every block free).

Parameters, from `kv_connector_extra_config` (none needed): `device_pin_fraction` (default 0.5,
the bound on distinct pinned blocks as a fraction of the device cache), `device_pin_sessions`
(default 4096), `control_port` (the engine_ext control server to attach to; see
engine_ext.control). docs/engine_ext.md lists every vLLM internal used here; the test
tests/engine_ext/test_device_pins_surface.py checks them against the installed vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from engine_ext.device_pins import DevicePins
from engine_ext.pins import parse_pin_hint

__all__ = ["AsyncPinningScheduler", "PinningScheduler", "pin_settings"]

DEFAULT_PIN_FRACTION = 0.5


def pin_settings(extra: dict[str, Any] | None, num_gpu_blocks: int) -> tuple[int, int]:
    """(max pinned blocks, max pinned sessions) from kv_connector_extra_config."""
    extra = extra or {}
    fraction = float(extra.get("device_pin_fraction", DEFAULT_PIN_FRACTION))
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"device_pin_fraction must be in [0, 1], got {fraction}")
    sessions = int(extra.get("device_pin_sessions", 4096))
    if sessions < 1:
        raise ValueError(f"device_pin_sessions must be >= 1, got {sessions}")
    return int(fraction * max(0, num_gpu_blocks - 1)), sessions


class PinningScheduler(Scheduler):
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kv = self.vllm_config.kv_transfer_config
        extra = dict(kv.kv_connector_extra_config) if kv is not None else {}
        pool = self.kv_cache_manager.block_pool
        max_blocks, max_sessions = pin_settings(extra, pool.num_gpu_blocks)
        self.device_pins = DevicePins(pool, max_blocks, max_sessions)
        self._wrap_allocate_slots()
        if extra.get("control_port") is not None:
            from engine_ext.control import service_on

            service = service_on(int(extra["control_port"]))
            if service is not None:
                service.attach_device(self.device_pins, self.clock)

    def _wrap_allocate_slots(self) -> None:
        """Make pins yield, oldest first, before `allocate_slots` reports no room.

        vLLM preempts a running request when `allocate_slots` returns None (inside
        `schedule()`); retrying after each released pin means a pin never costs a preemption
        nor keeps a waiting request out.
        """
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots
        pins = self.device_pins

        def allocate_slots(*args: Any, **kwargs: Any) -> Any:
            while True:
                blocks = allocate(*args, **kwargs)
                if blocks is not None or not pins.release_oldest():
                    return blocks

        manager.allocate_slots = allocate_slots  # type: ignore[method-assign]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.device_pins.apply_commands()
        self.device_pins.expire(self.clock())
        return super().schedule(*args, **kwargs)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        hint = parse_pin_hint(request.kv_transfer_params)
        if hint is not None:
            pins = self.device_pins
            if hint.release:
                pins.forget(hint.session_id)
            else:
                # before the request lets go of its blocks, so there is no window to evict them
                groups = self.kv_cache_manager.get_blocks(request.request_id).blocks
                pins.finished(hint.session_id, groups, hint.ttl_s, self.clock())
        return super()._free_request(request, *args, **kwargs)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.device_pins.release_all()
        return super().reset_prefix_cache(*args, **kwargs)


class AsyncPinningScheduler(PinningScheduler, AsyncScheduler):
    """`PinningScheduler` over vLLM's `AsyncScheduler` (GPUs, async scheduling on)."""
