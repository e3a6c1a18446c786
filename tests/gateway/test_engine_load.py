"""The service fills the engine views' load fields from its own phase ledger, ticks the role
controller, and routes the cost split the way the simulator does for the same arrivals.

Stand-in engines (``testing.fake_engine``, paced: a delay before the first token, then a
delay between tokens) make the phases observable: a request the gateway has sent and not yet
seen a byte of counts in ``prefill_backlog_tokens`` (its uncached prompt tokens), one past its
first byte in ``decoding``, and both return to 0 when it ends. Only accounting is tested here, so
no model is needed; every wait is for an event (a phase seen, a chunk read), with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson

from gateway.core.router import RoutingParams
from gateway.core.turn import approx_hashes
from gateway.core.types import EngineView, PoolRole
from gateway.service.prompts import prompt_text
from gateway.sim.cluster import MODEL, SimConfig, simulate
from gateway.sim.traces import Play, TraceRequest
from gateway.wire.openai import parse_body
from tests.conftest import ServedGateway, fake_engine, wait_ready

CHUNK = 512
WEIGHTS = {"prefix": 3.0, "session_affinity": 2.0, "parent_prefix": 1.5, "spread": 1.0, "queue": 1.0}
WEIGHTS |= {"kv_usage": 0.0}
#: a decode step that does not depend on KV use (the stand-ins report a token one), no move cost:
#: what separates the engines is the ledger's decoding count and backlog
SPLIT = {"split": "cost", "cost_decode_ms": (20.0, 0.0, 0.0), "split_move_weight": 0.0}


def _config(urls: list[str], **routing: Any) -> dict[str, Any]:
    names = ["w0", "w1", "w2"]  # the simulator's names (score ties are broken by a hash of them)
    return {
        "pools": [
            {
                "name": "first",
                "role": "first_turn",
                "engines": [{"name": "w0", "url": urls[0], "model": MODEL}],
            },
            {
                "name": "warm",
                "role": "warm",
                "engines": [
                    {"name": n, "url": u, "model": MODEL} for n, u in zip(names[1:], urls[1:], strict=True)
                ],
            },
        ],
        "routing": {
            "profile": "agentic",
            "weights": WEIGHTS,
            "approx_chunk_chars": CHUNK,
            **SPLIT,
            **routing,
        },
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.3},
    }


@contextlib.contextmanager
def _engines(*args: str) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(fake_engine("--model", MODEL, *args)) for _ in range(3)]


def _views(gw: ServedGateway) -> dict[str, EngineView]:
    async def read() -> tuple[EngineView, ...]:
        return gw.service.cluster.views()

    assert gw.loop is not None
    views = asyncio.run_coroutine_threadsafe(read(), gw.loop).result(10)
    return {v.name: v for v in views}


def _until(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"not seen within {timeout:.0f} s: {what}")


def _body(tag: str, words: int = 400) -> bytes:
    text = f"[{tag}] " + " ".join(f"{tag}-word{i}" for i in range(words))
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "stream": True}
    )


class _Stream:
    """One streamed request read on a thread: ``first`` is set when its first chunk arrived."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.first = threading.Event()
        self.done = threading.Event()
        self.stop = threading.Event()
        self.headers: dict[str, str] = {}
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(url, body, headers or {}), daemon=True)
        self._t.start()

    def _run(self, url: str, body: bytes, headers: dict[str, str]) -> None:
        try:
            with (
                httpx.Client(base_url=url, timeout=60) as c,
                c.stream("POST", "/v1/chat/completions", content=body, headers=headers) as r,
            ):
                self.headers = dict(r.headers)
                for chunk in r.iter_raw():
                    if chunk:
                        self.first.set()
                    if self.stop.is_set():
                        break
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    def join(self) -> None:
        self._t.join(60)
        assert self.error is None, self.error


def test_load_fields_follow_a_request_through_its_phases() -> None:
    # first token after 3 s, then a token every 1.5 s (4 tokens): a prefill phase, then a decode one
    with (
        _engines("--tokens", "4", "--ttft-ms", "3000", "--itl-ms", "1500") as urls,
        ServedGateway(_config(urls)) as gw,
    ):
        wait_ready(gw.url)
        assert all(v.decoding == 0 and v.prefill_backlog_tokens == 0 for v in _views(gw).values())
        s = _Stream(gw.url, _body("a"))
        seen: dict[str, int] = {}

        def backlog_seen() -> bool:
            for v in _views(gw).values():
                if v.prefill_backlog_tokens > 0:
                    seen[v.name] = v.prefill_backlog_tokens
            return bool(seen)

        _until(backlog_seen, "a prefill backlog")
        assert not s.first.is_set(), "the first chunk arrived before the backlog was seen"
        (engine, backlog), *rest = seen.items()
        assert not rest
        assert backlog >= 400  # the uncached prompt (estimated from its ~2,800 characters)
        assert s.first.wait(60)
        # the gateway marks the first byte before relaying it: decoding now, no backlog
        v = _views(gw)[engine]
        assert (v.decoding, v.prefill_backlog_tokens) == (1, 0), v
        assert s.headers["x-agentgw-engine"] == engine
        s.join()
        # over: 0 again (decoding is bounded below by the engine's scraped running count, which
        # drops at the next scrape)
        _until(
            lambda: all(v.decoding == 0 and v.prefill_backlog_tokens == 0 for v in _views(gw).values()),
            "the load fields back at 0",
        )
        # a client that leaves mid-prefill takes its tokens out of the backlog
        s2 = _Stream(gw.url, _body("b"))
        _until(lambda: any(v.prefill_backlog_tokens > 0 for v in _views(gw).values()), "a second backlog")
        s2.stop.set()
        s2.first.wait(60)
        s2.join()
        _until(
            lambda: all(v.prefill_backlog_tokens == 0 and v.decoding == 0 for v in _views(gw).values()),
            "the load fields back at 0 after a cut stream",
        )
        assert all(v.inflight == 0 for v in _views(gw).values())


def test_the_service_ticks_the_role_controller_from_the_backlog() -> None:
    # one first-turn engine sized for 100 backlog tokens: a ~700-token prefill asks for more
    routing = {
        "role_controller": True,
        "role_interval_s": 0.1,
        "role_backlog_tokens_per_engine": 100,
        "role_min_dwell_s": 0.0,
    }
    # the engines hold every stream after its headers until POST /release: the prefill is
    # pending for as long as the test needs, however slowly a loaded machine runs the controller
    with (
        _engines("--tokens", "2", "--hold") as urls,
        ServedGateway(_config(urls, **routing)) as gw,
    ):
        wait_ready(gw.url)
        driver = gw.service.roles
        assert driver is not None

        def first_turn() -> int:
            return sum(v.role == PoolRole.FIRST_TURN for v in _views(gw).values())

        assert first_turn() <= 1  # no backlog: the configured one, or none once handed back
        s = _Stream(gw.url, _body("c"))
        _until(lambda: first_turn() == 2, "a second first-turn engine while the prefill waits")
        assert not s.first.is_set()
        for u in urls:
            assert httpx.post(u + "/release", timeout=10).status_code == 200
        s.join()
        _until(lambda: first_turn() <= 1, "first-turn engines handed back once the backlog is gone")
        assert driver.changes >= 2
        assert {v.pool for v in _views(gw).values()} == {"first", "warm"}  # pool names stay


def _sim_play(i: int, body: bytes) -> Play:
    parsed = parse_body("chat", body)
    req = TraceRequest(
        idx=0,
        stream="root",
        t=0.0,
        input_tokens=parsed.text_chars // 4,
        output_tokens=3000,
        hashes=approx_hashes(prompt_text(parsed), CHUNK),
        deps=[],
    )
    return Play(f"p{i}", CHUNK // 4, [req], start_s=float(i))


def test_the_service_and_the_simulator_split_the_same_arrivals_alike() -> None:
    """Five fresh prompts, each arriving while every earlier one decodes: idle warm engines take
    the first two; with a decoder on each warm engine the third goes to the idle first-turn engine
    (its prefill would slow a decoder on either warm one); then ties go warm. Only the load
    fields separate the engines, so without them the third would stay warm."""
    bodies = [_body(f"s{i}", 300) for i in range(5)]
    served: list[str] = []
    with (
        _engines("--tokens", "6", "--ttft-ms", "100", "--itl-ms", "3000") as urls,
        ServedGateway(_config(urls)) as gw,
    ):
        wait_ready(gw.url)
        streams = []
        for i, body in enumerate(bodies):
            # session ids: the router breaks score ties by a hash of the session id
            s = _Stream(gw.url, body, {"x-agent-session-id": f"p{i}"})
            assert s.first.wait(60)
            assert s.error is None, s.error
            streams.append(s)
            served.append(s.headers["x-agentgw-engine"])
        for s in streams:
            s.stop.set()
        for s in streams:
            s.join()
    sim = simulate(
        [_sim_play(i, b) for i, b in enumerate(bodies)],
        SimConfig(
            workers=3,
            profile="agentic",
            hints=True,
            lanes=None,
            first_turn_workers=1,
            routing=RoutingParams(profile="agentic", weights=WEIGHTS, **SPLIT),  # type: ignore[arg-type]
            kv_events=False,
            load_view="gateway",
        ),
    )
    simulated = [r.engine for r in sorted(sim.records, key=lambda r: r.t_arrive)]
    assert simulated == served
    assert served[2] == "w0" and set(served[:2]) == {"w1", "w2"}, served  # w0: the first-turn engine
