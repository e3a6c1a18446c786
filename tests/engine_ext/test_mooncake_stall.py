"""A store to a Mooncake peer that accepts connections but never answers.

Mooncake's TCP transport waits 30 s for a stalled transfer's progress and status frame, and
retries it within the batch's deadline (60 s). With a store to such a peer pending, an engine's
next requests waited with it: 45-118 s on this machine (docs/engine_ext.md, "A stalled store").
The tier can set the transport's stall timeouts (`stall_timeout_s`, off by default; an operator's
environment wins), and a store job whose checksum put failed does not send the data.

The peer is a real Mooncake client with a segment, stopped with SIGSTOP once it has mounted;
the engine (or client) under test lends no segment, so every object it puts goes to the peer.
Asserted: the environment each client ran with, the transport's own "dropped" log lines (which
say how long it waited: under 30 s means the tier's timeout dropped the transfer, not Mooncake's),
return codes and the tier's counters; no test measures a latency.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.tiers.store import STALL_TIMEOUT_ENV, stall_timeout_defaults
from gateway.local.engines import free_ports
from gateway.local.mooncake import MooncakeMaster
from tests.engine_ext.offload_support import (
    BLOCK_BYTES,
    HOST_CHUNKS,
    complete,
    plugin_engine,
    plugin_kv,
    running_engines,
    tier_stats,
    tokens,
    until,
)

pytestmark = pytest.mark.store

PORTS = range(23700, 23800)
REPO = Path(__file__).resolve().parents[2]

PEER = """
import sys, time
from engine_ext.tiers.store import MooncakeObjectStore
store = MooncakeObjectStore(sys.argv[1], sys.argv[2], global_segment_size=64 << 20, local_buffer_size=16 << 20)
print("mounted", flush=True)
time.sleep(3600)
"""

CLIENT = """
import json, os, sys
import numpy as np
from engine_ext.tiers.store import MooncakeObjectStore
store = MooncakeObjectStore(sys.argv[1], sys.argv[2], global_segment_size=0, local_buffer_size=16 << 20,
                            stall_timeout_s=float(sys.argv[3]))
buf = np.ones(1 << 16, dtype=np.uint8)
store.register_buffer(int(buf.ctypes.data), buf.nbytes)
rcs = store.batch_put_from(["stall/k"], [int(buf.ctypes.data)], [buf.nbytes])
env = {k: os.environ.get(k) for k in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")}
print(json.dumps({"rcs": rcs, "env": env}), flush=True)
store.close()
"""


_DROPPED = re.compile(r"no transfer progress within (\d+)s")


def _dropped_after(log: str) -> list[int]:
    """The seconds in each of the transport's "no transfer progress within Ns" lines. It prints the
    time it waited (its timeout, or a little more on a loaded machine); Mooncake's own is 30 s."""
    return [int(n) for n in _DROPPED.findall(log)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STALL_TIMEOUT_ENV}
    return {**env, **MooncakeMaster.client_env, "PYTHONPATH": str(REPO), **extra}


@pytest.fixture
def stopped_peer(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of its own whose only segment belongs to a stopped client."""
    with MooncakeMaster(tmp_path / "master.log", client_ttl_s=600) as master:
        peer = subprocess.Popen(
            [sys.executable, "-c", PEER, master.master_address, master.metadata_server],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert peer.stdout is not None and peer.stdout.readline().strip() == "mounted"
            os.kill(peer.pid, signal.SIGSTOP)
            yield master
        finally:
            os.kill(peer.pid, signal.SIGCONT)
            peer.kill()
            peer.wait()


def _put(master: MooncakeMaster, stall_timeout_s: float, **env: str) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, master.master_address, master.metadata_server, str(stall_timeout_s)],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_stall_timeouts_are_defaults_that_the_environment_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # setenv first, so that monkeypatch records the names and removes what stall_timeout_defaults
    # sets (a delenv of a missing name records nothing: the 3 s it set once leaked into every later
    # engine of the pytest process, whose live transfers were then dropped at 3 s)
    for name in STALL_TIMEOUT_ENV:
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    assert stall_timeout_defaults(2.5) == dict.fromkeys(STALL_TIMEOUT_ENV, "3")  # whole seconds, up
    monkeypatch.setenv(STALL_TIMEOUT_ENV[0], "40")
    monkeypatch.delenv(STALL_TIMEOUT_ENV[1])
    assert stall_timeout_defaults(0.2) == {STALL_TIMEOUT_ENV[0]: "40", STALL_TIMEOUT_ENV[1]: "1"}


def test_a_put_to_a_stopped_peer_is_dropped_after_the_stall_timeout(stopped_peer: MooncakeMaster) -> None:
    out, log = _put(stopped_peer, 2)
    assert out["rcs"][0] < 0  # TRANSFER_FAIL: the peer never answered
    assert out["env"] == dict.fromkeys(STALL_TIMEOUT_ENV, "2")
    waited = _dropped_after(log)
    assert waited and max(waited) < 30  # dropped by the tier's timeout, not the transport's 30 s


def test_an_operators_stall_timeout_wins(stopped_peer: MooncakeMaster) -> None:
    out, log = _put(stopped_peer, 2, MC_TCP_PROGRESS_TIMEOUT_SEC="3", MC_TCP_STATUS_TIMEOUT_SEC="3")
    assert out["rcs"][0] < 0
    assert out["env"] == dict.fromkeys(STALL_TIMEOUT_ENV, "3")
    waited = _dropped_after(log)
    assert waited and max(waited) < 30


@pytest.mark.engine
def test_an_engine_whose_store_stalls_drops_it_and_keeps_serving(
    stopped_peer: MooncakeMaster, tiny_llama: Path, tmp_path: Path
) -> None:
    port, control_port = free_ports(2, PORTS)
    kv = plugin_kv(
        HOST_CHUNKS * BLOCK_BYTES,
        control_port,
        mooncake=stopped_peer,
        global_segment_size=0,
        stall_timeout_s=2,
    )
    spec = plugin_engine("stall", tiny_llama, tmp_path, port, kv, device_blocks=64)
    with running_engines([spec], [control_port]) as engines:
        engine = engines["stall"]
        prefix = tokens(random.Random(7), 1024)
        complete(engine, prefix + [17, 18], max_tokens=4)
        # the store job's checksum put is dropped by the stall timeout, and its data is not sent
        stats = until(lambda: (s := tier_stats(engine))["checksum_put_failures"] >= 1 and s)
        assert stats["stored_chunks"] == 0
        complete(engine, prefix + [19, 20], max_tokens=4)  # served while the peer stays stopped
        assert tier_stats(engine)["stored_chunks"] == 0
    waited = _dropped_after(spec.log_path.read_text(errors="replace"))
    assert waited and max(waited) < 30
