"""`AgentOffloadingSpec`: vLLM's tiering offload spec, made to run on the CPU platform too.

Loaded by vLLM's `OffloadingConnector` through `spec_name` + `spec_module_path`, so vLLM's
scheduler-side logic (async lookups, chunk-level delta stores, in-flight dedup, fencing of
reused blocks, `prompt_tokens_by_source` accounting) is reused unchanged. What this spec adds:

- a worker for the CPU platform (`HostCopyWorker`, moving blocks through `kernels`), where
  vLLM's raises "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"; on
  CUDA/XPU the parent's worker runs unless `"host_worker": "kernels"` asks for `HostCopyWorker`
  there too (the Triton kernels on CUDA; checked for parity only under Triton's interpreter);
- defaults that fit agentic sessions: generated tokens are offloaded too
  (`offload_prompt_only=False`, store rule f) and the pin-aware cache policy is the default;
- secondary tiers (e.g. `engine_ext.tiers.mooncake.MooncakeTier`) come from the standard
  `secondary_tiers` list.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vllm.config import get_current_vllm_config
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from engine_ext.drafter import drafter_layers, zero_on_load_flag
from engine_ext.host_worker import HostCopyWorker
from engine_ext.pinned_policy import PinnedLRUCachePolicy
from engine_ext.tiers.object_tier import ObjectStoreTier

__all__ = ["AgentOffloadingSpec"]

# under vLLM's logger, whose handler writes the engine's log (a plain engine_ext logger has none at INFO)
logger = logging.getLogger(f"vllm.{__name__}")

_DEFAULTS: dict[str, Any] = {
    "offload_prompt_only": False,
    "eviction_policy": "PinnedLRUCachePolicy",
    "cache_policy_module_path": "engine_ext.pinned_policy",
}


def _with_defaults(config: OffloadingConfig) -> OffloadingConfig:
    extra = dict(_DEFAULTS)
    extra.update(config.extra_config)
    if (
        extra.get("eviction_policy") in ("lru", "arc")
        and "cache_policy_module_path" not in config.extra_config
    ):
        extra.pop("cache_policy_module_path")
    # OffloadingConfig is frozen; rebuild it with the merged extra config.
    from dataclasses import replace

    return replace(config, extra_config=extra)


class AgentOffloadingSpec(TieringOffloadingSpec):
    """Tiering spec (host primary tier + secondary tiers) usable on CPU and CUDA."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(_with_defaults(config))

    def get_manager(self) -> OffloadingManager:
        first = self._manager is None
        manager = super().get_manager()
        if first and self.extra_config.get("control_port") is not None:
            self._start_control_server(manager)
        return manager

    def _start_control_server(self, manager: OffloadingManager) -> None:
        from engine_ext.config import control_token
        from engine_ext.control import ControlServer, ControlService

        assert isinstance(manager, TieringOffloadingManager)
        policy = manager.primary_tier._policy
        if not isinstance(policy, PinnedLRUCachePolicy):
            raise ValueError("the control API needs eviction_policy=PinnedLRUCachePolicy")
        tiers = manager.secondary_tiers
        capacity = self.num_chunks

        def stats() -> dict[str, Any]:
            return {
                "host": {
                    "chunks_used": len(policy.chunks),
                    "chunks_capacity": capacity,
                    "bytes_per_chunk": self.kv_bytes_per_chunk,
                    "pinned_sessions": len(policy.pins),
                    "evictions_refused_for_pins": policy.num_pin_protected_evictions_refused,
                },
                "tiers": {t.tier_type: t.stats() for t in tiers if isinstance(t, ObjectStoreTier)},
            }

        server = ControlServer(
            ControlService(policy, stats, engine_url=self.extra_config.get("engine_url")),
            host=str(self.extra_config.get("control_host", "127.0.0.1")),
            port=int(self.extra_config["control_port"]),
            token=control_token(self.extra_config),  # none: the engine does not start
            max_inflight=int(self.extra_config.get("control_max_inflight", 8)),
            max_connections=int(self.extra_config.get("control_max_connections", 64)),
            header_timeout_s=float(self.extra_config.get("control_header_timeout_s", 5.0)),
            body_timeout_s=float(self.extra_config.get("control_body_timeout_s", 10.0)),
            keep_alive_s=float(self.extra_config.get("control_keep_alive_s", 75.0)),
            max_body_bytes=int(self.extra_config.get("control_max_body_bytes", 4 * 1024 * 1024)),
        )
        server.start()
        self._control_server = server

    def _device_is_host(self) -> bool:
        return not (current_platform.is_cuda_alike() or current_platform.is_xpu())

    def _uses_host_copy_worker(self) -> bool:
        choice = str(self.extra_config.get("host_worker", "auto"))
        if choice not in ("auto", "kernels"):
            raise ValueError(f"host_worker must be 'auto' or 'kernels', not {choice!r}")
        return self._device_is_host() or (choice == "kernels" and current_platform.is_cuda())

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._uses_host_copy_worker():
            return super().get_worker(kv_caches)
        if self._worker is None:
            # vLLM types _worker as its CPUOffloadingWorker; here it may be a HostCopyWorker
            self._worker = self.create_worker(kv_caches)  # type: ignore[assignment]
        assert self._worker is not None
        return self._worker

    def _drafter_refs(self, kv_caches: CanonicalKVCaches) -> tuple[Path, set[int]] | None:
        """Log which offloaded layers are a speculative drafter's; under the test-only hook
        (`engine_ext.drafter.zero_on_load_flag`), its flag file and the drafter's tensors."""
        try:
            vllm_config = get_current_vllm_config()
        except Exception:  # no current config (a worker built outside an engine)
            return None
        if vllm_config.speculative_config is None:
            return None
        num_target = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
        tensors: set[int] = set()
        for group, refs in zip(self.config.groups, kv_caches.group_data_refs, strict=True):
            drafter = drafter_layers(group.layer_names, num_target)
            logger.info(
                "engine_ext: KV group %d offloads %d layers, %d of them the %s drafter's: %s",
                group.group_id,
                len(group.layer_names),
                len(drafter),
                vllm_config.speculative_config.method,
                [group.layer_names[i] for i in drafter],
            )
            if len(refs) == len(group.layer_names):  # one ref per layer (not a packed layout)
                tensors.update(refs[i].tensor_idx for i in drafter)
        flag = zero_on_load_flag()
        if flag is None or not tensors:
            return None
        logger.warning("engine_ext: TEST HOOK: drafter KV is zeroed on load while %s exists", flag)
        return flag, tensors

    # widens vLLM's CPUOffloadingWorker return type: the HostCopyWorker is another OffloadingWorker
    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:  # type: ignore[override]
        if not self._uses_host_copy_worker():
            return super().create_worker(kv_caches)
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return HostCopyWorker(
                kv_caches, self.blocks_per_chunk, region, zero_on_load=self._drafter_refs(kv_caches)
            )
        except Exception:
            region.cleanup()
            raise
