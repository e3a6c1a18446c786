"""KV hint envelopes (vLLM's ``KvHintsEnvelope``) -> engine_ext control API calls. Pure: no I/O.

vLLM 0.32 carries a versioned envelope of orchestrator actions on a request (``Request.kv_hints``,
handed to offloading managers as ``ReqContext.kv_hints``), but only ``AsyncLLM.generate(kv_hints=)``
sets it: no HTTP route of ``vllm serve`` does. The routes do pass ``kv_transfer_params`` through
to the connector, so engine_ext also reads the envelope's JSON form from
``kv_transfer_params["kv_hints"]`` (:data:`CARRIER_KEY`, "the carrier"). An envelope set natively
wins over the carrier.

Each action is the control API call that does the same (engine_ext.control, applied by
``ControlServer.apply_kv_hints`` through the API's own validation and operations):

===============  ==========================================  ===================================
``action_type``  ``payload``                                 control API call
===============  ==========================================  ===================================
``kv.pin``       ``session_id``?, ``ttl_s``                  ``POST /v1/kv/pin``
``kv.retain``    ``session_id``?, ``ttl_s``, ``priority``?   ``POST /v1/kv/pin`` (see below)
``kv.release``   ``session_id``?                             ``POST /v1/kv/unpin``
``kv.demote``    ``session_id``?                             ``POST /v1/kv/evict``
``kv.prefetch``  ``token_ids``, ``session_id``?,             ``POST /v1/kv/prefetch`` (run on
                 ``pin_ttl_s``?                              the control server's pool)
===============  ==========================================  ===================================

Where the vocabularies differ: ``session_id`` may be left out; it is then the request's own
session (``kv_transfer_params.agentgw.session_id``), so an action on the turn that carries it
need not repeat it (``kv.prefetch`` keeps the control API's rule: no session, no pin). The
RFC's *retain* (bias eviction, no guarantee) is served by the pin, which is soft where it
matters (a device pin yields before vLLM preempts a request, every pin lapses at its TTL) and
holds the session's host chunks until the TTL; its ``priority`` is accepted and ignored: pins
have no ranks. ``kv.fetch`` (a peer-to-peer pull from a named source engine) and ``kv.share``
have no engine_ext operation (a prefetch loads from the shared tier instead) and are refused,
as is any other type.

Versions: the envelope's ``protocol_version`` and each ``action_version`` are ``"1"`` or
``"1.<minor>"``; another major refuses the envelope / the action. A payload field the action
does not define refuses the action. At most :data:`MAX_ACTIONS` actions per envelope. A
refused envelope applies nothing; a refused action leaves the envelope's other actions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

__all__ = [
    "ACTIONS",
    "CARRIER_KEY",
    "MAX_ACTIONS",
    "PROTOCOL_VERSION",
    "ControlCall",
    "InvalidEnvelope",
    "Refusal",
    "carrier",
    "control_calls",
    "request_envelope",
]

CARRIER_KEY = "kv_hints"
"""The key of ``kv_transfer_params`` that carries the envelope's JSON form over HTTP."""
PROTOCOL_VERSION = "1.0"
"""What engine_ext writes; it reads every ``1.<minor>``."""
MAX_ACTIONS = 16

_VERSION = re.compile(r"1(\.[0-9]{1,4})?")


@dataclass(frozen=True)
class _Action:
    path: str
    fields: frozenset[str]
    """Every payload field the action defines."""
    control: Mapping[str, str]
    """payload field -> the control API's body field (the fields not named are not sent)."""


_SESSION = {"session_id": "session_id"}
ACTIONS: dict[str, _Action] = {
    "kv.pin": _Action("/v1/kv/pin", frozenset({"session_id", "ttl_s"}), {**_SESSION, "ttl_s": "ttl_s"}),
    "kv.retain": _Action(
        "/v1/kv/pin", frozenset({"session_id", "ttl_s", "priority"}), {**_SESSION, "ttl_s": "ttl_s"}
    ),
    "kv.release": _Action("/v1/kv/unpin", frozenset({"session_id"}), _SESSION),
    "kv.demote": _Action("/v1/kv/evict", frozenset({"session_id"}), _SESSION),
    "kv.prefetch": _Action(
        "/v1/kv/prefetch",
        frozenset({"token_ids", "session_id", "pin_ttl_s"}),
        {"token_ids": "token_ids", "session_id": "session_id", "pin_ttl_s": "pin_ttl_s"},
    ),
}
"""action_type -> its control API call."""
_SESSION_DEFAULTED = frozenset({"kv.pin", "kv.retain", "kv.release", "kv.demote"})


class InvalidEnvelope(ValueError):
    """The carrier holds no envelope engine_ext can read (the whole envelope is refused)."""


@dataclass(frozen=True)
class ControlCall:
    """One action as the control API call that carries it out (``POST path`` with ``body``)."""

    action_id: str
    action_type: str
    path: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Refusal:
    action_id: str
    action_type: str
    reason: str


def carrier(envelope: KvHintsEnvelope) -> dict[str, Any]:
    """The envelope's JSON form, as ``kv_transfer_params["kv_hints"]`` carries it."""
    out: dict[str, Any] = msgspec.to_builtins(envelope)
    return out


def request_envelope(
    native: KvHintsEnvelope | None, kv_transfer_params: Mapping[str, Any] | None
) -> KvHintsEnvelope | None:
    """The request's envelope: the native one (``AsyncLLM`` callers) when set, else the carrier's
    (None when neither is there). Raises :class:`InvalidEnvelope` for a carrier that does not
    hold a version-1 envelope of at most :data:`MAX_ACTIONS` actions, or a native envelope of
    another version."""
    if native is not None:
        envelope = native
    else:
        raw = (kv_transfer_params or {}).get(CARRIER_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise InvalidEnvelope(f"kv_transfer_params.{CARRIER_KEY} must be an object")
        try:
            envelope = msgspec.convert(raw, KvHintsEnvelope)
        except msgspec.ValidationError as exc:
            raise InvalidEnvelope(f"kv_transfer_params.{CARRIER_KEY}: {exc}") from None
    if not _VERSION.fullmatch(envelope.protocol_version):
        raise InvalidEnvelope(
            f"protocol_version {envelope.protocol_version[:32]!r} is not supported (1 or 1.<minor>)"
        )
    if len(envelope.actions) > MAX_ACTIONS:
        raise InvalidEnvelope(f"{len(envelope.actions)} actions: at most {MAX_ACTIONS}")
    return envelope


def _call(action: KvHintAction, session_id: str | None) -> ControlCall | Refusal:
    def refuse(reason: str) -> Refusal:
        return Refusal(action.action_id, action.action_type, reason)

    spec = ACTIONS.get(action.action_type)
    if spec is None:
        return refuse(f"unknown action_type {action.action_type[:64]!r} (known: {', '.join(ACTIONS)})")
    if not _VERSION.fullmatch(action.action_version):
        return refuse(f"action_version {action.action_version[:32]!r} is not supported (1 or 1.<minor>)")
    unknown = sorted(set(action.payload) - spec.fields)
    if unknown:
        return refuse(f"payload fields {unknown[:8]} are not defined for {action.action_type}")
    body = {spec.control[k]: v for k, v in action.payload.items() if k in spec.control}
    if action.action_type in _SESSION_DEFAULTED and "session_id" not in body:
        if session_id is None:
            return refuse("no session_id in the payload and the request names no session")
        body["session_id"] = session_id
    return ControlCall(action.action_id, action.action_type, spec.path, body)


def control_calls(
    envelope: KvHintsEnvelope, session_id: str | None
) -> tuple[list[ControlCall], list[Refusal]]:
    """The envelope's actions as control API calls, in the envelope's order, and the actions
    refused. ``session_id``: the request's session (the default of an action's ``session_id``).
    The calls' bodies are validated by the control API when applied, like any request's."""
    calls: list[ControlCall] = []
    refused: list[Refusal] = []
    for action in envelope.actions:
        out = _call(action, session_id)
        if isinstance(out, ControlCall):
            calls.append(out)
        else:
            refused.append(out)
    return calls, refused
