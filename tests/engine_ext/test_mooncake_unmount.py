"""An engine with the Mooncake tier unmounts its segment when it is stopped.

vLLM's default `--shutdown-timeout` (0) kills the EngineCore as soon as the API server is told
to stop, before its teardown closes the KV connector; a Mooncake client killed that way never
unmounts, and the master keeps the dead segment (placing new objects in it, whose puts fail)
until the client's heartbeat lapses (`client_ttl`). `engine_command` gives every engine that
loads engine_ext a shutdown timeout, so the teardown runs and the tier closes its client.

Asserted on the master's own record: the capacity the segment lent goes back to zero, and no
client expired (the master here waits 600 s before it expires one). Before the fix the segment
stayed mounted after the engine was gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.local.engines import engine_command, free_ports
from gateway.local.mooncake import MooncakeMaster
from tests.engine_ext.offload_support import (
    BLOCK_BYTES,
    HOST_CHUNKS,
    plugin_engine,
    plugin_kv,
    running_engines,
    until,
)

pytestmark = [pytest.mark.engine, pytest.mark.store]

PORTS = range(23600, 23700)
CLIENT_TTL_S = 600


def test_a_stopped_engine_unmounts_its_segment(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "master.log"
    with MooncakeMaster(log, client_ttl_s=CLIENT_TTL_S) as master:
        port, control_port = free_ports(2, PORTS)
        kv = plugin_kv(HOST_CHUNKS * BLOCK_BYTES, control_port, mooncake=master)
        spec = plugin_engine("unmount", tiny_llama, tmp_path, port, kv, device_blocks=64)
        assert "--shutdown-timeout" in engine_command(spec)
        with running_engines([spec], [control_port]):
            mounted = master.capacity_bytes()
        assert mounted > 0  # the engine lent its segment while it ran
        # the unmount is the teardown's last step; the master records it at once (well within
        # the bound below, which is far shorter than the 600 s client_ttl that would expire it)
        until(lambda: master.capacity_bytes() == 0)
    assert "client_expired" not in log.read_text(errors="replace")  # unmounted, not expired
