"""The routing-independent floors (gateway/sim/floors.py) follow the simulator's engine model."""

from __future__ import annotations

import pytest

from gateway.sim.calibration import ENGINES
from gateway.sim.floors import decode_floor_tok_s, floors, ttft_floor_ms
from gateway.sim.traces import synth_agentx


@pytest.mark.parametrize("name", ["dynamo-mocker", "h200-qwen3-32b-fp8-aic"])
def test_floors_are_the_engine_models_own_pass_times(name: str) -> None:
    eng = ENGINES[name]()
    c = eng.max_batched_tokens
    assert ttft_floor_ms(eng, 0, 50_000) == 0.0
    assert ttft_floor_ms(eng, 100, 0) == pytest.approx(eng.perf.prefill_ms(100, 0.0))
    # two chunks: the second attends to the first
    two = eng.perf.prefill_ms(c, 0.0) + eng.perf.prefill_ms(1, c / 1e6)
    assert ttft_floor_ms(eng, c + 1, 0) == pytest.approx(two)
    cap = eng.num_blocks * eng.block_size
    assert decode_floor_tok_s(eng, 10_000) == pytest.approx(
        1000.0 / eng.perf.decode_ms(10_000 / cap, 1, 10_000)
    )
    assert decode_floor_tok_s(eng, 400_000) < decode_floor_tok_s(eng, 10_000)


def test_shares_count_the_requests_past_each_bound() -> None:
    plays = synth_agentx(4, seed=0)
    eng = ENGINES["dynamo-mocker"]()
    n = sum(len(p.requests) for p in plays)
    assert floors(plays, eng, slo_ttft_ms=0.0, slo_tok_s=1e9)["under_tok_s"] == 1.0
    assert floors(plays, eng, slo_ttft_ms=1e12, slo_tok_s=0.0)["over_ttft"] == 0.0
    f = floors(plays, eng, slo_ttft_ms=1000.0, slo_tok_s=50.0)
    assert f["requests"] == n
    assert f["ttft_p50"] <= f["ttft_p90"]
