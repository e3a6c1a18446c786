"""Admission control: tenant limits answer 429, capacity 503, both with Retry-After; the wait
queue is bounded and serves interactive turns before background subagents. Events and counters
only (a hand-driven clock, no timing)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.errors import to_api_error
from gateway.config import AdmissionConfig
from gateway.service.admission import Admission, AdmissionRejected, Turnstile
from gateway.service.metrics import GatewayMetrics
from gateway.service.tenants import ANONYMOUS, Tenant


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock: Clock | None = None, **kw: object) -> Admission:
    cfg = AdmissionConfig(**{"max_inflight": 2, "max_queue": 2, "queue_timeout_s": 30.0, **kw})  # type: ignore[arg-type]
    return Admission(cfg, clock or Clock(), GatewayMetrics())


async def hold(
    adm: Admission,
    tenant: Tenant,
    release: asyncio.Event,
    order: list[str],
    tag: str,
    interactive: bool = True,
) -> None:
    async with adm.admit(tenant, interactive=interactive):
        order.append(tag)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def drained(adm: Admission, clock: Clock) -> None:
    """8 slots freed over 4 s: the gateway's queue drains 2 a second."""
    for _ in range(8):
        async with adm.admit(ANONYMOUS):
            pass
        clock.t += 0.5


async def test_tenant_concurrency_is_429_with_retry_after() -> None:
    adm = make(max_inflight=10)
    t = Tenant("acme", max_concurrent=1)
    async with adm.admit(t):
        with pytest.raises(AdmissionRejected) as e:
            async with adm.admit(t):
                pass
        assert (to_api_error(e.value).status, e.value.code, e.value.retry_after) == (
            429,
            "tenant_concurrency",
            1,
        )
        async with adm.admit(Tenant("other", max_concurrent=1)):  # other tenants are not affected
            pass
    async with adm.admit(t):  # freed
        pass
    assert adm.tenant_inflight(t) == 0 and adm.stats.rejected == {"tenant_concurrency": 1}


async def test_request_rate_bucket_refills_from_the_clock() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=10)
    t = Tenant("acme", requests_per_s=2, burst_s=1)
    for _ in range(2):
        async with adm.admit(t):
            pass
    with pytest.raises(AdmissionRejected) as e:
        async with adm.admit(t):
            pass
    assert (to_api_error(e.value).status, e.value.code, e.value.retry_after) == (
        429,
        "tenant_rate_limited",
        1,
    )
    clock.t += 0.5  # one request's worth
    async with adm.admit(t):
        pass
    with pytest.raises(AdmissionRejected):
        async with adm.admit(t):
            pass


async def test_token_rate_with_debt_from_completion_tokens() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=10)
    t = Tenant("acme", tokens_per_s=100, burst_s=1)
    async with adm.admit(t, tokens=60):
        pass
    adm.charge(t, 340)  # completion tokens learnt afterwards: bucket at -300
    with pytest.raises(AdmissionRejected) as e:
        async with adm.admit(t, tokens=10):
            pass
    assert (e.value.code, e.value.retry_after) == ("tenant_token_rate_limited", 4)  # (10+300)/100 s
    clock.t += 4
    async with adm.admit(t, tokens=10):
        pass
    # a request larger than the bucket is admitted once the bucket is full (never starved)
    clock.t += 10
    async with adm.admit(t, tokens=5000):
        pass


async def test_tenant_limits_are_checked_on_entry_and_the_token_estimate_settled_after() -> None:
    """The relay enters a request before reading its body (tokens estimated from its declared
    length) and settles the estimate with the analysed count: a refund or a further debit,
    never a rejection at that point."""
    clock = Clock()
    adm = make(clock, max_inflight=10)
    t = Tenant("acme", tokens_per_s=100, burst_s=1, max_concurrent=1, requests_per_s=10)
    entered = adm.enter(t, tokens=400)  # estimate past the bucket: admitted (never starved)
    assert adm.tenant_inflight(t) == 1
    with pytest.raises(AdmissionRejected) as e:
        adm.enter(t)  # its concurrency is held from entry, before any body is read
    assert e.value.code == "tenant_concurrency"
    async with adm.admit(t, tokens=150, entered=entered):  # analysed: 150, 250 refunded
        assert adm.tenant_inflight(t) == 1
    assert adm.tenant_inflight(t) == 1  # admit does not give back what enter took
    entered.leave()
    entered.leave()  # idempotent
    assert adm.tenant_inflight(t) == 0
    bucket = adm.tenants["acme"].tokens
    assert bucket is not None and bucket.level == pytest.approx(-50)
    with pytest.raises(AdmissionRejected) as e:
        adm.enter(t, tokens=1)
    assert (e.value.code, e.value.retry_after) == ("tenant_token_rate_limited", 1)
    assert adm.tenant_inflight(t) == 0  # a refused entry holds nothing


async def test_full_gateway_queues_then_503_when_the_queue_is_full() -> None:
    adm = make(max_inflight=1, max_queue=1, retry_after_s=3)
    release, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, release, order, "first"))
    await settle()
    queued = asyncio.create_task(hold(adm, ANONYMOUS, release, order, "queued"))
    await settle()
    assert (adm.inflight, adm.waiting, order) == (1, 1, ["first"])
    with pytest.raises(AdmissionRejected) as e:
        async with adm.admit(ANONYMOUS):
            pass
    assert (to_api_error(e.value).status, e.value.code, e.value.retry_after) == (503, "gateway_busy", 3)
    release.set()
    await asyncio.gather(first, queued)
    assert order == ["first", "queued"] and adm.stats.queued == 1
    assert (adm.inflight, adm.waiting) == (0, 0)
    text = adm.metrics.render().decode()  # type: ignore[union-attr]
    assert 'agentgw_admission_rejections_total{reason="gateway_busy"} 1.0' in text


async def test_interactive_turns_are_admitted_before_background_subagents() -> None:
    adm = make(max_inflight=1, max_queue=10)
    release, order = asyncio.Event(), []
    gate = asyncio.Event()
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    tasks = [asyncio.create_task(hold(adm, ANONYMOUS, release, order, "bg1", interactive=False))]
    await settle()
    tasks.append(asyncio.create_task(hold(adm, ANONYMOUS, release, order, "bg2", interactive=False)))
    await settle()
    tasks.append(asyncio.create_task(hold(adm, ANONYMOUS, release, order, "fg1")))
    await settle()
    tasks.append(asyncio.create_task(hold(adm, ANONYMOUS, release, order, "fg2")))
    await settle()
    assert adm.waiting == 4
    release.set()
    gate.set()
    await asyncio.gather(first, *tasks)
    assert order == ["first", "fg1", "fg2", "bg1", "bg2"]


async def test_queue_timeout_is_503_and_a_cancelled_waiter_leaves_no_trace() -> None:
    adm = make(max_inflight=1, max_queue=5, queue_timeout_s=0.01)
    release, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, release, order, "first"))
    await settle()
    with pytest.raises(AdmissionRejected) as e:
        async with adm.admit(ANONYMOUS):
            pass
    assert (to_api_error(e.value).status, e.value.code) == (503, "gateway_busy")
    waiter = asyncio.create_task(hold(adm, ANONYMOUS, release, order, "cancelled"))
    await settle()
    assert adm.waiting == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert adm.waiting == 0
    release.set()
    await first
    assert (adm.inflight, adm.waiting, order) == (0, 0, ["first"])
    async with adm.admit(ANONYMOUS):  # the slot was not leaked
        assert adm.inflight == 1


async def test_engine_slots_are_bounded_per_engine() -> None:
    adm = make(max_inflight=10, max_inflight_per_engine=1, max_queue_per_engine=0)
    async with adm.engine_slot("e0"):
        assert not adm.engine_has_room("e0") and adm.engine_has_room("e1")
        with pytest.raises(AdmissionRejected) as e:
            async with adm.engine_slot("e0"):
                pass
        assert (to_api_error(e.value).status, e.value.code) == (503, "engine_busy")
        async with adm.engine_slot("e1"):
            pass
    assert adm.engine_has_room("e0")


async def test_many_clients_never_exceed_the_limits() -> None:
    adm = make(max_inflight=3, max_queue=20)
    t = Tenant("acme", max_concurrent=8)
    peak = {"global": 0, "tenant": 0}
    outcomes: list[str] = []

    async def client() -> None:
        try:
            async with adm.admit(t):
                peak["global"] = max(peak["global"], adm.inflight)
                peak["tenant"] = max(peak["tenant"], adm.tenant_inflight(t))
                await settle()
            outcomes.append("ok")
        except AdmissionRejected as e:
            outcomes.append(str(e.code))

    await asyncio.gather(*(client() for _ in range(50)))
    assert peak["global"] <= 3 and peak["tenant"] <= 8
    assert outcomes.count("ok") >= 3 and set(outcomes) <= {"ok", "tenant_concurrency"}
    assert len(outcomes) == 50 and (adm.inflight, adm.waiting, adm.tenant_inflight(t)) == (0, 0, 0)


async def test_turnstile_lets_per_tick_through_each_loop_iteration() -> None:
    gate = Turnstile(per_tick=4)
    iteration = 0
    stop = False

    def count() -> None:  # one call per loop iteration
        nonlocal iteration
        iteration += 1
        if not stop:
            asyncio.get_running_loop().call_soon(count)

    asyncio.get_running_loop().call_soon(count)
    await asyncio.sleep(0)
    passed_at: list[int] = []

    async def one() -> None:
        await gate.enter()
        passed_at.append(iteration)

    await asyncio.gather(*(one() for _ in range(10)))
    stop = True
    assert gate.deferred == 6 and gate.waiting == 0
    per_iteration = [passed_at.count(i) for i in sorted(set(passed_at))]
    assert per_iteration == [4, 4, 2]  # never more than per_tick in one iteration
    # a cancelled waiter leaves no trace; a caller alone passes at once
    waiting = [asyncio.create_task(gate.enter()) for _ in range(6)]
    await asyncio.sleep(0)
    waiting[-1].cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert gate.waiting == 0


async def test_waiting_tenants_are_served_in_proportion_to_their_shares() -> None:
    adm = make(max_inflight=1, max_queue=20)
    heavy, light = Tenant("heavy", share=2.0), Tenant("light", share=1.0)
    gate, release, order = asyncio.Event(), asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    tasks = []
    for i in range(6):  # heavy's waiters all arrive first: FIFO would serve them all first
        tasks.append(asyncio.create_task(hold(adm, heavy, release, order, f"heavy{i}")))
        await settle()
    for i in range(6):
        tasks.append(asyncio.create_task(hold(adm, light, release, order, f"light{i}")))
        await settle()
    assert adm.waiting == 12
    release.set()
    gate.set()
    await asyncio.gather(first, *tasks)
    served = [tag.rstrip("0123456789") for tag in order[1:10]]
    assert (served.count("heavy"), served.count("light")) == (6, 3)
    assert [t for t in order if t.startswith("light")] == [f"light{i}" for i in range(6)]  # FIFO


async def test_a_full_queue_pushes_out_the_tenant_furthest_over_its_share() -> None:
    adm = make(max_inflight=1, max_queue=4, retry_after_s=1)
    flood, quiet = Tenant("flood"), Tenant("quiet")
    gate, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    floods = [asyncio.create_task(hold(adm, flood, gate, order, f"flood{i}")) for i in range(4)]
    await settle()
    assert adm.waiting == 4
    quiet_turn = asyncio.create_task(hold(adm, quiet, gate, order, "quiet"))
    await settle()
    # flood's newest waiter made room for quiet's, and learnt it at once
    assert floods[3].done() and adm.global_slots.pushed_out == 1 and adm.waiting == 4
    with pytest.raises(AdmissionRejected) as e:
        await floods[3]
    assert (to_api_error(e.value).status, e.value.code) == (503, "gateway_busy")
    assert "under their share" in e.value.message
    with pytest.raises(AdmissionRejected):  # flood holds the most of the queue: the newcomer is refused
        async with adm.admit(flood):
            pass
    gate.set()
    await asyncio.gather(first, quiet_turn, *floods[:3])
    assert order[:2] == ["first", "flood0"] and "quiet" in order[2:4]  # fair share, not FIFO
    assert (adm.inflight, adm.waiting) == (0, 0)


async def test_an_interactive_turn_pushes_a_background_waiter_out_of_a_full_queue() -> None:
    adm = make(max_inflight=1, max_queue=2)
    gate, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    bg = [
        asyncio.create_task(hold(adm, ANONYMOUS, gate, order, f"bg{i}", interactive=False)) for i in range(2)
    ]
    await settle()
    fg = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "fg"))
    await settle()
    assert bg[1].done() and not bg[0].done() and adm.waiting == 2
    with pytest.raises(AdmissionRejected):
        await bg[1]
    gate.set()
    await asyncio.gather(first, fg, bg[0])
    assert order == ["first", "fg", "bg0"]


async def test_retry_after_of_a_capacity_refusal_is_the_estimated_wait() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=1, max_queue=4, queue_timeout_s=30.0, retry_after_s=1)
    await drained(adm, clock)
    gate, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    waiters = [asyncio.create_task(hold(adm, ANONYMOUS, gate, order, f"w{i}")) for i in range(4)]
    await settle()
    assert adm.waiting == 4
    with pytest.raises(AdmissionRejected) as e:  # full, its own tenant holds it: 5th in line
        async with adm.admit(ANONYMOUS):
            pass
    assert (e.value.code, e.value.retry_after) == ("gateway_busy", 3)  # 5 / 2 per s, rounded up
    gate.set()
    await asyncio.gather(first, *waiters)


async def test_an_estimated_wait_past_the_timeout_is_refused_at_once() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=1, max_queue=10, queue_timeout_s=2.0, retry_after_s=1)
    await drained(adm, clock)
    gate, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    waiters = [asyncio.create_task(hold(adm, ANONYMOUS, gate, order, f"w{i}")) for i in range(3)]
    await settle()
    assert adm.waiting == 3  # 2 s at most: the 4th would wait 2.0 s, the 5th 2.5 s
    w4 = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "w3"))
    await settle()
    assert adm.waiting == 4 and not w4.done()
    with pytest.raises(AdmissionRejected) as e:
        async with adm.admit(ANONYMOUS):
            pass
    assert (e.value.code, e.value.retry_after) == ("gateway_busy", 3)
    assert "estimated wait 2.5 s" in e.value.message and adm.waiting == 4
    gate.set()
    await asyncio.gather(first, *waiters, w4)


async def test_a_refused_turn_retried_at_its_retry_after_is_served_before_the_queue() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=1, max_queue=4, queue_timeout_s=30.0, retry_after_s=1)
    await drained(adm, clock)
    gate, order = asyncio.Event(), []
    first = asyncio.create_task(hold(adm, ANONYMOUS, gate, order, "first"))
    await settle()
    waiters = [asyncio.create_task(hold(adm, ANONYMOUS, gate, order, f"w{i}")) for i in range(4)]
    await settle()
    with pytest.raises(AdmissionRejected) as e:
        async with adm.admit(ANONYMOUS, key="session-1"):
            pass
    assert (e.value.retry_after, e.value.retry_after_ms) == (3, 2500) and adm.global_slots.bookings == 1
    assert (b"retry-after-ms", b"2500") in to_api_error(e.value).headers()
    clock.t += 1.0  # back too early: not the booked retry, refused like any newcomer
    with pytest.raises(AdmissionRejected):
        async with adm.admit(ANONYMOUS, key="session-1"):
            pass
    clock.t += 2.0
    with pytest.raises(AdmissionRejected):  # an unbooked newcomer still finds the queue full
        async with adm.admit(ANONYMOUS, key="session-2"):
            pass

    async def retry() -> None:
        async with adm.admit(ANONYMOUS, key="session-1"):
            order.append("session-1")
            await gate.wait()

    kept = asyncio.create_task(retry())
    await settle()
    assert adm.global_slots.bookings_kept == 1 and adm.waiting == 5  # queued past the bound
    gate.set()
    await asyncio.gather(first, kept, *waiters)
    assert order == ["first", "session-1", "w0", "w1", "w2", "w3"]


async def test_bookings_are_spaced_by_the_tenants_shares() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=1, max_queue=0)
    await drained(adm, clock)
    slots = adm.global_slots
    gold = [slots.book(f"g{i}", "gold", 3.0, 1.0) for i in range(1)]
    times = {"gold": gold, "bronze": []}
    for i in range(6):
        times["bronze"].append(slots.book(f"b{i}", "bronze", 1.0, 1.0))
        times["gold"].append(slots.book(f"g{i + 1}", "gold", 3.0, 1.0))
    # both backlogged: gold's retries are booked three times as densely as bronze's
    # 3 every 2 s once both book, bronze 1 every 2 s
    assert times["gold"] == pytest.approx([1.0, 1.5] + [1.5 + k * 2 / 3 for k in range(1, 6)])
    assert times["bronze"] == pytest.approx([1.0, 3.0, 5.0, 7.0, 9.0, 11.0])
    assert slots.book(None, "gold", 3.0, 1.5) == 1.5 and slots.bookings == 13  # no key: no booking


async def test_the_booking_table_is_bounded_and_bookings_lapse() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=1, max_queue=0)
    await drained(adm, clock)
    slots = adm.global_slots
    for i in range(slots.max_bookings + 10):
        slots.book(f"s{i}", "t", 1.0, 0.5)
    assert slots.bookings == slots.max_bookings
    clock.t += 10_000  # none came back: each refusal drops the oldest 64 of them
    slots.book("late", "t", 1.0, 0.5)  # (with no slot freed for so long: no rate, no booking)
    assert slots.bookings == slots.max_bookings - 64


async def test_a_lapsed_booking_gives_its_place_back_to_its_tenant() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=1, max_queue=0)
    await drained(adm, clock)  # 2 a second: one tenant alone books every 0.5 s
    slots = adm.global_slots
    times = [slots.book(f"s{k}", "t", 1.0, 1.0) for k in range(100)]
    assert times[0] == 1.0 and times[-1] == pytest.approx(1.0 + 99 * 0.5)  # the last one at +50.5 s
    clock.t += 20  # the first 28 never came back (5 s late at most): their places are free again
    assert slots.book("next", "t", 1.0, 1.0) == pytest.approx(1.0 + 100 * 0.5 - 20 - 28 * 0.5)
    assert slots.bookings == 100 - 28 + 1


async def test_a_tenant_over_its_share_is_refused_while_others_are_booked() -> None:
    clock = Clock()
    adm = make(clock, max_inflight=2, max_queue=4)
    a, b = Tenant("a"), Tenant("b")
    for _ in range(10):  # no contention: a may take every free slot
        async with adm.admit(a):
            pass
        clock.t += 0.2
    assert adm.global_slots.book("b\0s1", "b", 1.0, 1.0) == pytest.approx(1.0)  # b was refused
    async with adm.admit(a):  # two free slots, one booked retry due: a takes the other
        with pytest.raises(AdmissionRejected) as e:  # the last one is the booked retry's
            async with adm.admit(a, key="s2"):
                pass
    assert adm.global_slots.bookings == 2
    with pytest.raises(AdmissionRejected) as e:  # free slots, but as many retries due, and a
        async with adm.admit(a, key="s3"):  # had all of them lately
            pass
    assert e.value.code == "gateway_busy" and "more than its share" in e.value.message
    assert e.value.retry_after_ms is not None and adm.global_slots.bookings == 3
    async with adm.admit(b):  # b, under its share, is admitted at once
        assert adm.inflight == 1
