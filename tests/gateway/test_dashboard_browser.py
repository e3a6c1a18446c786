"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` driven by Selenium
through Debian's ``chromium-driver``) loads ``/dashboard`` from a gateway in front of the three real
engines, sees a hinted session appear and its turn count grow as turns are sent, and keeps a
screenshot (in the test's tmp dir and, when ``AGENTGW_ARTIFACTS`` is set, there)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.conftest import MODEL, ServedGateway

pytestmark = pytest.mark.engine

SYSTEM = "You are a careful agent; read the repository before you change it. " * 20
WAIT_S = 60  # an upper bound for the page to show what it was sent, not a speed assertion


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("chromium / chromium-driver are not installed (./scripts/setup.sh --test installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    # the driver is given explicitly, so Selenium Manager never tries to download one
    d = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        yield d
    finally:
        d.quit()


def _turn(gw: ServedGateway, session: str, messages: list[dict[str, Any]]) -> str:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"agent_hints": {"session_id": session, "expected_tool_latency_ms": 30_000}},
    )
    messages.append({"role": "assistant", "content": r.parse().choices[0].message.content or ""})
    return r.headers["x-agentgw-engine"]


def _row_text(d: webdriver.Chrome, session: str, cls: str) -> str | None:
    try:
        rows = d.find_elements(By.CSS_SELECTOR, f'#sessions tr[data-session="{session}"]')
        return rows[0].find_element(By.CSS_SELECTOR, f"td.{cls}").text if rows else None
    except StaleElementReferenceException:  # the table was redrawn between the two lookups
        return None


def _wait_for(d: webdriver.Chrome, what: str, cond: Any) -> Any:
    try:
        return WebDriverWait(d, WAIT_S, poll_frequency=0.25).until(lambda _d: cond())
    except TimeoutException:
        d.save_screenshot(str(Path(os.environ.get("AGENTGW_ARTIFACTS", "/tmp")) / "dashboard-timeout.png"))
        raise AssertionError(f"the dashboard never showed {what}") from None


def keep_artifact(shot: Path) -> None:
    """Copy a screenshot to ``$AGENTGW_ARTIFACTS`` when it is set."""
    dest = os.environ.get("AGENTGW_ARTIFACTS")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(dest) / shot.name)


def test_dashboard_shows_a_session_appear_and_its_turns_grow(
    gateway: ServedGateway, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    d = browser
    d.get(gateway.url + "/dashboard")
    _wait_for(
        d,
        "its first update",
        lambda: int(d.find_element(By.TAG_NAME, "body").get_attribute("data-polls") or 0) >= 1,
    )
    engines = d.find_elements(By.CSS_SELECTOR, "#engines tbody tr[data-engine]")
    assert sorted(e.get_attribute("data-engine") for e in engines) == ["first0", "warm0", "warm1"]
    assert d.find_element(By.ID, "ready").text == "ready"

    session = f"dash-{uuid.uuid4().hex[:10]}"
    assert _row_text(d, session, "turns") is None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "turn 0: list the files"},
    ]
    home = _turn(gateway, session, messages)
    _wait_for(d, "the new session", lambda: _row_text(d, session, "turns") == "1")
    assert _row_text(d, session, "home").startswith(home)

    for i in range(1, 4):
        messages.append({"role": "user", "content": f"turn {i}: open the next file"})
        home = _turn(gateway, session, messages)
    _wait_for(d, "the session's 4 turns", lambda: _row_text(d, session, "turns") == "4")
    assert _row_text(d, session, "home").startswith(home)
    assert _row_text(d, session, "reason").startswith("sticky")  # later turns stay at home

    # the JSON behind the page: the home engine's cached blocks (from its KV events) and the
    # engines' own prefix-cache counters over the window (turns 2..4 reuse the system prompt)
    def state() -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(gateway.url + "/dashboard/state", timeout=10).json()
        return out

    def cached_seen() -> bool:
        s = state()
        eng = {e["name"]: e for p in s["pools"] for e in p["engines"]}
        w = s["traffic"]["window"]
        return eng[home]["cached_tokens"]["gpu"] > 0 and w is not None and w["cached_tokens"] > 0

    _wait_for(d, "cached tokens", cached_seen)
    _wait_for(d, "a hit rate", lambda: d.find_element(By.ID, "hit-rate").text not in ("–", "0.0 %"))

    shot = tmp_path / "dashboard.png"
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    keep_artifact(shot)
