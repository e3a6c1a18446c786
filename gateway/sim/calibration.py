"""Named engine models for the simulator.

- ``dynamo-mocker``: Dynamo 1.6.1's mocker defaults (shared/ANCHORS.md): block 64, 16,384
  blocks, 8,192 batched tokens, 256 sequences, prefill ``16.50142 + 1.518344e-2*T +
  4.209989e-7*T^2`` ms over a pass's uncached tokens, decode ``max(1, 5.74 + 54.01*u -
  25.74*u^2)`` ms. The configuration to compare with Dynamo's replay.
- ``h200-qwen3-32b-fp8``: one H200 SXM (141 GB HBM3e at 4.8 TB/s, 1,979 dense FP8 TFLOPS, 989
  BF16) serving Qwen3-32B (64 layers, 64 query / 8 KV heads of 128, 32.8B parameters) with FP8
  weights and an FP8 KV cache (128 KiB per token). A *roofline* estimate, not yet a fit:
  weights ~33 GB, 90% memory utilisation and ~6 GB activations leave ~88 GB of KV = 10,240
  blocks of 64 tokens; prefill = 5 ms + 2 x 32.8 GFLOP per token at 50% of FP8 peak (0.066 ms
  per token) + attention 4 x 64 x 8,192 FLOP per token pair at 60% of BF16 peak (3.5 ms per
  million prefix token pairs, half that within a chunk); decode = weight read 32.8 GB at 80% of
  4.8 TB/s (8.5 ms) + KV read 34 ms per million context tokens + 0.02 ms per sequence.
- ``h200-qwen3-32b-fp8-aic``: the same engine (KV capacity, block size, budgets) with pass times
  *fitted* to ``aiconfigurator-core`` 0.12.0's H200 SXM vLLM 0.24.0 perf tables: ``compile_engine(
  "Qwen/Qwen3-32B-FP8", "h200_sxm", "vllm", tp_size=1, kv_block_size=64)`` then
  ``AicEngine.predict_prefill_latency(1, T + prefix, prefix)`` for T in 256..8,192 new tokens and
  prefix in 0..131,072 cached tokens (42 points; least squares on ``p0 + p1*T + p2*T^2 +
  p_attn*T*prefix/1e6``: median error 1.2%, max 12%) and ``decode_step_latency(bs, ctx, 2)`` for
  bs 1..128, ctx 2K..128K within the KV capacity (least squares on ``d0 + d_seq*bs +
  d_kv*bs*ctx/1e6``: median 2.6%, max 14%). Reference points from the tables: 8,192 fresh tokens
  568 ms (14.4K tok/s prefill); decode bs 1 at 1K context 20.5 ms (49 tok/s), bs 64 at 8K 49.7 ms.
  Versus the roofline: prefill per token 0.052 vs 0.066 ms, attention 3.4 vs 3.5 ms per million
  token pairs (agree), decode floor 20.8 vs 8.5 ms (the tables include vLLM's per-step overhead
  and FP8 GEMMs well below peak bandwidth at small batch). Not checked against a published H200
  figure (none found for Qwen3-32B FP8 on one H200 in the references at hand).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.sim.engine import DYNAMO_MOCKER, EngineConfig, PerfModel

__all__ = ["ENGINES", "H200_QWEN3_32B_FP8", "H200_QWEN3_32B_FP8_AIC"]

H200_QWEN3_32B_FP8 = EngineConfig(
    name="h200-qwen3-32b-fp8",
    block_size=64,
    num_blocks=10_240,
    max_batched_tokens=8_192,
    max_seqs=256,
    perf=PerfModel(
        p0=5.0, p1=0.066, p2=1.75e-6, p_attn=3.5, d0=8.5, d1=0.0, d2=0.0, d_seq=0.02, d_kv=34.0, floor_ms=1.0
    ),
    kv_bytes_per_token=131_072,
)

H200_QWEN3_32B_FP8_AIC = H200_QWEN3_32B_FP8.with_(
    name="h200-qwen3-32b-fp8-aic",
    perf=PerfModel(
        p0=15.79,
        p1=0.05195,
        p2=1.802e-6,
        p_attn=3.398,
        d0=20.78,
        d1=0.0,
        d2=0.0,
        d_seq=0.0846,
        d_kv=42.15,
        floor_ms=1.0,
    ),
)

ENGINES: dict[str, Callable[[], EngineConfig]] = {
    "dynamo-mocker": lambda: DYNAMO_MOCKER,
    "h200-qwen3-32b-fp8": lambda: H200_QWEN3_32B_FP8,
    "h200-qwen3-32b-fp8-aic": lambda: H200_QWEN3_32B_FP8_AIC,
}
