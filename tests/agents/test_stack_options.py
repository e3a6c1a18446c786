"""`agentgw serve --store mooncake --sessions redis`: the local stack starts a mooncake_master and a
redis-server beside its engines and wires them (the engines' Mooncake tier, the gateway's session
store), and stops them with the engines. One engine; and the missing-binary messages, which name
the install command."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
import redis

from engine_ext.config import CONTROL_TOKEN_ENV
from gateway.local import redis_server
from gateway.local.embedded import start_local_stack
from gateway.local.layout import LocalLayout
from gateway.local.redis_server import LocalRedis
from tests.conftest import ServedGateway, wait_ready


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (from /proc/*/stat's parent ids)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew = bool(more)
        tree |= more
    return sorted(tree)


def assert_token_only_in_environ(token: str, engine_pid: int | None) -> None:
    """No process's arguments (/proc/<pid>/cmdline, world-readable) hold ``token``; the engine's
    processes have it in their environment, whose /proc file is readable by their user only."""
    assert engine_pid is not None
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes()
        except OSError:
            continue
        assert token.encode() not in args, f"the control token is in {cmdline}: {args[:200]!r}"
    tree = process_tree(engine_pid)
    assert len(tree) >= 2, tree  # the API server and its engine core
    for pid in tree:
        environ = Path(f"/proc/{pid}/environ")
        mode = environ.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{environ} is readable by others: {mode:o}"
    assert f"{CONTROL_TOKEN_ENV}={token}".encode() in Path(f"/proc/{engine_pid}/environ").read_bytes()


def test_a_missing_redis_server_names_its_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    with pytest.raises(
        FileNotFoundError, match="redis-server is not installed: apt-get install redis-server"
    ):
        LocalRedis()


@pytest.mark.engine
@pytest.mark.store
@pytest.mark.redis
def test_store_mooncake_and_sessions_redis_start_wire_and_stop_their_servers(
    tiny_llama: Path, tmp_path: Path
) -> None:
    stack = start_local_stack(
        LocalLayout(engines=1),
        store="mooncake",
        sessions="redis",
        home=tmp_path,
        model_dir=tiny_llama,
        timeout_s=300,
    )
    try:
        assert stack.mooncake is not None and stack.redis is not None
        (engine,) = stack.config["pools"][0]["engines"]
        token = stack.config["migration"]["control_token"]
        assert stack.config["sessions"] == {"backend": "redis", "redis_url": stack.redis.url}
        # the engine loaded the Mooncake tier on this master, behind the generated token
        stats = httpx.get(
            engine["control_url"] + "/v1/kv/stats", headers={"Authorization": f"Bearer {token}"}, timeout=10
        ).json()
        assert "MooncakeTier" in stats["tiers"], stats
        assert httpx.get(engine["control_url"] + "/v1/kv/stats", timeout=10).status_code == 401
        # the token is in no process's arguments, and in the engine's environment, which only
        # its own user may read
        assert_token_only_in_environ(token, stack.engines[0].pid)
        with ServedGateway({**stack.config, "timeouts": {"health_interval_s": 0.5}}) as gw:
            wait_ready(gw.url)
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                headers={"X-Session-ID": "stack-redis-1"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        # the session went to the local redis-server
        keys = redis.Redis.from_url(stack.redis.url).keys("*stack-redis-1*")
        assert keys, "the session is not in redis"
        master_port, redis_port = stack.mooncake.rpc_port, stack.redis.port
    finally:
        stack.stop()
    for port in (master_port, redis_port):  # both servers went with the stack
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, port
