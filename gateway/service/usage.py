"""Per-tenant usage: requests, input, cached and output tokens, as the engines report them.

The relay keeps the last few chunks of every answer (:attr:`Relay.tail`); at the end of the
request :func:`read_usage` finds the last ``"usage"`` object in them: Chat and Completions
(``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``; a stream has
it in its last chunk when the client asks with ``stream_options.include_usage`` or the engine
runs ``--enable-force-include-usage``), Anthropic Messages (``input_tokens``, ``output_tokens``,
``cache_read_input_tokens``; a stream's ``message_delta`` has the output), Responses
(``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens`` in
``response.completed``). What the answer does not report is taken from the gateway's own account:
input from its count of the prompt's tokens, cached from its routing estimate; output is then
unknown, counted as 0, and the request counted in ``agentgw_tenant_usage_unreported_total``.
vLLM reports ``cached_tokens`` only with ``--enable-prompt-tokens-details``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.service.metrics import GatewayMetrics

__all__ = ["Usage", "count_usage", "read_usage"]

_USAGE = b'"usage":'
_FIELDS = {
    "input": re.compile(rb'"(?:prompt_tokens|input_tokens)":\s*(\d+)'),
    "output": re.compile(rb'"(?:completion_tokens|output_tokens)":\s*(\d+)'),
    "cached": re.compile(rb'"(?:cached_tokens|cache_read_input_tokens)":\s*(\d+)'),
}
_WINDOW = 1024
"""Bytes read after the last ``"usage":`` (the object is ~200 bytes)."""


@dataclass(frozen=True, slots=True)
class Usage:
    input: int | None
    output: int | None
    cached: int | None


def read_usage(tail: Iterable[bytes]) -> Usage | None:
    """The last usage object in the answer's last chunks (None: there is none)."""
    data = b"".join(tail)
    end = len(data)
    while (i := data.rfind(_USAGE, 0, end)) >= 0:  # the last one with numbers ("usage":null skipped)
        window = data[i : i + _WINDOW]
        found = {k: (int(m.group(1)) if (m := rx.search(window)) else None) for k, rx in _FIELDS.items()}
        if found["input"] is not None or found["output"] is not None:
            return Usage(found["input"], found["output"], found["cached"])
        end = i
    return None


def count_usage(
    metrics: GatewayMetrics,
    tenant: str,
    status: str,
    tail: Iterable[bytes],
    prompt_tokens: int,
    cached_estimate: int,
) -> Usage:
    """Count one finished request of ``tenant`` (``status``: its HTTP status as sent)."""
    child = metrics._child
    child(metrics.tenant_requests, tenant, status[:1] + "xx").inc()  # type: ignore[attr-defined]
    if not status.startswith("2"):
        return Usage(0, 0, 0)
    u = read_usage(tail)
    if u is None:
        u = Usage(None, None, None)
        child(metrics.tenant_unreported, tenant).inc()  # type: ignore[attr-defined]
    final = Usage(
        u.input if u.input is not None else prompt_tokens,
        u.output or 0,
        u.cached if u.cached is not None else min(cached_estimate, prompt_tokens),
    )
    for kind, n in (("input", final.input), ("cached", final.cached), ("output", final.output)):
        if n:
            child(metrics.tenant_tokens, tenant, kind).inc(n)  # type: ignore[attr-defined]
    return final
