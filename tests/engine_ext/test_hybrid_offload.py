"""Hybrid models through the host tier: tiny Gemma3 (sliding window + full attention) and tiny
Qwen3-Next (linear attention + full attention), each with several KV cache groups (HMA on)."""

from __future__ import annotations

import random

import pytest

from tests.engine_ext.offload_support import HYBRIDS, Engine, complete, delta, metrics, tokens

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_hybrid_session_reloads_from_host_tier_with_identical_greedy_output(
    hybrid_engines: dict[str, Engine], arch: str
) -> None:
    engine = hybrid_engines[arch]
    _, prompt_len, evicting_prompts = HYBRIDS[arch]
    rng = random.Random(len(arch) * 7919)
    turn1 = tokens(rng, prompt_len)
    out1, _ = complete(engine, turn1)
    for _ in range(evicting_prompts):
        complete(engine, tokens(rng, prompt_len), max_tokens=1)
    turn2 = turn1 + out1 + tokens(rng, 60)
    before = metrics(engine)
    out2, lp2 = complete(engine, turn2)
    after = metrics(engine)
    assert delta(after, before, "source:local_cache_hit") == 0
    assert delta(after, before, "source:external_kv_transfer") >= (prompt_len // 1152) * 1152 > 0

    ref, ref_lp = complete(engine, turn2, reference=True)
    assert out2 == ref
    assert lp2 == pytest.approx(ref_lp, abs=2e-2)
