"""vLLM general plugin entry point (`vllm.general_plugins: agentgw_engine_ext`).

vLLM imports this in every process. It must stay cheap and side-effect free: the offload spec,
cache policy and tiers are loaded by name from `--kv-transfer-config`, and the control server
is started by the scheduler-side manager that owns the state it serves.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Nothing to register globally; see engine_ext.spec for the loaded-by-name pieces."""
    return None
