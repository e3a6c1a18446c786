"""Entry point of the agentgw container images: one port layout, every service of the compose file.

Each service of ``docker-compose.yml`` runs ``launch.py <service>``; all of them read the same
layout from the environment, so the gateway's pools, the engines' ports, Mooncake and Redis agree
without a hand-written config. Containers use host networking and bind 127.0.0.1 only.

Layout (environment, defaults in brackets):

- ``ENGINES`` [3], ``FIRST_TURN_ENGINES`` [0]: the engines, named ``engine0 ..``; the first
  ``FIRST_TURN_ENGINES`` form a first-turn pool and the rest a warm pool, or with none all of
  them one pool (defaults: ``agentgw serve``'s layout, ``gateway.local.layout.DEFAULT``, what
  ``agentgw plan`` recommends for 3 engines; ``WARM_ENGINES`` W, as ``agentgw serve --warm``,
  means ``ENGINES`` = first-turn + W). Engine ``i`` serves the OpenAI API on
  ``ENGINE_PORT_BASE + i`` [8100], publishes KV events on ``+100``, and runs engine_ext's control
  API on ``+200``.
- ``MODEL`` [tiny-llama]: a model folder under ``MODELS_DIR`` [/models]; ``SERVED_MODEL_NAME``
  [= MODEL]. ``BLOCK_SIZE`` [128], ``MAX_MODEL_LEN`` [32768], ``KV_CACHE_GIB`` [1] (CPU engines),
  ``HOST_TIER_BYTES`` [256 MiB] (engine_ext's host tier), ``ENGINE_ARGS`` (extra vLLM arguments).
- ``MOONCAKE_PORT`` [50051]: the master's RPC port; its HTTP metadata server and metrics are on
  ``+1`` and ``+2``. ``MOONCAKE_CLIENT_TTL`` [30]: seconds the master keeps an engine without a
  heartbeat before it drops the engine's segment and its objects (Mooncake's default of 10 was
  too short on a loaded 2-core host; docs/engine_ext.md). ``REDIS_PORT`` [6379].
  ``CONTROL_TOKEN``: bearer of the control API (required).
- ``GATEWAY_PORT`` [8000]. Any ``AGENTGW_*`` variable overrides the gateway config it writes
  (``AGENTGW_ROUTING__PROFILE=cache_aware``; see docs/operations.md).
- Replicas behind a balancer (the ``replicas`` profile): ``gateway INDEX`` serves on
  ``REPLICA_PORT_BASE + INDEX`` [8010] and requires the key in ``API_KEY`` (tenant ``default``;
  ``ADMIN_KEY`` optional); ``balancer`` runs nginx on ``BALANCER_PORT`` [8080] over ``REPLICAS``
  [3] of them, configured by ``gateway.local.balancer.nginx_conf`` (round robin, retries of
  requests no replica answered, streams unbuffered).

Services: ``model`` (build the tiny model into ``MODELS_DIR/MODEL`` unless it is there: the ``cpu``
profile's init step, nothing downloaded), ``engine NAME``, ``gateway [INDEX]``, ``balancer``,
``mooncake``, ``redis``, and
``health`` (the image HEALTHCHECK: probes what the service started in this container announced).

The engine's command line and environment are ``gateway.local.engines``' (the ones ``agentgw
serve`` uses), plus engine_ext's ``--kv-transfer-config`` (host tier, Mooncake tier, control API).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.local.layout import LocalLayout

HOST = "127.0.0.1"
HEALTH_FILE = Path(tempfile.gettempdir()) / "agentgw-health"
"""Where a started service writes the URL its health check probes (http://... or redis://...)."""


def _opt_int(name: str) -> int | None:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else None
    except ValueError:
        raise SystemExit(f"launch: {name}={raw!r} is not an integer") from None


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise SystemExit(f"launch: {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class Layout:
    engines: int | None
    first_turn: int | None
    warm: int | None
    engine_port_base: int
    gateway_port: int
    mooncake_port: int
    redis_port: int
    models_dir: Path
    model: str
    served_model_name: str
    block_size: int
    control_token: str

    @classmethod
    def from_env(cls) -> Layout:
        model = os.environ.get("MODEL") or "tiny-llama"
        return cls(
            engines=_opt_int("ENGINES"),
            first_turn=_opt_int("FIRST_TURN_ENGINES"),
            warm=_opt_int("WARM_ENGINES"),
            engine_port_base=_int("ENGINE_PORT_BASE", 8100),
            gateway_port=_int("GATEWAY_PORT", 8000),
            mooncake_port=_int("MOONCAKE_PORT", 50051),
            redis_port=_int("REDIS_PORT", 6379),
            models_dir=Path(os.environ.get("MODELS_DIR") or "/models"),
            model=model,
            served_model_name=os.environ.get("SERVED_MODEL_NAME") or model,
            block_size=_int("BLOCK_SIZE", 128),
            control_token=os.environ.get("CONTROL_TOKEN", ""),
        )

    @property
    def pools(self) -> LocalLayout:
        """The engines and their pools, as ``agentgw serve`` lays them out (engine and gateway images)."""
        from gateway.local.layout import LayoutError, resolve

        try:
            return resolve(self.engines, self.first_turn, self.warm)
        except LayoutError as exc:
            raise SystemExit(f"launch: ENGINES/FIRST_TURN_ENGINES/WARM_ENGINES: {exc}") from None

    @property
    def engine_names(self) -> list[str]:
        return self.pools.names

    @property
    def model_dir(self) -> Path:
        return self.models_dir / self.model

    def index(self, name: str) -> int:
        try:
            return self.engine_names.index(name)
        except ValueError:
            raise SystemExit(f"launch: engine {name!r} is not in the layout {self.engine_names}") from None

    def engine_port(self, name: str) -> int:
        return self.engine_port_base + self.index(name)

    def kv_events_port(self, name: str) -> int:
        return self.engine_port_base + 100 + self.index(name)

    def control_port(self, name: str) -> int:
        return self.engine_port_base + 200 + self.index(name)

    @property
    def mooncake_master(self) -> str:
        return f"{HOST}:{self.mooncake_port}"

    @property
    def mooncake_metadata(self) -> str:
        return f"http://{HOST}:{self.mooncake_port + 1}/metadata"

    def gateway_config(self) -> dict[str, object]:
        """The gateway config that fronts the layout's engines (pools, model, Redis, migrations)."""

        def engine(name: str) -> dict[str, object]:
            return {
                "name": name,
                "url": f"http://{HOST}:{self.engine_port(name)}",
                "model": self.served_model_name,
                "kv_events": f"tcp://{HOST}:{self.kv_events_port(name)}",
                "control_url": f"http://{HOST}:{self.control_port(name)}",
            }

        layout = self.pools
        from gateway.local.engines import HASH_SEED

        data: dict[str, object] = {
            "listen": {"host": HOST, "port": self.gateway_port},
            "pools": layout.pools([engine(n) for n in layout.names]),
            "models": [
                {
                    "name": self.served_model_name,
                    "tokenizer": str(self.model_dir),
                    "block_size": self.block_size,
                    "hash_seed": HASH_SEED,
                }
            ],
            "sessions": {"backend": "redis", "redis_url": f"redis://{HOST}:{self.redis_port}/0"},
            "migration": {"control_token": self.control_token},
        }
        if layout.routing():  # the layout's split keys; AGENTGW_ROUTING__* still override them
            data["routing"] = layout.routing()
        return data


def _announce(url: str) -> None:
    HEALTH_FILE.write_text(url, encoding="utf-8")


def _exec(cmd: list[str], env: dict[str, str] | None = None) -> None:
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, os.environ if env is None else env)


def _require_token(layout: Layout) -> None:
    if not layout.control_token:
        raise SystemExit("launch: CONTROL_TOKEN is empty (the engines' control API needs a bearer token)")


def run_engine(layout: Layout, name: str) -> None:
    from engine_ext.config import control_env, kv_transfer_config
    from gateway.local.engines import EngineSpec, engine_command, engine_env, publisher_endpoint

    _require_token(layout)
    port = layout.engine_port(name)
    kv = kv_transfer_config(
        _int("HOST_TIER_BYTES", 256 << 20),
        control_port=layout.control_port(name),
        engine_url=f"http://{HOST}:{port}",
        mooncake_master=layout.mooncake_master,
        mooncake_metadata=layout.mooncake_metadata,
    )
    kv["engine_id"] = f"agentgw-{name}"  # names its /dev/shm offload file (the container's own)
    extra = ("--kv-transfer-config", json.dumps(kv), "--block-size", str(layout.block_size))
    spec = EngineSpec(
        name=name,
        model_dir=layout.model_dir,
        served_model_name=layout.served_model_name,
        port=port,
        log_path=Path(os.devnull),
        max_model_len=_int("MAX_MODEL_LEN", 32768),
        kv_events_port=layout.kv_events_port(name),
        kv_cache_gib=_int("KV_CACHE_GIB", 1),
        extra_args=extra + tuple(shlex.split(os.environ.get("ENGINE_ARGS", ""))),
        # the control token through the environment, never the arguments (/proc/<pid>/cmdline)
        extra_env={
            "MC_TCP_BIND_ADDRESS": HOST,
            "MC_STORE_CLIENT_SETUP_RETRIES": "30",
            **control_env(layout.control_token),
        },
        platform=os.environ.get("AGENTGW_ENGINE_PLATFORM", "cpu"),  # the engine-gpu image: cuda
    )
    if not (layout.model_dir / "config.json").is_file():
        raise SystemExit(f"launch: no model at {layout.model_dir} (MODELS_DIR/MODEL)")
    cmd = engine_command(spec)
    i = cmd.index("--kv-events-config") + 1
    # bound to HOST only (not *), in the form vLLM binds rather than connects (publisher_endpoint)
    cmd[i] = json.dumps({**json.loads(cmd[i]), "endpoint": publisher_endpoint(spec.kv_events_port, HOST)})
    _announce(f"http://{HOST}:{port}/health")
    _exec(cmd, engine_env(spec))


def run_gateway(layout: Layout, replica: int | None = None) -> None:
    """One gateway, or (``replica``) one of the replicas behind the balancer: its own port, keys
    required (behind a loopback balancer every client looks local)."""
    import yaml

    config = layout.gateway_config()
    port = layout.gateway_port
    if replica is not None:
        if not os.environ.get("API_KEY"):
            raise SystemExit("launch: API_KEY is empty (replicas behind a balancer require a key)")
        port = _int("REPLICA_PORT_BASE", 8010) + replica
        config["listen"] = {"host": HOST, "port": port}
        auth: dict[str, object] = {"tenants": [{"name": "default", "key_env": ["API_KEY"]}]}
        if os.environ.get("ADMIN_KEY"):
            auth["admin_key_env"] = ["ADMIN_KEY"]
        config["auth"] = auth
    path = Path(tempfile.gettempdir()) / "agentgw-compose.yaml"
    # it holds the control token: readable by this user only
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(yaml.safe_dump(config, sort_keys=False))
    _announce(f"http://{HOST}:{port}/health")
    log_level = os.environ.get("LOG_LEVEL", "warning")
    _exec(["agentgw", "serve", "--config", str(path), "--log-level", log_level])


def run_balancer() -> None:
    """nginx in front of ``REPLICAS`` gateway replicas (testing/replicas.py's settings)."""
    from gateway.local.balancer import nginx_conf

    port = _int("BALANCER_PORT", 8080)
    base = _int("REPLICA_PORT_BASE", 8010)
    upstreams = [f"{HOST}:{base + i}" for i in range(_int("REPLICAS", 3))]
    prefix = Path(tempfile.gettempdir()) / "agentgw-nginx"
    prefix.mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_conf(f"{HOST}:{port}", upstreams, prefix=str(prefix)), encoding="utf-8")
    _announce(f"http://{HOST}:{port}/health")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    _exec([nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf), "-g", "daemon off;"])


def run_model(layout: Layout) -> None:
    """Build the tiny model named MODEL (tiny-llama, tiny-gemma3, ...) unless a complete build is there."""
    from gateway.local.tiny_model import SERVED_MODEL_NAMES, build_tiny_model

    arch = {served: arch for arch, served in SERVED_MODEL_NAMES.items()}.get(layout.model)
    if arch is None:
        raise SystemExit(
            f"launch: MODEL={layout.model!r} is not a tiny model ({sorted(SERVED_MODEL_NAMES.values())})"
        )
    print(f"launch: {build_tiny_model(layout.model_dir, arch)} ready", flush=True)


def run_mooncake(layout: Layout) -> None:
    binary = shutil.which("mooncake_master")
    if binary is None:
        raise SystemExit("launch: mooncake_master is not installed in this image")
    _announce(f"http://{HOST}:{layout.mooncake_port + 2}/health")
    _exec(
        [
            binary,
            f"--rpc_address={HOST}",
            f"--rpc_port={layout.mooncake_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={layout.mooncake_port + 1}",
            f"--metrics_host={HOST}",
            f"--metrics_port={layout.mooncake_port + 2}",
            f"--client_ttl={_int('MOONCAKE_CLIENT_TTL', 30)}",
        ]
    )


def run_redis(layout: Layout) -> None:
    _announce(f"redis://{HOST}:{layout.redis_port}")
    # session placement only: nothing to persist across restarts
    _exec(
        ["redis-server", "--bind", HOST, "--port", str(layout.redis_port), "--save", "", "--appendonly", "no"]
    )


def health() -> int:
    """0 when the service this container started answers its probe, 1 otherwise."""
    try:
        url = HEALTH_FILE.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        print("no service started in this container")
        return 1
    try:
        if url.startswith("redis://"):
            host, port = url.removeprefix("redis://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return 0 if sock.recv(16).startswith(b"+PONG") else 1
        with urllib.request.urlopen(url, timeout=2) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"{url}: {exc}")
        return 1


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: launch.py model|engine NAME|gateway [INDEX]|balancer|mooncake|redis|health")
    service, args = argv[0], argv[1:]
    if service == "health":
        return health()
    layout = Layout.from_env()
    if service == "engine" and len(args) == 1:
        run_engine(layout, args[0])
    elif service == "gateway" and len(args) <= 1:
        run_gateway(layout, int(args[0]) if args else None)
    elif service == "balancer":
        run_balancer()
    elif service == "model":
        run_model(layout)
    elif service == "mooncake":
        run_mooncake(layout)
    elif service == "redis":
        run_redis(layout)
    else:
        raise SystemExit(f"launch: unknown service {' '.join(argv)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
