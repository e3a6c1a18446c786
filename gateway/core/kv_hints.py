"""engine_ext's ``kv_transfer_params`` for one turn: the session binding and, for engines that
read KV hint envelopes, the turn's pin or release as an envelope action. Pure.

``kv_transfer_params(session_id, pin_ttl_s, release, message_id, envelope)``:

- ``agentgw``: ``{"session_id"}`` binds the request's KV to its session (engine_ext records the
  request's chunks and device blocks under it at the request's end);
- without ``envelope`` (the default), the pin or release is in the same hint, as engine_ext has
  always read it: ``pin_ttl_s`` (keep the session's KV that long after the turn) or
  ``release: true`` (the session ended);
- with ``envelope`` (the engine's ``kv_hints``), it is one action of a version-1
  ``KvHintsEnvelope`` in ``kv_transfer_params.kv_hints``: ``kv.pin {ttl_s}`` or ``kv.release``
  (docs/engine_ext.md, "KV hint envelopes"). engine_ext applies it as the control API's
  ``POST /v1/kv/pin`` / ``/v1/kv/unpin``, so the gateway sends no such call after the turn.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CARRIER_KEY", "PROTOCOL_VERSION", "kv_transfer_params"]

CARRIER_KEY = "kv_hints"
PROTOCOL_VERSION = "1.0"


def kv_transfer_params(
    session_id: str, pin_ttl_s: float | None, release: bool, message_id: str, envelope: bool
) -> dict[str, Any]:
    """The turn's ``kv_transfer_params`` (``pin_ttl_s`` is read unless ``release``)."""
    if not envelope:
        if release:
            return {"agentgw": {"session_id": session_id, "release": True}}
        return {"agentgw": {"session_id": session_id, "pin_ttl_s": pin_ttl_s}}
    if release:
        act: dict[str, Any] = {"action_type": "kv.release", "payload": {}}
    else:
        act = {"action_type": "kv.pin", "payload": {"ttl_s": pin_ttl_s}}
    return {
        "agentgw": {"session_id": session_id},
        CARRIER_KEY: {
            "protocol_version": PROTOCOL_VERSION,
            "message_id": message_id,
            "actions": [{"action_id": "turn", "action_version": "1.0", **act}],
        },
    }
