"""The local engine launcher: command line and environment, process-group lifecycle (with stand-in
processes, fast), and one real vLLM engine on the tiny Llama (slow, marked `engine`)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.local import engines
from gateway.local.engines import (
    HASH_SEED,
    EngineError,
    EngineSpec,
    LocalEngine,
    engine_command,
    engine_env,
    free_port,
    free_ports,
    start_engines,
    stop_engines,
)
from gateway.local.tiny_model import SERVED_MODEL_NAMES, build_tiny_model

PORTS = range(20000, 21000)


def spec(tmp_path: Path, name: str = "e0", **kw: Any) -> EngineSpec:
    port, kv_port = free_ports(2, PORTS)
    fields: dict[str, Any] = {
        "name": name,
        "model_dir": tmp_path / "model",
        "served_model_name": "tiny-llama",
        "port": port,
        "kv_events_port": kv_port,
        "log_path": tmp_path / f"{name}.log",
    }
    return EngineSpec(**(fields | kw))


def group_pids(pgid: int) -> set[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            pids.add(int(stat.parent.name))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# --- command line and environment -------------------------------------------------------------


def test_command_enables_prefix_caching_cbor_hashes_and_kv_events(tmp_path: Path) -> None:
    s = spec(tmp_path, max_model_len=4096, num_gpu_blocks_override=40, extra_args=("--seed", "1"))
    cmd = engine_command(s)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in (
        "--enforce-eager",
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo sha256_cbor",
        "--enable-prompt-tokens-details",
        "--max-model-len 4096",
        "--num-gpu-blocks-override 40",
        f"--port {s.port}",
        "--host 127.0.0.1",
    ):
        assert flag in joined
    kv = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert kv == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # loopback, not every interface, in the form vLLM binds (it connects to tcp://127.0.0.1:P)
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{s.kv_events_port}",
        "topic": "kv-events",
    }
    assert cmd[-2:] == ["--seed", "1"]
    assert s.kv_events_endpoint == f"tcp://127.0.0.1:{s.kv_events_port}"


def test_command_without_kv_events_port_publishes_none(tmp_path: Path) -> None:
    s = spec(tmp_path, kv_events_port=None)
    assert "--kv-events-config" not in engine_command(s)
    assert s.kv_events_endpoint is None


def test_command_turns_tool_calling_on_with_the_hermes_parser_unless_told_not_to(tmp_path: Path) -> None:
    cmd = engine_command(spec(tmp_path))
    assert "--enable-auto-tool-choice" in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    off = engine_command(spec(tmp_path, tool_call_parser=None))
    assert "--enable-auto-tool-choice" not in off and "--tool-call-parser" not in off


def test_command_serves_the_aliases_and_loads_the_logits_processors(tmp_path: Path) -> None:
    plain = engine_command(spec(tmp_path))
    assert plain[plain.index("--served-model-name") + 1 :][:2] == ["tiny-llama", "--host"]
    assert "--logits-processors" not in plain
    cmd = engine_command(spec(tmp_path, served_aliases=("tiny-agent",), logits_processors=("m:Cls",)))
    i = cmd.index("--served-model-name")
    assert cmd[i + 1 : i + 3] == ["tiny-llama", "tiny-agent"]
    assert cmd[cmd.index("--logits-processors") + 1] == "m:Cls"


def test_env_fixes_the_hash_seed_and_the_cpu_settings(tmp_path: Path) -> None:
    env = engine_env(
        spec(tmp_path, kv_cache_gib=2, extra_env={"OMP_NUM_THREADS": "2"}), base={"PATH": "/bin"}
    )
    assert env["PYTHONHASHSEED"] == HASH_SEED
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "2"  # extra_env wins
    assert env["PATH"] == "/bin"
    assert "VLLM_CACHE_ROOT" in env
    assert env["VLLM_ENABLE_RESPONSES_API_STORE"] == "1"  # vLLM stores /v1/responses only then


def test_free_ports_are_distinct_and_in_range() -> None:
    ports = free_ports(20, PORTS)
    assert len(set(ports)) == 20
    assert all(p in PORTS for p in ports)


def test_free_ports_default_to_a_range_below_the_ephemeral_one() -> None:
    # A released port in the ephemeral range can go to any bind(0) before its engine binds it.
    low, _high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert engines.DEFAULT_PORT_RANGE.stop <= low
    ports = free_ports(8)
    assert all(p in engines.DEFAULT_PORT_RANGE for p in ports)
    assert free_port() in engines.DEFAULT_PORT_RANGE


def _free_window(size: int) -> range:
    """`size` consecutive ports that all bind right now, outside every range the tests and engines
    use (a fixed window such as 20900-20909 lies in the fixed test range 20000-21000, and a CI run
    found one of its ports taken, which made the reuse below look like a repeat)."""
    for start in range(21000, 22000 - size, size):
        window = range(start, start + size)
        with contextlib.ExitStack() as stack:
            try:
                for port in window:
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return window
    raise AssertionError("no free window of ports in 21000-22000")


def test_free_ports_do_not_hand_out_a_recent_port_again() -> None:
    # Each call releases its ports; only the memory of what it handed out keeps the next call off them.
    small = _free_window(10)
    first = free_ports(5, small)
    second = free_ports(5, small)
    assert not set(first) & set(second)
    # When the range has nothing else, a recent port is reused rather than failing.
    assert len(set(free_ports(3, small))) == 3


# --- lifecycle, with stand-in processes ---------------------------------------------------------

# A leader that starts a child, both ignoring SIGTERM, like an engine that hangs on shutdown.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
print("child", child.pid, flush=True)
time.sleep(300)
"""


# vLLM's shape: the API server stops its EngineCore with a SIGTERM of its own and waits; the
# EngineCore tears down after the first SIGTERM, and a second one during the teardown kills it.
FORWARDING_CHILD = """
import signal, sys, time
def term(*_):
    if getattr(term, "seen", False):
        print("second sigterm", flush=True)
        return
    term.seen = True
    time.sleep(1.0)
    print("teardown done", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("child ready", flush=True)
while True:
    time.sleep(0.05)
"""
FORWARDING = f"""
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {FORWARDING_CHILD!r}])
def forward(*_):
    child.terminate()
    child.wait(30)
    sys.exit(0)
signal.signal(signal.SIGTERM, forward)
time.sleep(300)
"""


def stand_in(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    monkeypatch.setattr(engines, "engine_command", lambda spec: [sys.executable, "-c", code])


def test_wait_ready_reports_an_engine_that_dies_with_its_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in(monkeypatch, "print('model folder is missing'); raise SystemExit(3)")
    engine = LocalEngine(spec(tmp_path))
    engine.start()
    with pytest.raises(EngineError, match=r"exited with code 3(.|\n)*model folder is missing"):
        engine.wait_ready(timeout_s=30)
    engine.stop()


def test_wait_ready_reports_the_first_traceback_that_a_long_tail_would_hide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As vLLM does when its EngineCore fails: the root cause, then the API server's long traceback.
    code = (
        "import sys\n"
        "print('Traceback (most recent call last):')\n"
        "print('OSError: [Errno 98] Address already in use (the root cause)')\n"
        "for i in range(400): print(f'  File api_server.py, line {i}, in run_server')\n"
        "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
        "sys.exit(1)\n"
    )
    stand_in(monkeypatch, code)
    engine = LocalEngine(spec(tmp_path))
    engine.start()
    with pytest.raises(EngineError) as failure:
        engine.wait_ready(timeout_s=30)
    engine.stop()
    message = str(failure.value)
    assert "Address already in use (the root cause)" in message
    assert "Engine core initialization failed" in message
    assert "Address already in use" not in engine.log_tail()  # the old message's tail alone


def test_wait_ready_times_out_with_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, "import time; print('loading', flush=True); time.sleep(300)")
    engine = LocalEngine(spec(tmp_path))
    engine.start()
    try:
        with pytest.raises(EngineError, match=r"not ready after 1 s(.|\n)*loading"):
            engine.wait_ready(timeout_s=1)
    finally:
        engine.stop()
    assert not engine.running


def started_stand_in(s: EngineSpec, ready: str) -> LocalEngine:
    """A started stand-in engine once its log shows `ready`."""
    engine = LocalEngine(s)
    engine.start()
    assert engine.pid is not None
    deadline = time.monotonic() + 30
    while ready not in s.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine


def test_stop_kills_a_group_that_ignores_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, STUBBORN)
    s = spec(tmp_path)
    engine = started_stand_in(s, "child")
    assert engine.pid is not None
    child = int(s.log_path.read_text().split()[1])
    assert group_pids(engine.pid) == {engine.pid, child}

    started = time.monotonic()
    engine.stop(grace_s=0.5)
    assert time.monotonic() - started < 5
    assert not alive(engine.pid) and not alive(child)
    assert group_pids(engine.pid) == set()


def test_stop_lets_the_leader_stop_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the leader gets SIGTERM: its child sees one SIGTERM (the leader's) and finishes its
    teardown; a SIGTERM to the whole group reached it twice (the Mooncake segment that never
    unmounted, docs/engine_ext.md)."""
    stand_in(monkeypatch, FORWARDING)
    s = spec(tmp_path)
    engine = started_stand_in(s, "child ready")
    assert engine.pid is not None
    engine.stop()
    log = s.log_path.read_text()
    assert "teardown done" in log and "second sigterm" not in log, log
    assert group_pids(engine.pid) == set()


def test_kill_ends_the_group_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in(monkeypatch, STUBBORN)
    engine = LocalEngine(spec(tmp_path))
    engine.start()
    assert engine.pid is not None
    engine.kill()
    assert group_pids(engine.pid) == set()
    engine.stop()  # stopping a killed engine is harmless


def test_start_engines_stops_all_when_one_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        engines,
        "engine_command",
        lambda s: [
            sys.executable,
            "-c",
            "raise SystemExit(1)" if s.name == "bad" else "import time; time.sleep(300)",
        ],
    )
    started: list[LocalEngine] = []
    real_start = LocalEngine.start

    def record(self: LocalEngine) -> None:
        real_start(self)
        started.append(self)

    monkeypatch.setattr(LocalEngine, "start", record)
    with pytest.raises(EngineError, match="bad exited with code 1"):
        start_engines([spec(tmp_path, "good"), spec(tmp_path, "bad")], timeout_s=30)
    assert [e.spec.name for e in started] == ["good", "bad"]
    for e in started:
        assert e.pid is not None and group_pids(e.pid) == set()


# --- one real engine ----------------------------------------------------------------------------


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.load(response)
        return result


def listening_on(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(addr)
                    if width == 8:
                        out.add(str(ipaddress.IPv4Address(raw[::-1])))
                    else:  # four little-endian 32-bit words
                        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                        out.add(str(ipaddress.IPv6Address(words)))
    return out


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.engine
def test_real_engine_serves_chat_hits_its_prefix_cache_publishes_events_and_stops_clean(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import msgpack
    import zmq
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")
    logs = tmp_path_factory.mktemp("logs")
    s = spec(
        logs, "llama", model_dir=model, served_model_name=SERVED_MODEL_NAMES["llama"], max_model_len=8192
    )
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    engine = LocalEngine(s)
    engine.start()
    assert engine.pid is not None
    try:
        engine.wait_ready(timeout_s=300)
        members = group_pids(engine.pid)
        assert len(members) >= 3  # API server, EngineCore, worker

        assert s.kv_events_endpoint is not None
        subscriber.connect(s.kv_events_endpoint)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        time.sleep(1.0)  # PUB/SUB drops what is published before the subscription lands

        messages = [
            {"role": "system", "content": "You keep a ledger of passing ships. " * 40},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Which ships"}, {"type": "text", "text": "waved?"}],
            },
        ]
        body = {"model": "tiny-llama", "messages": messages, "max_tokens": 4, "return_token_ids": True}
        first = post(engine.url + "/v1/chat/completions", body)
        second = post(engine.url + "/v1/chat/completions", body)

        # vLLM renders and tokenizes exactly as the gateway will, list content included.
        tokenizer = AutoTokenizer.from_pretrained(model)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert first["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
        assert first["usage"]["completion_tokens"] == 4

        prompt_tokens = first["usage"]["prompt_tokens"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt_tokens - 1) // 128 * 128 > 0
        assert metric(engine.url, "vllm:prefix_cache_hits_total") == cached

        assert subscriber.poll(timeout=10_000), "no KV event within 10 s"
        topic, seq, payload = subscriber.recv_multipart()
        assert topic == b"kv-events" and len(seq) == 8
        _ts, events, *_ = msgpack.unpackb(payload)
        kinds = {event["type"] if isinstance(event, dict) else event[0] for event in events}
        assert "BlockStored" in kinds, events
        # the KV events say which prefixes the engine holds: published on loopback only, like
        # its HTTP port (and bound by the engine: vLLM connects instead for an endpoint without
        # '*' or '::', and nothing then listens)
        assert s.kv_events_port is not None and listening_on(s.kv_events_port) == {"127.0.0.1"}
        assert listening_on(s.port) == {"127.0.0.1"}
    finally:
        subscriber.close(linger=0)
        context.term()
        engine.stop()

    assert not alive(engine.pid)
    assert group_pids(engine.pid) == set()
    assert not any(alive(pid) for pid in members)


def test_stop_before_start_is_a_no_op(tmp_path: Path) -> None:
    LocalEngine(spec(tmp_path)).stop()


def test_a_kv_transfer_config_gets_a_unique_engine_id_and_an_explicit_one_is_kept() -> None:
    cmd = ["python", "-m", "x", "--kv-transfer-config", json.dumps({"kv_connector": "OffloadingConnector"})]
    a, id_a = engines.with_engine_id(cmd, "warm0")
    _, id_b = engines.with_engine_id(cmd, "warm0")
    assert id_a and id_b and id_a != id_b and id_a.startswith("agentgw-warm0-")
    assert json.loads(a[4]) == {"kv_connector": "OffloadingConnector", "engine_id": id_a}
    assert cmd[4] == json.dumps({"kv_connector": "OffloadingConnector"})  # the input is not changed
    explicit = ["--kv-transfer-config", json.dumps({"engine_id": "mine"})]
    assert engines.with_engine_id(explicit, "e") == (explicit, "mine")
    assert engines.with_engine_id(["--model", "m"], "e") == (["--model", "m"], None)


def test_stop_engines_stops_them_all_at_once_and_every_one_even_if_one_fails() -> None:
    """Each stop waits at a barrier the others must reach: one after another, the first would
    never pass it (a vLLM teardown takes seconds; a fleet's stop took their sum)."""
    barrier = threading.Barrier(3, timeout=30)
    stopped: list[str] = []

    def engine(name: str, fails: bool = False) -> Any:
        def stop() -> None:
            barrier.wait()
            stopped.append(name)
            if fails:
                raise RuntimeError(f"{name} failed to stop")

        return SimpleNamespace(spec=SimpleNamespace(name=name), stop=stop)

    with pytest.raises(RuntimeError, match="a failed"):
        stop_engines([engine("a", fails=True), engine("b"), engine("c")])
    assert sorted(stopped) == ["a", "b", "c"]
    stop_engines([])
