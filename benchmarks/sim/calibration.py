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
  TODO (fidelity): replace with a fit of ``aiconfigurator-core`` 0.12.0's H200 vLLM tables
  (``systems/data/h200_sxm/{gemm,attention}/vllm/``) through its ``AicEngine`` estimator.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.sim.engine import DYNAMO_MOCKER, EngineConfig, PerfModel

__all__ = ["ENGINES", "H200_QWEN3_32B_FP8"]

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

ENGINES: dict[str, Callable[[], EngineConfig]] = {
    "dynamo-mocker": lambda: DYNAMO_MOCKER,
    "h200-qwen3-32b-fp8": lambda: H200_QWEN3_32B_FP8,
}
