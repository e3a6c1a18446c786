"""The vLLM internals engine_ext's pinning scheduler relies on (docs/engine_ext.md, "Device
soft pins"). Each check names what would break; a vLLM upgrade that changes one fails here,
loudly, before an engine quietly stops pinning."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
from vllm.config import SchedulerConfig
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import core as engine_core
from vllm.v1.request import Request

from engine_ext import config
from engine_ext.scheduler import AsyncPinningScheduler, PinningScheduler
from gateway.local.engines import (
    ENGINE_EXT_ASYNC_SCHEDULER,
    ENGINE_EXT_SCHEDULER,
    STOP_GRACE_S,
    EngineSpec,
    engine_command,
)


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def _callable_as(fn: object, *names: str) -> bool:
    """``fn`` takes ``names`` first and needs nothing else (later parameters have defaults): a
    call with just those arguments still means what it did."""
    params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    optional = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params[: len(names)]] == list(names) and all(
        p.default is not inspect.Parameter.empty or p.kind in optional for p in params[len(names) :]
    )


def test_scheduler_methods_we_override_keep_their_signatures() -> None:
    assert _params(Scheduler.schedule) == ["self", "throttle_prefills"]
    assert _params(Scheduler._free_request) == ["self", "request", "delay_free_blocks"]
    assert _params(Scheduler.reset_prefix_cache) == ["self", "reset_running_requests", "reset_connector"]


def test_engine_core_builds_the_scheduler_by_keyword_from_scheduler_cls() -> None:
    src = inspect.getsource(engine_core.EngineCore.__init__)
    assert "get_scheduler_cls()" in src and "vllm_config=vllm_config" in src
    assert "scheduler_cls" in {f.name for f in dataclasses.fields(SchedulerConfig)}
    resolved = SchedulerConfig(
        scheduler_cls=ENGINE_EXT_SCHEDULER, max_model_len=4096, is_encoder_decoder=False
    )
    assert resolved.get_scheduler_cls() is PinningScheduler


def test_schedule_preempts_only_after_allocate_slots_on_the_manager_instance_fails() -> None:
    src = inspect.getsource(Scheduler.schedule)
    # the wrapper on the instance attribute is what both call sites reach
    assert src.count("self.kv_cache_manager.allocate_slots(") == 2
    first_alloc, preempt = (
        src.index("self.kv_cache_manager.allocate_slots("),
        src.index("self._preempt_request("),
    )
    assert first_alloc < preempt
    assert "allocate_slots" in vars(KVCacheManager) and not hasattr(KVCacheManager, "__slots__")


def test_finished_requests_reach_free_request() -> None:
    for fn in (Scheduler.update_from_output, Scheduler.finish_requests):
        assert "self._free_request(" in inspect.getsource(fn), fn.__name__
    assert "reset_prefix_cache()" in inspect.getsource(Scheduler.reset_prefix_cache)


def test_kv_cache_manager_and_block_pool_calls() -> None:
    assert _params(KVCacheManager.get_blocks) == ["self", "request_id"]
    assert "blocks" in {f.name for f in dataclasses.fields(KVCacheBlocks)}
    assert "self.block_pool = " in inspect.getsource(KVCacheManager.__init__)
    assert "self.kv_cache_manager = KVCacheManager(" in inspect.getsource(Scheduler.__init__)
    assert _params(BlockPool.touch) == ["self", "blocks"]
    # vLLM 0.34 added free_blocks(..., evict_first=False); the default keeps the LRU order
    assert _callable_as(BlockPool.free_blocks, "self", "ordered_blocks")
    assert "self.num_gpu_blocks = num_gpu_blocks" in inspect.getsource(BlockPool.__init__)
    # eviction takes only blocks with ref_cnt 0: one reference is what a pin is
    assert "assert block.ref_cnt == 0" in inspect.getsource(BlockPool.get_new_blocks)
    # touching a cached block with ref_cnt 0 takes it out of the free queue and counts the reference
    pool = BlockPool(num_gpu_blocks=3, enable_caching=True, hash_block_size=16)
    (block,) = pool.get_new_blocks(1)
    block.set_block_hash(make_block_hash_with_group_id(b"\x02" * 8, 0))
    pool.free_blocks([block])
    free = pool.get_num_free_blocks()
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == free - 1


def test_block_and_request_fields() -> None:
    fields = {f.name for f in dataclasses.fields(KVCacheBlock)}
    assert {"block_id", "ref_cnt", "is_null"} <= fields
    # read on each block (a property over `_block_hash` in vLLM 0.32, a plain field in 0.34):
    # None until the block is cached, the hash while it is, None again once it is evicted
    block = KVCacheBlock(block_id=1)
    assert block.block_hash is None
    block_hash = make_block_hash_with_group_id(b"\x01" * 8, 0)
    block.set_block_hash(block_hash)
    assert block.block_hash == block_hash
    block.reset_hash()
    assert block.block_hash is None
    assert "self.kv_transfer_params" in inspect.getsource(Request.__init__)


def test_async_variant_keeps_async_scheduling() -> None:
    mro = AsyncPinningScheduler.__mro__
    assert mro.index(PinningScheduler) < mro.index(AsyncScheduler) < mro.index(Scheduler)
    # AsyncScheduler overrides these; our class must not shadow them
    for name in ("_update_after_schedule", "_update_request_with_output"):
        assert getattr(AsyncPinningScheduler, name) is getattr(AsyncScheduler, name)


def test_local_engines_load_the_pinning_scheduler_with_engine_ext() -> None:
    base = dict(name="e", model_dir="/m", served_model_name="m", port=1, log_path="/dev/null")
    kv = json.dumps(config.kv_transfer_config(1 << 20))
    with_ext = engine_command(EngineSpec(**base, extra_args=("--kv-transfer-config", kv)))  # type: ignore[arg-type]
    assert with_ext[with_ext.index("--scheduler-cls") + 1] == ENGINE_EXT_SCHEDULER
    assert "--scheduler-cls" not in engine_command(EngineSpec(**base))  # type: ignore[arg-type]
    own = ("--kv-transfer-config", kv, "--scheduler-cls", "x.Y")
    assert engine_command(EngineSpec(**base, extra_args=own)).count("--scheduler-cls") == 1  # type: ignore[arg-type]
    # a shutdown timeout (the teardown closes the Mooncake client), shorter than stop()'s grace
    timeout = int(with_ext[with_ext.index("--shutdown-timeout") + 1])
    assert 0 < timeout < STOP_GRACE_S
    assert "--shutdown-timeout" not in engine_command(EngineSpec(**base))  # type: ignore[arg-type]
    mine = ("--kv-transfer-config", kv, "--shutdown-timeout", "3")
    assert engine_command(EngineSpec(**base, extra_args=mine)).count("--shutdown-timeout") == 1  # type: ignore[arg-type]


def test_gpu_engines_load_the_async_pinning_scheduler_and_keep_cuda_graphs() -> None:
    base = dict(name="e", model_dir="/m", served_model_name="m", port=1, log_path="/dev/null")
    kv = json.dumps(config.kv_transfer_config(1 << 20))
    cpu = engine_command(EngineSpec(**base, extra_args=("--kv-transfer-config", kv)))  # type: ignore[arg-type]
    gpu = engine_command(EngineSpec(**base, extra_args=("--kv-transfer-config", kv), platform="cuda"))  # type: ignore[arg-type]
    assert "--enforce-eager" in cpu and "--enforce-eager" not in gpu
    cls = gpu[gpu.index("--scheduler-cls") + 1]
    assert cls == ENGINE_EXT_ASYNC_SCHEDULER
    resolved = SchedulerConfig(scheduler_cls=cls, max_model_len=4096, is_encoder_decoder=False)
    assert resolved.get_scheduler_cls() is AsyncPinningScheduler
    assert issubclass(AsyncPinningScheduler, AsyncScheduler)
    with pytest.raises(ValueError, match="platform"):
        EngineSpec(**base, platform="rocm")  # type: ignore[arg-type]
