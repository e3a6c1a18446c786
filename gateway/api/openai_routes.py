"""OpenAI's generation routes, ``POST /v1/chat/completions`` and ``POST /v1/completions``: their
wire adapters for the shared hot-path relay (:mod:`gateway.api.relay`). Both parse with
:func:`gateway.wire.openai.parse_body`, answer errors in OpenAI's shape and end a stream whose
engine failed with an error chunk and ``data: [DONE]``."""

from __future__ import annotations

from functools import partial

from gateway.api.relay import Wire
from gateway.wire.openai import parse_body

__all__ = ["OPENAI_WIRES"]

OPENAI_WIRES = (
    Wire("/v1/chat/completions", "/v1/chat/completions", partial(parse_body, "chat")),
    Wire("/v1/completions", "/v1/completions", partial(parse_body, "completions")),
)
