"""A peer that does not serve its segment for longer than the read lease, on a real mooncake_master.

Two real Mooncake clients: a peer process puts objects (the master places them in the only
segment mounted then, the peer's), then is SIGSTOPped; the reader's `batch_get_into` of them waits
for the peer (Mooncake's TCP transfer has no shorter timeout) and, once the peer runs again after
longer than the master's lease (2 s here), fails with LEASE_EXPIRED although every object is
there: what two engines loading each other's objects under heavy CPU load see when a transfer
thread is not scheduled in time. `get_into_renewing_leases` (what `ObjectStoreTier` loads with)
reads them again under a new lease. Asserted on results and data, not on durations.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.tiers.store import LEASE_EXPIRED, MooncakeObjectStore, get_into_renewing_leases
from gateway.local.mooncake import MooncakeMaster

pytestmark = [pytest.mark.store]

N, SIZE = 8, 65536
STOP_S = 3.0  # > the master's 2 s read lease
REPO = Path(__file__).resolve().parents[2]

PEER = """
import ctypes, sys
from engine_ext.tiers.store import MooncakeObjectStore
s = MooncakeObjectStore(sys.argv[1], sys.argv[2], global_segment_size=16 << 20, local_buffer_size=16 << 20)
n, size = int(sys.argv[3]), int(sys.argv[4])
buf = ctypes.create_string_buffer(bytes(range(256)) * (n * size // 256))
s.register_buffer(ctypes.addressof(buf), n * size)
rcs = s.batch_put_from([f"obj{i}" for i in range(n)], [ctypes.addressof(buf) + i * size for i in range(n)], [size] * n)
print("ready" if all(rc == 0 for rc in rcs) else f"put failed {rcs}", flush=True)
sys.stdin.read()
s.close()
"""


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of its own: no other client's segment may receive the peer's objects."""
    with MooncakeMaster(tmp_path / "master.log", lease_ttl_ms=2000) as m:
        yield m


@pytest.fixture
def peer(master: MooncakeMaster) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, **MooncakeMaster.client_env, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER, master.master_address, master.metadata_server, str(N), str(SIZE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.communicate(timeout=60)


def _get_while_peer_stopped(
    reader: MooncakeObjectStore, peer: subprocess.Popen[str], retries: int
) -> tuple[list[int], int, bytes]:
    buf = ctypes.create_string_buffer(N * SIZE)
    reader.register_buffer(ctypes.addressof(buf), N * SIZE)
    ptrs = [ctypes.addressof(buf) + i * SIZE for i in range(N)]
    os.kill(peer.pid, signal.SIGSTOP)
    resume = threading.Timer(STOP_S, os.kill, (peer.pid, signal.SIGCONT))
    resume.start()
    try:
        rcs, again = get_into_renewing_leases(
            reader, [f"obj{i}" for i in range(N)], ptrs, [SIZE] * N, retries
        )
    finally:
        resume.join()
    return rcs, again, buf.raw


@pytest.mark.parametrize("retries", [0, 2])
def test_a_get_that_outlives_its_lease_is_read_again(
    master: MooncakeMaster, peer: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch, retries: int
) -> None:
    for k, v in MooncakeMaster.client_env.items():
        monkeypatch.setenv(k, v)
    reader = MooncakeObjectStore(
        master.master_address,
        master.metadata_server,
        global_segment_size=16 << 20,
        local_buffer_size=16 << 20,
    )
    try:
        rcs, again, data = _get_while_peer_stopped(reader, peer, retries)
    finally:
        reader.close()
    if retries == 0:  # what the tier did before: every object counted as a load failure
        assert set(rcs) == {LEASE_EXPIRED} and again == 0
        return
    assert rcs == [SIZE] * N and again >= N
    assert zlib.crc32(data) == zlib.crc32(bytes(range(256)) * (N * SIZE // 256))
