"""vLLM general plugin entry point (`vllm.general_plugins: agentgw_engine_ext`).

vLLM imports this in every process. It must stay cheap and side-effect free: the offload spec,
cache policy and tiers are loaded by name from `--kv-transfer-config`, and the control server
is started by the scheduler-side manager that owns the state it serves. The one thing done here:
when the environment asks for it (`AGENTGW_RESPONSES_STORE_MAX_ENTRIES` / `_MAX_BYTES`), the
Responses API's store is bounded (:mod:`engine_ext.response_store`; it patches vLLM's serving
module when, and in the process where, that module is imported).
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Bound the Responses store if asked; see engine_ext.spec for the loaded-by-name pieces."""
    from engine_ext.response_store import install_from_env

    install_from_env()
