"""Table-driven tests of every filter, scorer and picker, and of the router's profiles."""

from __future__ import annotations

import pytest

from gateway.core.policies.filters import Healthy, PoolByUncached, Saturation, ServesModel
from gateway.core.policies.scorers import (
    HomeLoadScorer,
    KvUsageScorer,
    ParentPrefixScorer,
    PrefixScorer,
    QueueScorer,
    SessionAffinityScorer,
    SpreadScorer,
)
from gateway.core.router import NoEngine, Router, RoutingParams
from gateway.core.types import EngineView, PoolRole, PrefixMatch, RouteRequest, SessionView, Snapshot

M = frozenset({"m"})


def eng(name: str, pool: str = "warm", role: PoolRole = PoolRole.WARM, **kw: object) -> EngineView:
    return EngineView(name=name, pool=pool, role=role, models=M, **kw)  # type: ignore[arg-type]


F0 = eng("f0", "first", PoolRole.FIRST_TURN)
W0, W1, W2 = eng("w0"), eng("w1"), eng("w2")


def req(tokens: int = 1024, **kw: object) -> RouteRequest:
    return RouteRequest(model="m", prompt_tokens=tokens, block_size=128, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("filt", "engines", "request_", "matches", "expected"),
    [
        (Healthy(), [W0, eng("w1", healthy=False)], req(), {}, ["w0"]),
        (
            ServesModel(),
            [W0, EngineView("x", "warm", PoolRole.WARM, frozenset({"other"}))],
            req(),
            {},
            ["w0"],
        ),
        # 4096 uncached tokens >= threshold 1000: first-turn pool
        (PoolByUncached(1000), [F0, W0], req(4096), {}, ["f0"]),
        # cached on w0 except 128 tokens: warm pool
        (PoolByUncached(1000), [F0, W0], req(4096), {"w0": PrefixMatch(31, 31, 31)}, ["w0"]),
        # the prefix is cached only on the first-turn engine: a warm engine would recompute it
        # all, so the turn stays on the first-turn side (until the planner moves its KV)
        (PoolByUncached(1000), [F0, W0], req(4096), {"f0": PrefixMatch(31, 31, 31)}, ["f0"]),
        # ... and once the KV is on a warm engine too, the turn goes warm
        (
            PoolByUncached(1000),
            [F0, W0],
            req(4096),
            {"f0": PrefixMatch(31, 31, 31), "w0": PrefixMatch(31, 31, 31)},
            ["w0"],
        ),
        # no engine of the wanted role: keep all
        (PoolByUncached(1000), [W0], req(4096), {}, ["w0"]),
        (PoolByUncached(1000), [F0, W0, eng("a", "any", PoolRole.ANY)], req(10), {}, ["w0", "a"]),
        (Saturation(4), [eng("w0", running=9), W1], req(), {}, ["w1"]),
        (Saturation(4), [eng("w0", running=9)], req(), {}, ["w0"]),
    ],
)
def test_filters(filt, engines, request_, matches, expected) -> None:  # type: ignore[no-untyped-def]
    snap = Snapshot(engines=tuple(engines), matches=matches)
    assert [e.name for e in filt.filter(request_, snap, engines)] == expected


SESSION = SessionView("s", home="w1", pool="warm", turns=3, context_tokens=4000, parent_home="w2")


@pytest.mark.parametrize(
    ("scorer", "engines", "request_", "snap_kw", "expected"),
    [
        (PrefixScorer(), [W0, W1], req(1024), {"matches": {"w0": PrefixMatch(8, 8, 8.0)}}, [1.0, 0.0]),
        (PrefixScorer(), [W0], req(1024), {"matches": {"w0": PrefixMatch(8, 4, 6.4)}}, [0.8]),
        (PrefixScorer(), [W0], req(100), {}, [0.0]),
        (
            QueueScorer(),
            [eng("w0", running=2), eng("w1", running=6), eng("w2", inflight=4)],
            req(),
            {},
            [1.0, 0.0, 0.5],
        ),
        (QueueScorer(), [W0, W1], req(), {}, [1.0, 1.0]),
        (KvUsageScorer(), [eng("w0", kv_usage=0.25)], req(), {}, [0.75]),
        # blocks held only by device soft pins yield to admission: not used for the new request
        (KvUsageScorer(), [eng("w0", kv_usage=0.75, pinned_share=0.5)], req(), {}, [0.75]),
        (KvUsageScorer(), [eng("w0", kv_usage=0.5, pinned_share=0.5)], req(), {}, [1.0]),
        # shares scraped at different moments may disagree: never above 1
        (KvUsageScorer(), [eng("w0", kv_usage=0.25, pinned_share=0.5)], req(), {}, [1.0]),
        (SessionAffinityScorer(), [W0, W1], req(), {"session": SESSION}, [0.0, 1.0]),
        (SessionAffinityScorer(), [W0, W1], req(), {}, [0.0, 0.0]),
        (ParentPrefixScorer(), [W0, W2], req(is_subagent=True), {"session": SESSION}, [0.0, 1.0]),
        (
            ParentPrefixScorer(),
            [W0, W2],
            req(1024, is_subagent=True),
            {"session": SESSION, "parent_matches": {"w0": PrefixMatch(4, 4, 4.0)}},
            [0.5, 1.0],
        ),
        (ParentPrefixScorer(), [W0, W2], req(), {"session": SESSION}, [0.0, 0.0]),
        (SpreadScorer(), [W0, W1], req(), {"siblings": {"w0": 3}}, [0.25, 1.0]),
        (
            HomeLoadScorer(),
            [eng("w0", homed_tokens=90_000), eng("w1", homed_tokens=10_000), eng("w2", homed_tokens=50_000)],
            req(),
            {},
            [0.0, 1.0, 0.5],
        ),
        (HomeLoadScorer(), [W0, W1], req(), {}, [1.0, 1.0]),
    ],
)
def test_scorers(scorer, engines, request_, snap_kw, expected) -> None:  # type: ignore[no-untyped-def]
    snap = Snapshot(engines=tuple(engines), **snap_kw)
    assert list(scorer.score(request_, snap, engines)) == pytest.approx(expected)


def route(
    profile: str, engines: list[EngineView], r: RouteRequest, split: str = "cost", **snap_kw: object
) -> tuple[str, str]:
    d = Router(RoutingParams(profile=profile, first_turn_threshold_tokens=2048, split=split)).route(
        r,
        Snapshot(engines=tuple(engines), **snap_kw),  # type: ignore[arg-type]
    )
    return d.engine, d.reason


def test_agentic_sticks_to_home_under_bounded_load() -> None:
    hot_home = eng("w1", running=12)
    assert route("agentic", [W0, hot_home], req(4096, session_id="s"), session=SESSION) == ("w1", "sticky")


def test_agentic_leaves_overloaded_home_only_when_cheaper() -> None:
    hot = eng("w1", running=40)
    # home holds the whole prefix; w0 holds nothing: recomputing 40K tokens (0.8 s) beats 40 x 50 ms
    m = {"w1": PrefixMatch(300, 300, 300.0)}
    assert route("agentic", [W0, hot], req(40_000, session_id="s"), session=SESSION, matches=m) == (
        "w0",
        "sticky_overflow",
    )
    # past the saturation bound the home is filtered out: rehome
    saturated = eng("w1", running=200)
    assert route("agentic", [W0, saturated], req(40_000, session_id="s"), session=SESSION, matches=m) == (
        "w0",
        "rehome",
    )
    # with a cheap alternative queue but a huge recompute, stay home
    busy = eng("w1", running=20)
    assert (
        route(
            "agentic",
            [W0, busy],
            req(400_000, session_id="s"),
            session=SESSION,
            matches={"w1": PrefixMatch(3000, 3000, 3000.0)},
        )[0]
        == "w1"
    )


def test_agentic_first_turn_goes_to_first_turn_pool() -> None:
    # the fixed split sends every long fresh prompt to the first-turn pool; the cost split lets
    # idle warm engines take it and sends it to first-turn when warm engines are decoding
    # (tests/core/test_split.py)
    assert route("agentic", [F0, W0, W1], req(8000, session_id="new"), split="wall") == ("f0", "new_session")
    assert route("agentic", [F0, W0, W1], req(8000, session_id="new")) == ("w1", "new_session")
    busy = [F0, eng("w0", decoding=16), eng("w1", decoding=16)]
    assert route("agentic", busy, req(8000, session_id="new")) == ("f0", "new_session")


def test_agentic_warm_turn_of_new_session_with_cached_prefix_goes_warm() -> None:
    m = {"w0": PrefixMatch(60, 60, 60.0)}
    assert route("agentic", [F0, W0, W1], req(8000, session_id="new"), matches=m) == ("w0", "new_session")


def test_agentic_subagent_lands_by_parent_prefix() -> None:
    s = SessionView("child", home=None, pool=None, turns=0, context_tokens=0, parent_home="w2")
    r = req(1024, session_id="child", parent_session_id="p", is_subagent=True)
    assert route("agentic", [W0, W1, W2], r, session=s, parent_matches={"w2": PrefixMatch(8, 8, 8.0)}) == (
        "w2",
        "subagent_parent",
    )


def test_agentic_fan_out_spreads_when_parent_engine_is_busy_with_siblings() -> None:
    s = SessionView("c4", home=None, pool=None, turns=0, context_tokens=0, parent_home="w0")
    r = req(1024, session_id="c4", parent_session_id="p", is_subagent=True, fan_out=4)
    pm = {"w0": PrefixMatch(8, 8, 8.0), "w1": PrefixMatch(8, 8, 8.0)}
    engine, _ = route("agentic", [W0, W1, W2], r, session=s, parent_matches=pm, siblings={"w0": 3})
    assert engine == "w1"


def test_round_robin_cycles_and_hash_is_stable() -> None:
    got = [route("round_robin", [W0, W1, W2], req(seq=i))[0] for i in range(6)]
    assert got == ["w0", "w1", "w2", "w0", "w1", "w2"]
    a = route("session_hash", [W0, W1, W2], req(session_id="abc"))
    assert all(route("session_hash", [W2, W1, W0], req(session_id="abc")) == a for _ in range(3))


def test_least_loaded_and_precise_prefix() -> None:
    assert route("least_loaded", [eng("w0", running=3), eng("w1", running=1)], req())[0] == "w1"
    m = {"w0": PrefixMatch(8, 8, 8.0)}
    assert route("precise_prefix", [W0, W1], req(1024), matches=m) == ("w0", "prefix")


@pytest.mark.parametrize(
    ("engines", "matches", "expected"),
    [
        ([eng("w0", running=100), eng("w1", running=1)], {"w0": PrefixMatch(8, 8, 8.0)}, ("w1", "load")),
        ([W0, W1], {"w1": PrefixMatch(6, 6, 6.0)}, ("w1", "prefix")),
        (
            [eng("w0", kv_usage=0.5), eng("w1", kv_usage=0.1)],
            {"w0": PrefixMatch(2, 2, 2.0)},
            ("w1", "cache_room"),
        ),
    ],
)
def test_cache_aware(engines, matches, expected) -> None:  # type: ignore[no-untyped-def]
    assert route("cache_aware", engines, req(1024), matches=matches) == expected


def test_kv_usage_discounts_the_pinned_share_when_routing() -> None:
    """w0 looks fuller by vLLM's gauge, but most of it is soft-pinned blocks that yield: the
    kv_usage scorer then prefers w0, and without the discount it prefers w1."""
    params = RoutingParams(profile="agentic")
    pinned = [eng("w0", kv_usage=0.8, pinned_share=0.7), eng("w1", kv_usage=0.5)]
    unpinned = [eng("w0", kv_usage=0.8), eng("w1", kv_usage=0.5)]
    for engines, best in ((pinned, "w0"), (unpinned, "w1")):
        d = Router(params).route(req(), Snapshot(engines=tuple(engines)))
        kv = {c.engine: c.scores["kv_usage"] for c in d.candidates}
        assert max(kv, key=kv.__getitem__) == best, kv
        assert d.engine == best
    d = Router(params).route(req(), Snapshot(engines=tuple(pinned)))
    assert {c.engine: c.scores["kv_usage"] for c in d.candidates} == pytest.approx({"w0": 0.9, "w1": 0.5})


def test_no_engine_errors() -> None:
    with pytest.raises(NoEngine) as e:
        route("agentic", [W0], RouteRequest(model="zzz", prompt_tokens=1, block_size=128))
    assert e.value.reason == "unknown_model"
    with pytest.raises(NoEngine) as e:
        route("agentic", [eng("w0", healthy=False)], req())
    assert e.value.reason == "unavailable"


def test_decision_lists_same_pool_fallbacks_and_breakdown() -> None:
    d = Router(RoutingParams(profile="least_loaded")).route(
        req(), Snapshot(engines=(eng("w0", running=1), W1, F0))
    )
    assert d.engine in ("w1", "f0")
    assert all(c.scores for c in d.candidates)
    assert set(d.fallbacks) <= {"w0", "w1"}


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing profile"):
        Router(RoutingParams(profile="magic"))


def cap(name: str, kv_usage: float, capacity_blocks: int = 100) -> EngineView:
    return eng(name, kv_usage=kv_usage, capacity_blocks=capacity_blocks)


def sticky_route(
    engines: list[EngineView],
    held: dict[str, int],
    prompt_blocks: int = 20,
    tok_s: float = 0.0,
    home: str | None = "a",
    move_max_s: float = 0.0,
) -> tuple[str, str]:
    """``tok_s`` 0: the fit check at a full cache alone (no decode knee)."""
    session = SessionView("s", home=home, pool="warm", turns=3, context_tokens=0) if home else None
    matches = {k: PrefixMatch(v, v, float(v)) for k, v in held.items()}
    r = RouteRequest(
        model="m", prompt_tokens=64 * prompt_blocks, block_size=64, session_id="s" if home else None
    )
    d = Router(RoutingParams(profile="agentic", interactivity_tok_s=tok_s, knee_move_max_s=move_max_s)).route(
        r, Snapshot(engines=tuple(engines), matches=matches, session=session)
    )
    return d.engine, d.reason


def test_sticky_stays_home_when_the_turn_fits() -> None:
    assert sticky_route([cap("a", 0.5), cap("b", 0.0)], {"a": 19}) == ("a", "sticky")


def test_sticky_leaves_a_home_that_cannot_hold_the_turn() -> None:
    assert sticky_route([cap("a", 0.9), cap("b", 0.1)], {"a": 19}) == ("b", "kv_overflow")


def test_a_request_without_a_home_goes_where_it_fits() -> None:
    """The best-scored engine (a: the prefix) cannot hold the prompt: the one that can wins; when
    none can, the scores decide (the simulator's thrash: one turn preempting itself 7,223 times)."""
    assert sticky_route([cap("a", 0.9), cap("b", 0.1)], {"a": 19}, home=None) == ("b", "kv_overflow")
    assert sticky_route([cap("a", 0.5), cap("b", 0.1)], {"a": 19}, home=None) == ("a", "prefix")
    assert sticky_route([cap("a", 0.9), cap("b", 0.9)], {"a": 19}, home=None) == ("a", "prefix")


def test_sticky_home_full_of_soft_pins_still_holds_the_turn() -> None:
    """vLLM's gauge says 90% used, but 60% of the device is soft-pinned blocks that yield to
    admission: the turn fits at home. The room checks read the unpinned share, not the gauge."""
    pinned = eng("a", kv_usage=0.9, capacity_blocks=100, pinned_share=0.6)
    assert pinned.unpinned_usage == pytest.approx(0.3)
    assert sticky_route([pinned, cap("b", 0.1)], {"a": 19}) == ("a", "sticky")
    assert sticky_route([cap("a", 0.9), cap("b", 0.1)], {"a": 19}) == ("b", "kv_overflow")


def test_sticky_leaves_a_cold_home() -> None:
    assert sticky_route([cap("a", 0.1), cap("b", 0.1)], {"a": 2, "b": 19}) == ("b", "rehome_cold")


# prompts of 10 blocks on engines of 100 (0.1 of the KV each); the default cost model's decode
# knee at 50 tok/s is u = 0.31
@pytest.mark.parametrize(
    ("engines", "held", "prompt_blocks", "home", "expected", "why"),
    [
        ([cap("a", 0.15), cap("b", 0.0)], {"a": 9}, 10, "a", ("a", "sticky"), "0.25 at home: under the knee"),
        (
            [cap("a", 0.25), cap("b", 0.0)],
            {"a": 9},
            10,
            "a",
            ("b", "kv_balance"),
            "0.35 at home: past the knee, b stays under it",
        ),
        (
            [cap("a", 0.25), cap("b", 0.25), cap("c", 0.3)],
            {"a": 9},
            10,
            "a",
            ("a", "sticky"),
            "past the knee everywhere: keep the home",
        ),
        (
            [cap("a", 0.25), cap("b", 0.05), cap("c", 0.15)],
            {"a": 9, "c": 8},
            10,
            "a",
            ("b", "kv_balance"),
            "of the engines under the knee, the one with the most room (c, which holds the"
            " prefix, would be at 0.25 and pass the knee again next turn)",
        ),
        (
            [cap("a", 0.25), cap("b", 0.05), cap("c", 0.05)],
            {"a": 9, "c": 8},
            10,
            "a",
            ("c", "kv_balance"),
            "equal room: the one that recomputes least",
        ),
        (
            [cap("a", 0.0), cap("b", 0.0)],
            {"a": 39},
            40,
            "a",
            ("a", "sticky"),
            "a turn past the knee on its own stays home (it is slow anywhere)",
        ),
        (
            [eng("a", kv_usage=0.5, capacity_blocks=100, pinned_share=0.4), cap("b", 0.0)],
            {"a": 9},
            10,
            "a",
            ("a", "sticky"),
            "soft pins yield: 0.1 unpinned + 0.1",
        ),
        (
            [cap("a", 0.25), cap("b", 0.0)],
            {"a": 9},
            10,
            None,
            ("b", "kv_balance"),
            "no session: the best-scored engine (prefix) is past the knee",
        ),
        (
            [
                cap("a", 0.05),
                eng("b", kv_usage=0.0, capacity_blocks=100, inflight_tokens=64 * 25),
                cap("c", 0.1),
            ],
            {"a": 9, "b": 9},
            10,
            "a",
            ("a", "sticky"),
            "home under the knee",
        ),
        (
            [eng("a", kv_usage=0.05, capacity_blocks=100, inflight_tokens=64 * 25), cap("b", 0.0)],
            {"a": 9},
            10,
            "a",
            ("b", "kv_balance"),
            "the gauge says 0.05 but 25 blocks are in flight to the home: 0.35 with the turn",
        ),
        (
            [cap("a", 0.1), cap("b", 0.0)],
            {"a": 9},
            10,
            None,
            ("a", "prefix"),
            "no session, best-scored engine under the knee",
        ),
    ],
)
def test_sticky_keeps_decoding_kv_under_the_knee(engines, held, prompt_blocks, home, expected, why) -> None:  # type: ignore[no-untyped-def]
    assert sticky_route(engines, held, prompt_blocks, tok_s=50.0, home=home) == expected, why


@pytest.mark.parametrize(
    ("move_max_s", "expected"),
    [
        # a holds 9 of 10 blocks, b none, c 4: the move to b recomputes 576 tokens more than
        # staying (11.5 ms at 2e-5 s per token), to c 320 more (6.4 ms)
        (0.0, ("b", "kv_balance")),  # 0: no budget
        (0.010, ("c", "kv_balance")),  # b is over the budget, c (still under the knee) is not
        (0.005, ("a", "sticky")),  # every move costs more than 5 ms: stay, past the knee
    ],
)
def test_a_knee_move_is_priced_against_its_ttft_budget(move_max_s: float, expected: tuple[str, str]) -> None:
    engines = [cap("a", 0.25), cap("b", 0.0), cap("c", 0.1)]
    assert sticky_route(engines, {"a": 9, "c": 4}, 10, tok_s=50.0, move_max_s=move_max_s) == expected


def test_the_decode_knee_is_on_by_default_and_off_at_zero() -> None:
    assert RoutingParams().interactivity_tok_s == 50.0
    engines = [cap("a", 0.25), cap("b", 0.0)]
    assert sticky_route(engines, {"a": 9}, 10, tok_s=RoutingParams().interactivity_tok_s) == (
        "b",
        "kv_balance",
    )
    assert sticky_route(engines, {"a": 9}, 10, tok_s=0.0) == ("a", "sticky")


@pytest.mark.parametrize(
    ("capacity_tokens", "expected"),
    [
        (655_360, ("b", "kv_balance")),  # the knee at u = 0.15: a at 0.1 + 0.1 passes it, b stays under
        (0, ("a", "sticky")),  # without the context term a flat 20.9 ms step never reaches 25 ms
    ],
)
def test_the_knee_with_the_batch_and_context_terms(capacity_tokens: int, expected: tuple[str, str]) -> None:
    """The H200 AIC fit's decode step (20.78 ms + 0.0846 ms per sequence + 42.15 ms per million
    context tokens) has a knee at 40 tok/s only when the router's cost model carries its terms."""
    p = RoutingParams(
        profile="agentic",
        interactivity_tok_s=40.0,
        cost_decode_ms=(20.78, 0.0, 0.0),
        cost_decode_seq_ms=0.0846,
        cost_decode_kv_ms_per_mtok=42.15,
        cost_kv_capacity_tokens=capacity_tokens,
    )
    session = SessionView("s", home="a", pool="warm", turns=3, context_tokens=0)
    r = RouteRequest(model="m", prompt_tokens=64 * 10, block_size=64, session_id="s")
    snap = Snapshot(
        engines=(cap("a", 0.1), cap("b", 0.0)), matches={"a": PrefixMatch(9, 9, 9.0)}, session=session
    )
    d = Router(p).route(r, snap)
    assert (d.engine, d.reason) == expected


# -- placement defects a real client found ---------------------------------------------------------


# a prompt of 36 blocks of 64 tokens (2,304); "b" holds 30 of them (0.83)
def client_route(
    engines: list[EngineView],
    held: dict[str, int],
    home: str | None,
    session: str | None = "s",
    subagent: bool = False,
    **params: object,
) -> tuple[str, str]:
    view = SessionView("s", home=home, pool="warm", turns=3, context_tokens=0) if home else None
    matches = {k: PrefixMatch(v, v, float(v)) for k, v in held.items()}
    r = RouteRequest(
        model="m", prompt_tokens=64 * 36, block_size=64, session_id=session, is_subagent=subagent
    )
    p = RoutingParams(profile="agentic", **params)  # type: ignore[arg-type]
    d = Router(p).route(r, Snapshot(engines=tuple(engines), matches=matches, session=view))
    return d.engine, d.reason


@pytest.mark.parametrize(
    ("engines", "held", "flag", "expected", "why"),
    [
        (
            [eng("a"), eng("b", running=1)],
            {"b": 30},
            True,
            ("b", "rehome_cold"),
            "a cold home (0 of 36 blocks) re-scored without its affinity bonus: b's 0.83 prefix wins",
        ),
        (
            [eng("a"), eng("b", running=1)],
            {"b": 30},
            False,
            ("a", "rehome_cold"),
            "as first built: a (affinity 2 + queue 1 + kv 0.5 = 3.5) beat b (2.5 + 0 + 0.5 = 3.0)",
        ),
        (
            [eng("a"), eng("b", running=1), eng("c")],
            {"a": 1, "b": 30},
            True,
            ("b", "rehome_cold"),
            "1 block at home < half of b's 30: cold, and without the bonus b still wins",
        ),
        (
            [eng("a"), eng("b", running=1)],
            {"a": 20, "b": 30},
            True,
            ("a", "sticky"),
            "20 of b's 30 is warm enough: the home keeps the turn",
        ),
    ],
)
def test_a_cold_home_loses_its_affinity_bonus(engines, held, flag, expected, why) -> None:  # type: ignore[no-untyped-def]
    got = client_route(engines, held, home="a", interactivity_tok_s=0.0, cold_home_no_affinity=flag)
    assert got == expected, why


@pytest.mark.parametrize(
    ("engines", "held", "session", "subagent", "flag", "expected", "why"),
    [
        (
            [eng("a"), eng("b")],
            {"a": 30},
            "s",
            False,
            True,
            ("a", "new_session"),
            "the engine with the shared system prompt and an empty queue: the prefix pull holds",
        ),
        (
            [eng("a", running=1), eng("b")],
            {"a": 30},
            "s",
            False,
            True,
            ("b", "new_session_load"),
            "one request queued there (50 ms) costs more than the 1,920 tokens it saves (38 ms)",
        ),
        (
            [eng("a", running=3), eng("b", running=1), eng("c", running=2)],
            {"a": 30},
            "s",
            False,
            True,
            ("b", "new_session_load"),
            "of the engines without the prefix, the shortest queue",
        ),
        (
            [eng("a", running=3), eng("b")],
            {"a": 30},
            "s",
            False,
            False,
            ("a", "new_session"),
            "as first built: the prefix pull wins whatever the queue",
        ),
        (
            [eng("a", running=3), eng("b")],
            {"a": 30},
            None,
            False,
            True,
            ("a", "prefix"),
            "a request without a session is not a new session: the scores decide",
        ),
        (
            [eng("a", running=1), eng("b")],
            {"b": 0},
            "s",
            False,
            True,
            ("b", "new_session"),
            "no prefix anywhere: the scores decide (the queue)",
        ),
    ],
)
def test_new_sessions_spread_by_expected_load(engines, held, session, subagent, flag, expected, why) -> None:  # type: ignore[no-untyped-def]
    got = client_route(
        engines,
        held,
        home=None,
        session=session,
        subagent=subagent,
        interactivity_tok_s=0.0,
        new_session_load=flag,
    )
    assert got == expected, why


# the default cost model (Dynamo's mocker: knee at u = 0.31, 20 ms per token there) on engines of
# 16,384 blocks of 64 tokens; reloads at 2.3 GB/s with 128 KiB per token (17.5K tokens per second)
def big(name: str, kv_usage: float) -> EngineView:
    return eng(name, kv_usage=kv_usage, capacity_blocks=16_384)


@pytest.mark.parametrize(
    ("home_kv", "prompt", "held_b", "output", "expected", "why"),
    [
        (0.3, 100_000, 0, 100, ("a", "sticky"), "100K tokens reloaded (5.7 s) for 0.3 s of decode saved"),
        (0.3, 100_000, 98_000, 100, ("b", "kv_balance"), "b lacks 2K tokens (0.11 s) < 0.3 s saved"),
        (
            0.3,
            100_000,
            0,
            0,
            ("b", "kv_balance"),
            "not priced (knee_output_tokens 0): the move as first built",
        ),
        (0.6, 5_000, 0, 100, ("b", "kv_balance"), "5K tokens (0.29 s) < 0.9 s saved at a step 9 ms late"),
        (0.6, 5_000, 0, 20, ("a", "sticky"), "over 20 tokens only 0.18 s is saved"),
    ],
)
def test_an_arrival_knee_move_pays_for_its_reload(home_kv, prompt, held_b, output, expected, why) -> None:  # type: ignore[no-untyped-def]
    session = SessionView("s", home="a", pool="warm", turns=3, context_tokens=prompt)
    matches = {
        "a": PrefixMatch(prompt // 64, prompt // 64, prompt / 64),
        "b": PrefixMatch(held_b // 64, held_b // 64, held_b / 64),
    }
    r = RouteRequest(model="m", prompt_tokens=prompt, block_size=64, session_id="s")
    p = RoutingParams(profile="agentic", knee_output_tokens=output)
    d = Router(p).route(
        r, Snapshot(engines=(big("a", home_kv), big("b", 0.0)), matches=matches, session=session)
    )
    assert (d.engine, d.reason) == expected, why


@pytest.mark.parametrize(
    ("prompt", "held_b", "wait_tokens", "expected", "why"),
    [
        (
            200_000,
            0,
            222,
            ("a", "sticky"),
            "a 200K reload (11.4 s) takes longer than 222 steps (~7 s) at home",
        ),
        (20_000, 0, 222, ("b", "kv_overflow"), "a 20K reload (1.1 s) is shorter than the wait"),
        (200_000, 190_000, 222, ("b", "kv_overflow"), "b holds all but 10K tokens (0.6 s)"),
        (200_000, 0, 0, ("b", "kv_overflow"), "not priced (overflow_wait_tokens 0): the move as first built"),
    ],
)
def test_a_turn_that_does_not_fit_at_home_moves_only_when_its_reload_beats_the_wait(  # type: ignore[no-untyped-def]
    prompt, held_b, wait_tokens, expected, why
) -> None:
    session = SessionView("s", home="a", pool="warm", turns=3, context_tokens=prompt)
    matches = {"a": PrefixMatch(prompt // 64, prompt // 64, prompt / 64)}
    if held_b:
        matches["b"] = PrefixMatch(held_b // 64, held_b // 64, held_b / 64)
    r = RouteRequest(model="m", prompt_tokens=prompt, block_size=64, session_id="s")
    p = RoutingParams(profile="agentic", overflow_wait_tokens=wait_tokens, interactivity_tok_s=0.0)
    snap = Snapshot(engines=(big("a", 0.99), big("b", 0.3)), matches=matches, session=session)
    d = Router(p).route(r, snap)
    assert (d.engine, d.reason) == expected, why
