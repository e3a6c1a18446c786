"""A vLLM engine's counters from its ``/metrics``, summed over labels: what the engine tests and
the benchmarks read of an engine's work (prompt tokens by source, offload bytes, accepted drafts)."""

from __future__ import annotations

import re

import httpx

__all__ = ["vllm_counters"]

_METRIC = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([-+0-9.e]+)$")
_SOURCE = re.compile(r'source="([a-z_]+)"')


def vllm_counters(url: str) -> dict[str, float]:
    """Every ``vllm:`` sample summed over its labels, except ``prompt_tokens_by_source``, which is
    kept per source as ``source:<name>`` (``source:local_compute``, ``source:local_cache_hit``,
    ``source:external_kv_transfer``)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels = m.group(1), m.group(2) or ""
        if name == "vllm:prompt_tokens_by_source_total":
            found = _SOURCE.search(labels)
            if found is None:
                continue
            name = "source:" + found.group(1)
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out
