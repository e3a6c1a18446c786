"""Which offloaded KV belongs to a speculative drafter, and the test-only hook that zeroes it.

vLLM puts a drafter's attention layers in the target's KV cache groups when their specs match:
a `draft_model` drafter's layers are named ``draft_model.model.layers.N...``, an EAGLE or MTP
head's layers continue the target's numbering (``model.layers.<num_hidden_layers>...``). So a
tiny Llama with a 2-layer drafter offloads one group of 4 layers, and every tier (host, Mooncake,
a planner's move) carries the drafter's KV with the target's, block by block. vLLM 0.32 annotates
a group as a drafter group (and keeps its volatile last chunk out of stores while decoding) only
for EAGLE/MTP heads with a group of their own; a shared group is stored whole.

`zero_on_load_flag()` names a file (environment ``ENGINE_EXT_TEST_ZERO_DRAFTER_ON_LOAD``): while
it exists, `HostCopyWorker` zeroes the drafter's layers of every block it loads into the device
cache (only the last block of each load when the file holds ``last``: one stale chunk, the most
a reload may lose). It is the mutation behind the speculative path tests (a reload that lost the
drafter's state must fail them); nothing else sets it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ZERO_ON_LOAD_ENV", "drafter_layers", "zero_on_load_flag"]

ZERO_ON_LOAD_ENV = "ENGINE_EXT_TEST_ZERO_DRAFTER_ON_LOAD"

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def drafter_layers(layer_names: Sequence[str], num_target_layers: int | None) -> list[int]:
    """Positions in ``layer_names`` of the drafter's layers: a ``draft_model.`` prefix, or a layer
    index at or past the target's ``num_target_layers`` (None: no speculative decoding)."""
    if num_target_layers is None:
        return []
    out = []
    for i, name in enumerate(layer_names):
        if name.startswith("draft_model."):
            out.append(i)
            continue
        m = _LAYER_INDEX.search(name)
        if m is not None and int(m.group(1)) >= num_target_layers:
            out.append(i)
    return out


def zero_on_load_flag() -> Path | None:
    value = os.environ.get(ZERO_ON_LOAD_ENV)
    return Path(value) if value else None
