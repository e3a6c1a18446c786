"""Build the ``--kv-transfer-config`` that loads engine_ext into a vLLM 0.32 engine.

``OffloadingConnector`` (vLLM's own) with our ``AgentOffloadingSpec``: a host tier of
``cpu_bytes`` and, with a Mooncake master, a Mooncake secondary tier; the control API on
``control_port`` (bearer ``control_token``) when given. See docs/engine_ext.md.
"""

from __future__ import annotations

from typing import Any


def kv_transfer_config(
    cpu_bytes: int,
    *,
    control_port: int | None = None,
    control_token: str | None = None,
    engine_url: str | None = None,
    mooncake_master: str | None = None,
    mooncake_metadata: str | None = None,
    retention: dict[str, Any] | None = None,
    mooncake_segment_bytes: int | None = None,
) -> dict[str, Any]:
    """``mooncake_segment_bytes``: the memory this engine lends the Mooncake store (the client's
    global segment; the tier's default when None). 0 makes the engine a pure client, so its
    objects live on store nodes and survive the engine (see docs/engine_ext.md)."""
    extra: dict[str, Any] = {
        "spec_name": "AgentOffloadingSpec",
        "spec_module_path": "engine_ext.spec",
        "cpu_bytes_to_use": cpu_bytes,
    }
    if control_port is not None:
        if not control_token or control_token != control_token.strip():
            raise ValueError("control_port needs a control_token (non-empty, no surrounding spaces)")
        extra["control_port"] = control_port
        extra["control_token"] = control_token
    if engine_url is not None:
        extra["engine_url"] = engine_url
    if mooncake_master is not None:
        tier: dict[str, Any] = {
            "type": "MooncakeTier",
            "module_path": "engine_ext.tiers.mooncake",
            "master_address": mooncake_master,
            "metadata_server": mooncake_metadata,
        }
        if retention is not None:
            tier["retention"] = retention
        if mooncake_segment_bytes is not None:
            tier["global_segment_size"] = mooncake_segment_bytes
        extra["secondary_tiers"] = [tier]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
