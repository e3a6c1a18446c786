"""The dashboard's migration and pin views against real engine_ext engines and a real Mooncake
store: a long first turn is moved to a warm engine during its tool gap, and the dashboard shows
the move (kind, reason, outcome, time to ready), the session's new home, its pins and the outcome
counts; the page in headless Chromium shows them too (screenshot kept as an artifact)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import ServedGateway
from tests.gateway.test_dashboard_browser import browser, keep_artifact
from tests.migrations.test_migrations_e2e import msgs, post

pytestmark = [pytest.mark.engine, pytest.mark.store]

__all__ = ["browser"]  # the module-scoped headless Chromium fixture, shared


def _state(gw: ServedGateway) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(gw.url + "/dashboard/state", timeout=10).json()
    return out


def _session(state: dict[str, Any], sid: str) -> dict[str, Any] | None:
    return next((s for s in state["sessions"]["items"] if s["session_id"] == sid), None)


def test_dashboard_shows_a_move_its_outcome_and_the_pins(
    kv_gateway: ServedGateway, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    sid = "dash-move-1"
    r = post(kv_gateway, msgs("dash-move", 200), {"session_id": sid, "expected_tool_latency_ms": 30000})
    assert r.headers["x-agentgw-pool"] == "first_turn"
    source = r.headers["x-agentgw-engine"]

    deadline = time.monotonic() + 90  # a bound for the prefetch to finish, not a speed assertion
    while True:
        state = _state(kv_gateway)
        done = [
            m for m in state["migrations"]["recent"] if m["session_id"] == sid and m["state"] != "running"
        ]
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert done, state["migrations"]
    m = done[0]
    assert (m["kind"], m["reason"], m["state"], m["source"]) == ("move", "first_turn_to_warm", "done", source)
    target = m["targets"][0]
    assert set(m["ready_s"]) == {target} and m["ready_s"][target] >= 0
    assert state["migrations"]["outcomes"]["move"]["completed"] >= 1

    sess = _session(state, sid)
    assert sess is not None
    assert (sess["home"], sess["pool"], sess["turns"]) == (target, "warm", 1)
    assert sess["migration"] == {"kind": "move", "state": "done"}
    by = {(p["engine"], p["by"]) for p in sess["pins"]}
    # the prefetched copy on the target, and the end-of-request pin on the engine that served it
    assert {(target, "prefetch"), (source, "request")} <= by
    assert all(p["until"] > state["now"] for p in sess["pins"])
    engines = {e["name"]: e for p in state["pools"] for e in p["engines"]}
    assert all(e["controllable"] for e in engines.values())

    # the traffic window: the sampler read these engine_ext engines' prompt-token counters
    deadline = time.monotonic() + 60
    while _state(kv_gateway)["traffic"]["window"] is None and time.monotonic() < deadline:
        time.sleep(0.5)
    window = _state(kv_gateway)["traffic"]["window"]
    assert window is not None and window["window_s"] > 0

    # a sample holds the engines whose /metrics answered within health_timeout_s (a busy engine on
    # this loaded machine can miss one); wait for a sample that has every engine's counters
    def complete(sample: Any) -> bool:
        return set(sample.engines) == set(engines) and all("prompt" in c for c in sample.engines.values())

    deadline = time.monotonic() + 60
    while not any(map(complete, kv_gateway.app.state.dashboard.samples)) and time.monotonic() < deadline:
        time.sleep(0.5)
    samples = list(kv_gateway.app.state.dashboard.samples)
    assert any(map(complete, samples)), [sorted(x.engines) for x in samples]

    d = browser
    d.get(kv_gateway.url + "/dashboard")
    WebDriverWait(d, 60, poll_frequency=0.25).until(
        lambda _d: any(
            sid in row.text and "done" in row.text
            for row in d.find_elements(By.CSS_SELECTOR, "#migrations-recent tbody tr")
        )
    )
    row = d.find_element(By.CSS_SELECTOR, f'#sessions tr[data-session="{sid}"]')
    assert row.find_element(By.CSS_SELECTOR, "td.home").text.startswith(target)
    assert "prefetch" in row.text
    shot = tmp_path / "dashboard-migrations.png"
    assert d.save_screenshot(str(shot))
    keep_artifact(shot)
