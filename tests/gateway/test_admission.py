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
