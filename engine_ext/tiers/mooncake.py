"""`MooncakeTier`: the object tier backed by a real `MooncakeDistributedStore` (TCP).

Tier config (inside `secondary_tiers`):
    {"type": "MooncakeTier", "module_path": "engine_ext.tiers.mooncake",
     "master_address": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata",
     "global_segment_size": 268435456, "local_buffer_size": 67108864, "stall_timeout_s": null,
     ...ObjectStoreTier params}
`stall_timeout_s` bounds a transfer to a peer that does not answer (engine_ext.tiers.store);
null keeps Mooncake's 30 s.
Set `MC_TCP_BIND_ADDRESS` in the engine's environment when the loopback is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_ext.tiers.object_tier import ObjectStoreTier
from engine_ext.tiers.store import DEFAULT_STALL_TIMEOUT_S, MooncakeObjectStore

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

__all__ = ["MooncakeTier"]


class MooncakeTier(ObjectStoreTier):
    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        master_address: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
        **tier_params: Any,
    ):
        store = MooncakeObjectStore(
            master_address=master_address,
            metadata_server=metadata_server,
            local_hostname=local_hostname,
            global_segment_size=global_segment_size,
            local_buffer_size=local_buffer_size,
            stall_timeout_s=stall_timeout_s,
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, store=store, **tier_params)
