"""Engines join and leave without a restart: the admin API (``PUT /admin/pools``), a discovery
file re-read while running, and SIGHUP on ``agentgw serve`` (its ``--config`` file re-read).
A new engine takes traffic after its first good probe; a removed one takes none from then on and
its sessions are re-homed at once; a bad list is a 400 naming the key and changes nothing.
Engines here are the stand-in engine (testing/fake_engine.py: no model): membership is the gateway's part."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from testing.replicas import GatewayReplica
from tests.conftest import ServedGateway, fake_engine, wait_ready

ADMIN, KEY = "membership-admin", "membership-tenant"
AUTH = {"authorization": f"Bearer {ADMIN}"}
TENANT = {"authorization": f"Bearer {KEY}"}
ENV = {"AGENTGW_MEMBERSHIP_ADMIN": ADMIN, "AGENTGW_MEMBERSHIP_KEY": KEY}


def _pools(*engines: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        {"name": "p", "role": "any", "engines": [{"name": n, "url": u, "model": "m"} for n, u in engines]}
    ]


def _config(pools: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "pools": pools,
        "auth": {
            "admin_key_env": ["AGENTGW_MEMBERSHIP_ADMIN"],
            "tenants": [{"name": "t", "key_env": ["AGENTGW_MEMBERSHIP_KEY"]}],
        },
        "timeouts": {"health_interval_s": 0.2, "metrics_interval_s": 0.2},
        **extra,
    }


def _chat(url: str, session: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 2}
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"x-session-id": session, **TENANT}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r


def _until(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _engines(url: str) -> dict[str, dict[str, Any]]:
    pools = httpx.get(url + "/admin/pools", headers=AUTH, timeout=10).json()["pools"]
    return {e["name"]: e for p in pools for e in p["engines"]}


def test_engines_join_and_leave_through_the_admin_api(monkeypatch: Any) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    with (
        fake_engine("--model", "m") as a,
        fake_engine("--model", "m") as b,
        ServedGateway(_config(_pools(("e0", a)))) as gw,
    ):
        wait_ready(gw.url)
        # sessions homed on e0, the only engine
        for i in range(4):
            assert _chat(gw.url, f"s{i}").headers["x-agentgw-engine"] == "e0"
        # e1 joins: probed at once, healthy, then routed to
        r = httpx.put(gw.url + "/admin/pools", json={"pools": _pools(("e0", a), ("e1", b))}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["added"] == ["e1"] and r.json()["removed"] == []
        _until(lambda: _engines(gw.url)["e1"]["healthy"])
        served = [_chat(gw.url, f"new{i}").headers["x-agentgw-engine"] for i in range(12)]
        assert "e1" in served, served
        # e0 leaves: its sessions move to e1 at once, and no request goes to e0 any more
        r = httpx.put(gw.url + "/admin/pools", json={"pools": _pools(("e1", b))}, headers=AUTH)
        assert r.status_code == 200 and r.json()["removed"] == ["e0"], r.text

        def moved() -> bool:
            homes = [
                httpx.get(f"{gw.url}/v1/agent/sessions/s{i}", headers=TENANT).json()["home_engine"]
                for i in range(4)
            ]
            return homes == ["e1"] * 4

        _until(moved)
        for i in range(4):
            h = _chat(gw.url, f"s{i}").headers
            assert h["x-agentgw-engine"] == "e1" and h["x-agentgw-reason"] == "sticky"
        assert {_chat(gw.url, f"later{i}").headers["x-agentgw-engine"] for i in range(6)} == {"e1"}
        metrics = httpx.get(gw.url + "/metrics", headers=AUTH).text
        assert 'agentgw_engine_membership_changes_total{change="added"} 1.0' in metrics
        assert 'agentgw_engine_membership_changes_total{change="removed"} 1.0' in metrics
        on_e0 = 4 + served.count("e0")  # every session homed on e0 moved
        assert f'agentgw_sessions_rehomed_total{{outcome="moved",reason="engine_down"}} {on_e0}.0' in metrics
        _until(lambda: "e0" not in httpx.get(gw.url + "/admin/pools", headers=AUTH).json()["leaving"])
        assert set(_engines(gw.url)) == {"e1"}


def test_a_bad_pool_list_is_a_400_naming_the_key_and_changes_nothing(monkeypatch: Any) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    with fake_engine("--model", "m") as a, ServedGateway(_config(_pools(("e0", a)))) as gw:
        wait_ready(gw.url)
        bad_url = [{"name": "p", "engines": [{"name": "e0", "url": "ftp://x", "model": "m"}]}]
        r = httpx.put(gw.url + "/admin/pools", json={"pools": bad_url}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "pools.0.engines.0.url", r.text
        dup = _pools(("e0", a), ("e0", a))
        r = httpx.put(gw.url + "/admin/pools", json={"pools": dup}, headers=AUTH)
        assert r.status_code == 400 and "unique" in r.json()["error"]["message"], r.text
        r = httpx.put(gw.url + "/admin/pools", json={"engines": []}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "pools"
        assert httpx.put(gw.url + "/admin/pools", json={"pools": []}).status_code == 401  # admin only
        r = httpx.post(gw.url + "/admin/reload", headers=AUTH)  # no file to re-read
        assert r.status_code == 400 and "nothing to reload" in r.json()["error"]["message"]
        assert set(_engines(gw.url)) == {"e0"}
        assert _chat(gw.url, "still").headers["x-agentgw-engine"] == "e0"


def test_a_discovery_file_is_re_read_while_running(monkeypatch: Any, tmp_path: Path) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    disc = tmp_path / "engines.yaml"
    with fake_engine("--model", "m") as a, fake_engine("--model", "m") as b:
        disc.write_text(yaml.safe_dump({"pools": _pools(("e0", a))}))
        cfg = _config([], discovery={"file": str(disc), "interval_s": 0.1})
        with ServedGateway(cfg) as gw:
            wait_ready(gw.url)
            assert set(_engines(gw.url)) == {"e0"}
            time.sleep(0.05)  # a new modification time
            disc.write_text(yaml.safe_dump({"pools": _pools(("e0", a), ("e1", b))}))
            _until(lambda: set(_engines(gw.url)) == {"e0", "e1"} and _engines(gw.url)["e1"]["healthy"])
            # a half-written file keeps the engines as they are
            disc.write_text("pools: [{name: p, engines: [")
            time.sleep(0.5)
            assert set(_engines(gw.url)) == {"e0", "e1"}
            disc.write_text(yaml.safe_dump({"pools": _pools(("e1", b))}))
            _until(lambda: set(_engines(gw.url)) == {"e1"})
            assert _chat(gw.url, "d").headers["x-agentgw-engine"] == "e1"


def test_sighup_re_reads_the_config_file(tmp_path: Path) -> None:
    with fake_engine("--model", "m") as a, fake_engine("--model", "m") as b:
        rep = GatewayReplica("hup", _config(_pools(("e0", a))), tmp_path, ENV)
        try:
            rep.start()
            assert set(_engines(rep.url)) == {"e0"}
            data = yaml.safe_load(rep.config_path.read_text())
            data["pools"] = _pools(("e1", b))
            rep.config_path.write_text(yaml.safe_dump(data))
            assert rep.proc is not None
            rep.proc.send_signal(signal.SIGHUP)
            _until(lambda: set(_engines(rep.url)) == {"e1"} and _engines(rep.url)["e1"]["healthy"])
            assert _chat(rep.url, "h").headers["x-agentgw-engine"] == "e1"
            # the same through the admin API, and a broken file leaves the engines alone
            rep.config_path.write_text("pools: [")
            r = httpx.post(rep.url + "/admin/reload", headers=AUTH)
            assert r.status_code == 400 and "not valid YAML" in r.json()["error"]["message"], r.text
            rep.proc.send_signal(signal.SIGHUP)
            time.sleep(0.3)
            assert rep.alive and set(_engines(rep.url)) == {"e1"}
            assert "SIGHUP" in rep.log_tail(20_000)
        finally:
            rep.stop()
