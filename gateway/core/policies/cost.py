"""The engine cost model the routing core reasons with: pass times, waits, interference, moves.

Parameters (all passed in, from config or a calibration; defaults are Dynamo 1.6.1's mocker):

- ``prefill_ms = (p0, p1, p2)``: one pass that prefills ``T`` uncached tokens takes
  ``p0 + p1*T + p2*T^2`` ms (the engine's own polynomial, or a fit to measured step times).
- ``chunk_tokens``: the most prefill tokens one pass takes for one request: ``min(
  --max-num-batched-tokens, --long-prefill-token-threshold)`` (0 in the threshold: no cap).
- ``decode_ms = (d0, d1, d2)``: a decode step with a fraction ``u`` of the KV blocks in use
  takes ``max(1, d0 + d1*u + d2*u^2)`` ms, plus two terms for engines whose step grows with the
  batch and its context (the H200 calibrations; both 0 by default, the mocker has neither):
  ``decode_seq_ms * b`` for ``b`` decoding sequences and ``decode_kv_ms_per_mtok * u * K / 1e6``
  for ``K = kv_capacity_tokens`` (the context the batch reads, approximated as ``u`` of the KV
  capacity; 0: unknown, the term is left out). Where the batch is not known (the knee) it is
  estimated as ``max(1, u * K / decode_seq_tokens)`` (``decode_seq_tokens``: a typical decoding
  sequence's context; 0: one sequence).
- ``kv_bytes_per_token`` and ``move_bytes_per_s``: what moving a session's KV costs.

Derived quantities (seconds):

- ``prefill_s(T) = floor(T / c) * pf(c) + pf(T mod c)`` with ``c = chunk_tokens``, ``pf`` the
  pass polynomial (a prefill of ``T`` tokens runs as ``passes(T) = ceil(T / c)`` chunks).
- ``step_s(e) = decode_ms(kv_usage_e) / 1000`` when ``e`` has decoding sequences, else 0: the
  decode share of every pass a prefill chunk rides in.
- ``wait_s(e) = prefill_s(B_e) + passes(B_e) * step_s(e)``: the prefill backlog ``B_e`` ahead
  of a new request (uncached prompt tokens admitted or queued and not yet computed).
- ``ttft_s(e, u) = wait_s(e) + prefill_s(u) + passes(u) * step_s(e)``.
- ``interference_s(e, u) = D_e * prefill_s(u)``: every one of the ``D_e`` sequences decoding on
  ``e`` waits for each chunk of the new prefill that shares its pass, i.e. the pass-time increase
  summed over the chunks, times the number of sequences that pay it (sequence-seconds).
- ``move_s(n) = n * kv_bytes_per_token / move_bytes_per_s``: moving ``n`` tokens of KV.
- ``decode_knee(r)``: the KV use ``u`` at which a decode step reaches ``1000 / r`` ms, i.e. past
  which a sequence decodes slower than ``r`` tokens/s (the largest ``u`` in [0, 1] with
  ``decode_ms(u) <= 1000 / r``; 0 when even an empty engine is slower, 1 when a full one is
  faster). The mocker's step at 50 tok/s: ``u = 0.31``; the H200 AIC fit (20.78 ms + 0.0846 ms
  per sequence + 42.15 ms per million context tokens, 655,360 tokens of KV) at 40 tok/s:
  ``u = 0.15``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.types import EngineView


@dataclass(frozen=True, slots=True)
class EngineCost:
    prefill_ms: tuple[float, float, float] = (16.50142, 1.518344e-02, 4.209989e-07)
    chunk_tokens: int = 8192
    decode_ms: tuple[float, float, float] = (5.74, 54.01, -25.74)
    kv_bytes_per_token: int = 131_072
    move_bytes_per_s: float = 2.3e9
    decode_seq_ms: float = 0.0
    decode_kv_ms_per_mtok: float = 0.0
    kv_capacity_tokens: int = 0
    decode_seq_tokens: int = 0

    def pass_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        p0, p1, p2 = self.prefill_ms
        return p0 + p1 * tokens + p2 * tokens * tokens

    def passes(self, tokens: int) -> int:
        c = max(1, self.chunk_tokens)
        return -(-max(0, tokens) // c)

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        c = max(1, self.chunk_tokens)
        full, rest = divmod(tokens, c)
        return (full * self.pass_ms(c) + self.pass_ms(rest)) / 1000.0

    def step_s(self, view: EngineView) -> float:
        if view.decoding <= 0:
            return 0.0
        return self.decode_step_ms(view.kv_usage, view.decoding) / 1000.0

    def wait_s(self, view: EngineView) -> float:
        b = view.prefill_backlog_tokens
        return self.prefill_s(b) + self.passes(b) * self.step_s(view)

    def ttft_s(self, view: EngineView, uncached: int) -> float:
        return self.wait_s(view) + self.prefill_s(uncached) + self.passes(uncached) * self.step_s(view)

    def interference_s(self, view: EngineView, uncached: int) -> float:
        return max(0, view.decoding) * self.prefill_s(uncached)

    def decode_step_ms(self, u: float, batch: int = 0) -> float:
        """The step at KV use ``u`` with ``batch`` decoding sequences (0: estimated from ``u``)."""
        d0, d1, d2 = self.decode_ms
        ctx = u * max(0, self.kv_capacity_tokens)
        if batch <= 0:
            batch = max(1, int(ctx // self.decode_seq_tokens)) if self.decode_seq_tokens > 0 else 1
        extra = self.decode_seq_ms * batch + self.decode_kv_ms_per_mtok * ctx / 1e6
        return max(1.0, d0 + d1 * u + d2 * u * u) + extra

    def decode_knee(self, tok_s: float) -> float:
        if tok_s <= 0:
            return 1.0
        target = 1000.0 / tok_s
        if self.decode_step_ms(0.0) > target:
            return 0.0
        if self.decode_step_ms(1.0) <= target:
            return 1.0
        lo, hi = 0.0, 1.0  # step(lo) <= target < step(hi); the fitted steps rise with u
        for _ in range(40):
            mid = (lo + hi) / 2
            if self.decode_step_ms(mid) <= target:
                lo = mid
            else:
                hi = mid
        return lo

    def move_s(self, tokens: int) -> float:
        if self.move_bytes_per_s <= 0:
            return 0.0
        return max(0, tokens) * self.kv_bytes_per_token / self.move_bytes_per_s
