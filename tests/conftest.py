"""Shared fixtures: real vLLM engines on the tiny models, a real redis-server, gateways served by
uvicorn on loopback. Everything is started here and stopped at the end of the session."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.api.app import create_app
from gateway.api.server import uvicorn_config
from gateway.config import load_config
from gateway.local.engines import HASH_SEED, EngineSpec, LocalEngine, free_ports, start_engines, stop_engines
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import build_tiny_model

# Environment variables that every engine this process starts inherits and that change how it
# behaves: a test that sets one must leave it as it found it. Mooncake's stall timeouts, set once
# to 3 s by a test, dropped the live transfers of every later engine in a CI run.
_INHERITED_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC", "MC_TRANSFER_TIMEOUT")


@pytest.fixture(autouse=True)
def _env_left_as_found() -> Iterator[None]:
    before = {k: os.environ.get(k) for k in _INHERITED_ENV}
    yield
    after = {k: os.environ.get(k) for k in _INHERITED_ENV}
    assert after == before, f"the test changed the environment its engines inherit: {before} -> {after}"


MODEL = "tiny-llama"


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agentgw")


@pytest.fixture(scope="session")
def models_dir() -> Path:
    d = Path(os.environ.get("AGENTGW_TEST_MODELS", "/tmp/agentgw-test-models"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (parallel test workers build one model)."""
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> Path:
    with _locked(models_dir / ".tiny-llama.lock"):
        return build_tiny_model(models_dir / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_gemma3(models_dir: Path) -> Path:
    with _locked(models_dir / ".tiny-gemma3.lock"):
        return build_tiny_model(models_dir / "tiny-gemma3", "gemma3")


HEAVY_FIXTURES = {
    "cluster": "engine",  # tests/gateway: three vLLM engines
    "stack": "engine",  # tests/agents: `agentgw serve`'s embedded stack
    "engines": "engine",  # tests/engine_ext: engines with engine_ext
    "hybrid_engines": "engine",
    "kv_cluster": "engine",  # tests/migrations
    "mooncake": "store",  # a real mooncake_master
    "redis_url": "redis",  # a real redis-server
}
"""Fixtures that start real engines or servers, and the marker a test using one (directly or
through another fixture) gets: ``-m "not engine and not store and not redis and not docker"``
selects the tests that need none of them (scripts/test.sh --fast)."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test's markers from the fixtures it uses, as it is collected (so ``-m`` selects by
    them): scripts/test.sh runs the engine and Mooncake tests in one process, one set of
    engines at a time, and every other test beside them."""
    for fixture, mark in HEAVY_FIXTURES.items():
        if _shared(item, fixture) and item.get_closest_marker(mark) is None:
            item.add_marker(getattr(pytest.mark, mark))


def _shared(item: pytest.Item, name: str) -> bool:
    """Does ``item`` use the fixture ``name`` of a conftest (not a test module's own fixture of
    that name, nor a parametrize argument: tests/core's ``engines`` lists, test_cluster's
    ``cluster``)?"""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    if not defs:
        return False
    return str(getattr(defs[-1].func, "__module__", "")).rsplit(".", 1)[-1] == "conftest"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared three-engine :func:`cluster` run one after another, where the first
    of them was (stable order otherwise), so its engines start once and stop after the last."""
    users = [i for i in items if _shared(i, "cluster")]
    if len(users) < 2:
        return
    first = items.index(users[0])
    rest = [i for i in items if not _shared(i, "cluster")]
    items[:] = rest[:first] + users + rest[first:]


_CLUSTER: list[contextlib.ExitStack] = []


@pytest.fixture(scope="session")
def cluster(tiny_llama: Path, workdir: Path) -> Iterator[dict[str, LocalEngine]]:
    """Three real engines: one first-turn, two warm (priority scheduling on), with the embedded
    default's 32K context (coding-agent prompts are 15-19K tokens with the tiny tokenizer),
    shared by every test that asks for them (tests/gateway, the balancer test); stopped right
    after the last of those tests (they run one after another), so later tests have the memory."""
    with contextlib.ExitStack() as stack:
        engines = stack.enter_context(three_engines(tiny_llama, workdir))
        _CLUSTER.append(stack)
        yield engines
    _CLUSTER.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    if _CLUSTER and _shared(item, "cluster") and (nextitem is None or not _shared(nextitem, "cluster")):
        _CLUSTER.pop().close()  # the last test on the cluster: its engines stop now
    return result


def engine_specs(
    model_dir: Path, names: list[str], logs: Path, served: str = MODEL, **kw: Any
) -> list[EngineSpec]:
    ports = free_ports(2 * len(names))
    return [
        EngineSpec(
            name=n,
            model_dir=model_dir,
            served_model_name=served,
            port=ports[2 * i],
            kv_events_port=ports[2 * i + 1],
            log_path=logs / f"{n}.log",
            max_model_len=kw.get("max_model_len", 8192),
            extra_args=kw.get("extra_args", ()),
        )
        for i, n in enumerate(names)
    ]


@contextlib.contextmanager
def three_engines(tiny_llama: Path, logs: Path) -> Iterator[dict[str, LocalEngine]]:
    """Three real engines, ``first0`` (first-turn) and ``warm0``/``warm1``, priority scheduling on,
    the embedded default's 32K context; stopped on exit."""
    specs = engine_specs(
        tiny_llama,
        ["first0", "warm0", "warm1"],
        logs,
        max_model_len=32768,
        extra_args=("--scheduling-policy", "priority"),
    )
    engines = start_engines(specs, timeout_s=300)
    try:
        yield {e.spec.name: e for e in engines}
    finally:
        stop_engines(engines)


def cluster_config(cluster: dict[str, LocalEngine], tiny_llama: Path, **overrides: Any) -> dict[str, Any]:
    def eng(name: str) -> dict[str, Any]:
        s = cluster[name].spec
        return {"name": name, "url": s.url, "model": MODEL, "kv_events": s.kv_events_endpoint}

    data: dict[str, Any] = {
        "pools": [
            {"name": "first_turn", "role": "first_turn", "engines": [eng("first0")]},
            {"name": "warm", "role": "warm", "engines": [eng("warm0"), eng("warm1")]},
        ],
        "models": [{"name": MODEL, "tokenizer": str(tiny_llama), "block_size": 128, "hash_seed": HASH_SEED}],
        "routing": {"split": "wall", "first_turn_threshold_tokens": 512, "forward_priority": True},
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
    }
    data.update(overrides)
    return data


class ServedGateway:
    """A gateway app served by uvicorn in a thread, on a free loopback port."""

    def __init__(self, config: dict[str, Any]) -> None:
        port = free_ports(1)[0]
        self.config = load_config(None, listen={"host": "127.0.0.1", "port": port}, **config)
        self.app = create_app(self.config)
        self.url = f"http://127.0.0.1:{port}"
        cfg = uvicorn_config(self.app, self.config)  # the server limits `agentgw serve` runs with
        self.server = uvicorn.Server(cfg)
        self.loop: asyncio.AbstractEventLoop | None = None
        # the loop uvicorn would pick (uvloop when installed), as `agentgw serve` runs
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()  # for tests that call the app's ASGI interface
        await self.server.serve()

    @property
    def service(self) -> Any:
        return self.app.state.service

    def __enter__(self) -> ServedGateway:
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("gateway did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def wait_ready(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


def engine_metric(engine_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus metric's samples on an engine (optionally filtered by labels)."""
    text = httpx.get(engine_url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        total += float(value)
    return total


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A real mooncake_master on loopback, shared by every test that needs the store tier."""
    try:
        # client_ttl 60 s, not the master's 10: on this loaded 2-core machine a live engine's
        # heartbeat was seen to arrive >10 s late, and the master then expired the client and
        # dropped its segment with every object in it (the retention tests' load failures).
        # Stopped engines unmount their segment (engine_command's --shutdown-timeout), so the
        # longer TTL keeps no dead segment; only a killed client would, and no test kills one
        # on this master.
        master = MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log", client_ttl_s=60)
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (./scripts/setup.sh --test installs it)")
    with master:
        yield master


@contextlib.contextmanager
def fake_engine(*args: str) -> Iterator[str]:
    """The stand-in OpenAI engine (testing/fake_engine.py: no model) as a subprocess; yields its URL."""
    from testing.net import free_port, wait_http_ok

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "testing.fake_engine", "--port", str(port), *args],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health", 60, proc)  # a bound on a loaded machine
        yield url
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (./scripts/setup.sh --test installs it)")
    port = free_ports(1)[0]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
