"""An ejected engine's sessions are re-homed in its pool before their next turn (stand-in
engines as real processes; the Mooncake load on the new home is tested with real engines in
tests/migrations/test_rehome_mooncake.py)."""

from __future__ import annotations

import contextlib
import time

import httpx

from tests.conftest import ServedGateway, fake_engine, wait_ready

MODEL = "bench-model"


def chat(gw: ServedGateway, sid: str, text: str) -> httpx.Response:
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "agent_hints": {"session_id": sid},
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r


def home(gw: ServedGateway, sid: str) -> str | None:
    return httpx.get(f"{gw.url}/v1/agent/sessions/{sid}", timeout=10).json()["home_engine"]


def metric(gw: ServedGateway, outcome: str) -> float:
    key = f'agentgw_sessions_rehomed_total{{outcome="{outcome}",reason="engine_down"}}'
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(key):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_killed_engines_sessions_move_to_a_live_engine_of_the_same_pool() -> None:
    with contextlib.ExitStack() as stack:
        killable = contextlib.ExitStack()
        a = killable.enter_context(fake_engine("--model", MODEL))
        b = stack.enter_context(fake_engine("--model", MODEL))
        c = stack.enter_context(fake_engine("--model", MODEL))
        stack.callback(killable.close)
        cfg = {
            "pools": [
                {
                    "name": "warm",
                    "role": "any",
                    "engines": [
                        {"name": "a", "url": a, "model": MODEL},
                        {"name": "b", "url": b, "model": MODEL},
                    ],
                },
                {"name": "other", "role": "any", "engines": [{"name": "c", "url": c, "model": MODEL}]},
            ],
            "timeouts": {"health_interval_s": 0.3, "metrics_interval_s": 0.5, "health_timeout_s": 0.5},
        }
        gw = stack.enter_context(ServedGateway(cfg))
        wait_ready(gw.url)
        homes = {f"s{i}": chat(gw, f"s{i}", f"task {i} " * 40).headers["x-agentgw-engine"] for i in range(9)}
        on_a = sorted(s for s, e in homes.items() if e == "a")
        assert on_a, homes  # spread puts some new sessions on each engine
        assert all(home(gw, s) == "a" for s in on_a)

        killable.close()  # engine a is gone: nothing listens on its port
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and metric(gw, "moved") < len(on_a):
            time.sleep(0.1)
        assert not gw.service.cluster.engines["a"].healthy
        assert metric(gw, "moved") == len(on_a)
        assert metric(gw, "no_target") == 0
        for s in on_a:  # re-homed in a's pool (never on c), before any next turn
            assert home(gw, s) == "b", s
        for s, e in homes.items():  # the other sessions kept their homes
            if e != "a":
                assert home(gw, s) == e, s
        for s in on_a:  # the next turn goes to the new home
            r = chat(gw, s, f"task {s} " * 40 + "next")
            assert (r.headers["x-agentgw-engine"], r.headers["x-agentgw-reason"]) == ("b", "sticky")
