"""The estimators learn from what the gateway observes: an engine's pass times from a prior off
by 2x either way, each session's shape from its own recorded turns, a path's bandwidth and
backlog. Deterministic: recorded turns (the vendored Weka sessions) and seeded noise."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from statistics import mean

import pytest

from gateway.core.estimators import EngineModel, LinkModel, SessionModel
from gateway.core.policies.cost import EngineCost

WEKA = Path(__file__).resolve().parents[1] / "data" / "traces" / "weka"

TRUE = EngineCost(
    prefill_ms=(16.5, 1.5e-2, 4.2e-7),
    decode_ms=(20.78, 4.0, 0.0),
    decode_seq_ms=0.0846,
    decode_kv_ms_per_mtok=42.15,
    kv_capacity_tokens=655_360,
)
"""An engine whose decode step grows with the batch and its context (the H200 fit's shape)."""


def scaled(cost: EngineCost, f: float) -> EngineCost:
    p0, p1, p2 = cost.prefill_ms
    d0, d1, d2 = cost.decode_ms
    return EngineCost(
        prefill_ms=(p0 * f, p1 * f, p2 * f),
        decode_ms=(d0 * f, d1 * f, d2 * f),
        decode_seq_ms=cost.decode_seq_ms * f,
        decode_kv_ms_per_mtok=cost.decode_kv_ms_per_mtok * f,
        kv_capacity_tokens=cost.kv_capacity_tokens,
    )


def feed(model: EngineModel, n: int, seed: int = 0) -> None:
    """``n`` prefill passes and ``n`` decode steps of :data:`TRUE`, each off by up to 5%."""
    rng = random.Random(seed)
    for _ in range(n):
        tokens = int(64 * 2 ** rng.uniform(0, 8))  # 64 .. 16,384, as many short prefills as long
        model.observe_prefill(tokens, TRUE.pass_ms(tokens) * rng.uniform(0.95, 1.05))
        u = rng.uniform(0.0, 1.0)
        batch = rng.randint(1, 128)
        ctx = int(u * TRUE.kv_capacity_tokens * rng.uniform(0.5, 1.0))
        true_ms = TRUE.decode_ms[0] + TRUE.decode_ms[1] * u + TRUE.decode_seq_ms * batch + 42.15 * ctx / 1e6
        model.observe_step(u, batch, ctx, true_ms * rng.uniform(0.95, 1.05))


@pytest.mark.parametrize("off", [0.5, 2.0])
def test_the_engine_model_finds_the_engine_from_a_prior_off_by_2x(off: float) -> None:
    model = EngineModel(scaled(TRUE, off))
    assert model.pass_ms(8192) == pytest.approx(TRUE.pass_ms(8192) * off)  # the prior, untouched
    feed(model, 400)
    for tokens in (256, 2048, 8192):
        assert model.pass_ms(tokens) == pytest.approx(TRUE.pass_ms(tokens), rel=0.05), tokens
    for u, batch in ((0.1, 4), (0.5, 32), (0.9, 96)):
        ctx = int(u * TRUE.kv_capacity_tokens * 0.75)
        want = TRUE.decode_ms[0] + TRUE.decode_ms[1] * u + TRUE.decode_seq_ms * batch + 42.15 * ctx / 1e6
        assert model.step_ms(u, batch, ctx) == pytest.approx(want, rel=0.05), (u, batch)
    # what the router prices with: the fitted cost, whose TTFT of a cold prefill is the engine's
    fitted = model.cost()
    assert fitted.prefill_s(8192) == pytest.approx(TRUE.prefill_s(8192), rel=0.05)
    assert model.samples == 800


def test_a_few_observations_move_the_prior_a_little_and_many_replace_it() -> None:
    model = EngineModel(scaled(TRUE, 2.0), prior_weight=20)
    feed(model, 3)
    after_three = model.pass_ms(8192)
    assert TRUE.pass_ms(8192) < after_three < 2.0 * TRUE.pass_ms(8192)
    assert after_three > 1.3 * TRUE.pass_ms(8192)  # three samples against a prior worth twenty
    feed(model, 300, seed=1)
    assert model.pass_ms(8192) == pytest.approx(TRUE.pass_ms(8192), rel=0.05)


def test_the_engine_model_follows_an_engine_that_slows_down() -> None:
    """Another tenant's engine on the node: every pass 1.5x slower from some point on."""
    model = EngineModel(TRUE)
    feed(model, 400)
    rng = random.Random(2)
    for _ in range(800):
        tokens = int(64 * 2 ** rng.uniform(0, 8))
        model.observe_prefill(tokens, 1.5 * TRUE.pass_ms(tokens) * rng.uniform(0.95, 1.05))
    assert model.pass_ms(4096) == pytest.approx(1.5 * TRUE.pass_ms(4096), rel=0.05)


def test_nonsense_observations_are_ignored() -> None:
    model = EngineModel(TRUE)
    model.observe_prefill(0, 10.0)
    model.observe_prefill(100, -1.0)
    model.observe_step(0.5, 0, 1000, 20.0)
    assert model.samples == 0


def recorded_sessions() -> list[tuple[str, list[dict]]]:
    out = []
    for f in sorted(WEKA.glob("*.json")):
        d = json.loads(f.read_text())
        out.append((str(d["id"]), [r for r in d["requests"] if r.get("type") == "n"]))
    return out


def test_the_session_model_tells_recorded_sessions_apart() -> None:
    """The three vendored Weka sessions, their turns replayed in arrival order: each session's
    learned output tokens, tool gap and context growth are closer to its own means than the
    fleet's mean is (the one fixed expectation the router used before)."""
    sessions = recorded_sessions()
    assert len(sessions) == 3
    model = SessionModel()
    turns = sorted(((r["t"], sid, r) for sid, rs in sessions for r in rs), key=lambda e: e[0])
    for _, sid, r in turns:
        model.observe_turn(sid, r["t"], r["t"] + r["api_time"], r["in"], r["out"])
    for sid, rs in sessions:
        own = {
            "output": mean(r["out"] for r in rs),
            "gap": mean(b["t"] - (a["t"] + a["api_time"]) for a, b in itertools.pairwise(rs)),
            "growth": mean(b["in"] - a["in"] for a, b in itertools.pairwise(rs)),
        }
        learned = {
            "output": model.output_tokens(sid),
            "gap": model.gap_s(sid),
            "growth": model.growth_tokens(sid),
        }
        fleet = {
            "output": model.fleet.output.mean,
            "gap": model.fleet.gap.mean,
            "growth": model.fleet.growth.mean,
        }
        for k in own:
            assert abs(learned[k] - own[k]) < abs(fleet[k] - own[k]), (sid, k, learned[k], own[k], fleet[k])


def test_a_new_session_is_the_fleets_and_hints_win() -> None:
    model = SessionModel(prior_output_tokens=444, prior_gap_s=10)
    assert model.output_tokens("new") == 444 and model.gap_s("new") == 10  # nothing seen yet
    for i in range(10):
        model.observe_turn(
            "a", start=i * 100.0, end=i * 100.0 + 5, input_tokens=1000 * (i + 1), output_tokens=300
        )
    assert model.output_tokens("b") == 300  # a session never seen: the fleet's mean
    assert model.gap_s("a") == pytest.approx(95.0)
    assert model.growth_tokens("a") == pytest.approx(1000.0)
    assert model.gap_s("a", hinted=4.0) == 4.0
    assert model.output_tokens("a", hinted=50) == 50


def test_the_session_table_is_bounded() -> None:
    model = SessionModel(max_sessions=3)
    for i in range(5):
        model.observe_turn(f"s{i}", 0.0, 1.0, 100, 10)
    assert list(model.sessions) == ["s2", "s3", "s4"]
    model.observe_turn("s2", 2.0, 3.0, 200, 10)  # seen again: the most recent
    model.observe_turn("s5", 0.0, 1.0, 100, 10)
    assert list(model.sessions) == ["s4", "s2", "s5"]


def test_a_link_prices_a_move_by_its_wait_and_learns_its_bandwidth() -> None:
    links = LinkModel(prior_bytes_per_s=1e9, prior_transfers=1)
    path = "store->e1"
    assert links.transfer_s(path, 2_000_000_000) == pytest.approx(2.0)
    links.started(path, "m1", 3_000_000_000)
    # queued behind 3 GB: a 1 GB move ends after 4 s, so it does not fit a 3 s tool gap
    assert links.transfer_s(path, 1_000_000_000) == pytest.approx(4.0)
    assert not links.finishes_within(path, 1_000_000_000, 3.0)
    links.finished(path, "m1", seconds=6.0)  # it ran at 0.5 GB/s
    assert links.backlog_bytes(path) == 0
    assert links.bytes_per_s(path) == pytest.approx(0.75e9)  # halfway from the prior (1 pseudo-transfer)
    links.started(path, "m2", 1)
    links.finished(path, "m2", seconds=None)  # failed: teaches nothing
    assert links.bytes_per_s(path) == pytest.approx(0.75e9)
    assert links.finishes_within("other->e2", 1_000_000_000, 3.0)  # another path: the prior


def test_the_link_tables_are_bounded() -> None:
    links = LinkModel(max_links=2, max_inflight=2)
    for i in range(3):
        links.started(f"p{i}", "t", 1)
    assert list(links.links) == ["p1", "p2"]
    for i in range(3):
        links.started("p2", f"t{i}", 10)
    assert links.backlog_bytes("p2") == 20
