"""`agentgw serve`: config -> (local engines when none are configured) -> create_app -> uvicorn.
`agentgw plan`: the pool layout a trace asks for, from the simulator (gateway/sim/plan.py)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.local.layout import DEFAULT, LayoutError, LocalLayout, resolve
from gateway.service.membership import read_pools_file
from gateway.service.request_ids import install_log_filter
from gateway.service.tenants import TenantRegistry


def _serve_app(
    config: GatewayConfig,
    log_level: str,
    reload: Any = None,
    engine_notes: dict[str, str] | None = None,
    on_server: Callable[[Any], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; the drain (gateway/api/drain.py) runs before it returns.
    ``on_server`` gets the server before it starts (to stop it from another thread)."""
    from gateway.api.app import create_app
    from gateway.api.server import GatewayServer, raise_fd_limit, uvicorn_config

    raise_fd_limit()  # idle clients and upstream streams both hold descriptors
    # header/body timeouts, header limits, the connection cap: see gateway/api/server.py
    app = create_app(config, reload=reload, engine_notes=engine_notes)
    # log_config None: uvicorn's own lines go through the root handler too (with the request id)
    server = GatewayServer(uvicorn_config(app, config, log_level=log_level, log_config=None), app.drain)
    if on_server is not None:
        on_server(server)
    server.run()


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


CLIENTS = {
    "claude": "run Claude Code against the gateway (AGENTGW_URL, default http://127.0.0.1:8000)",
    "codex": "run Codex CLI against the gateway (AGENTGW_URL, default http://127.0.0.1:8000)",
}


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] in CLIENTS:  # every other argument is the client's own
        from gateway.local.harness import run_client

        return run_client(args_in[0], args_in[1:])
    parser = argparse.ArgumentParser(prog="agentgw", description="Agentic OpenAI-compatible gateway for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in CLIENTS.items():
        sub.add_parser(name, help=f"{help_text}; its arguments follow, e.g. `agentgw {name} --help`")
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="YAML config file (default: embedded local engines)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--log-level", default="warning")
    serve.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="use an existing engine instead of starting local ones (repeatable)",
    )
    serve.add_argument("--model", help="the model the --engine URLs serve (default: tiny-llama)")
    serve.add_argument(
        "--engines",
        type=int,
        metavar="N",
        help=f"local engines to start (default {DEFAULT.engines}: the layout `agentgw plan` recommends)",
    )
    serve.add_argument(
        "--first-turn",
        type=int,
        metavar="F",
        help=f"of the local engines, how many form a first-turn pool, the rest a warm pool "
        f"(default {DEFAULT.first_turn}{': one pool' if not DEFAULT.first_turn else ''})",
    )
    serve.add_argument(
        "--warm", type=int, metavar="W", help="local warm engines: with --first-turn F, --engines F+W"
    )
    serve.add_argument(
        "--store",
        choices=("none", "host", "mooncake"),
        default="host",
        help="local engines' KV store: host (default: engine_ext's host tier, device pins and its "
        "control API), mooncake (plus a shared Mooncake tier on a local mooncake_master), none "
        "(plain vLLM engines)",
    )
    serve.add_argument(
        "--sessions",
        choices=("memory", "redis"),
        default="memory",
        help="session store: memory (default), redis (a local redis-server, started here)",
    )
    serve.add_argument(
        "--speculative-config",
        metavar="JSON",
        help="local engines: vLLM's --speculative-config (speculative decoding), e.g. "
        '\'{"method": "draft_model", "num_speculative_tokens": 3}\' (a draft_model without a '
        "model drafts with the tiny model itself)",
    )
    _add_plan(sub)
    args = parser.parse_args(argv)
    args.speculative = None
    if getattr(args, "speculative_config", None):
        try:
            args.speculative = json.loads(args.speculative_config)
        except ValueError as exc:
            parser.error(f"--speculative-config: not JSON ({exc})")
        if not isinstance(args.speculative, dict):
            parser.error("--speculative-config: must be a JSON object")
    if args.command == "plan":
        return _plan(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s",
    )
    install_log_filter()  # %(request_id)s: the request's x-request-id, "-" outside a request
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO

    overrides: dict[str, object] = {}
    if args.host or args.port is not None:
        overrides["listen"] = {
            "host": args.host or "127.0.0.1",
            "port": args.port if args.port is not None else 8000,
        }
    try:
        config = load_config(args.config, **overrides)
        if not config.pools and args.engine:
            model = args.model or "tiny-llama"
            engines = [{"name": f"engine{i}", "url": u, "model": model} for i, u in enumerate(args.engine)]
            pools = [{"name": "default", "role": "any", "engines": engines}]
            config = load_config(args.config, pools=pools, **overrides)
        # says whether keys are required; keys named by environment variables must be there now
        TenantRegistry.from_config(config.auth, config.listen.host)
        if config.discovery.file is not None:
            read_pools_file(config.discovery.file)  # a bad discovery file stops the start here
    except ConfigError as exc:
        print(f"agentgw: {exc}", file=sys.stderr)
        return 2
    if config.pools or config.discovery.file is not None:
        local = (args.engines, args.first_turn, args.warm)
        if (
            any(v is not None for v in local)
            or args.store != "host"
            or args.sessions != "memory"
            or args.speculative is not None
        ):
            print(
                "agentgw: --engines/--first-turn/--warm/--store/--sessions/--speculative-config start "
                "local engines: not with pools",
                file=sys.stderr,
            )
            return 2
        # uvicorn re-raises the signal that stopped it once it has drained and shut down: here
        # that is a normal exit (0), not death by SIGTERM
        previous = signal.signal(signal.SIGTERM, _terminate)

        def reload() -> GatewayConfig:  # SIGHUP, POST /admin/reload: the file as it is now
            return load_config(args.config, **overrides)

        try:
            _serve_app(config, args.log_level, reload if args.config and not args.engine else None)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
        return 0
    try:
        layout = resolve(args.engines, args.first_turn, args.warm)
    except LayoutError as exc:
        print(f"agentgw: {exc}", file=sys.stderr)
        return 2
    return _serve_embedded(args, layout, layout_routing(layout, config), overrides)


def layout_routing(layout: LocalLayout, config: GatewayConfig) -> dict[str, Any]:
    """``routing`` overrides for the local layout: its split and role-controller keys, except where
    the config (file or environment) sets them itself."""
    own = layout.routing()
    if not own:
        return {}
    mine = config.routing.model_fields_set
    routing = config.routing.model_dump()
    routing.update({k: v for k, v in own.items() if k not in mine})
    return {"routing": routing}


def _add_plan(sub: Any) -> None:
    from gateway.sim import plan

    plan.add_arguments(
        sub.add_parser("plan", help="recommend a pool layout for a trace and fleet (simulator)")
    )


def _plan(args: argparse.Namespace) -> int:
    from gateway.sim import plan

    return int(plan.run(args))


def _say(message: str) -> None:
    print(f"agentgw: {message}", file=sys.stderr, flush=True)


def _serve_embedded(
    args: argparse.Namespace, layout: LocalLayout, routing: dict[str, Any], overrides: dict[str, object]
) -> int:
    """No pools configured: start local engines on the tiny model and front them. The gateway
    listens while they start (gateway/local/startup.py says what they are doing every 10 s);
    an engine that fails to start stops the gateway, and the exit status is 1."""
    from gateway.local.embedded import DEFAULT_HOME, LocalStack, plan_local_stack
    from gateway.local.engines import EngineError
    from gateway.local.startup import EngineStartup, where_to_point

    previous = signal.signal(signal.SIGTERM, _terminate)
    stack: LocalStack | None = None
    startup: EngineStartup | None = None
    try:
        _say(f"preparing the tiny model in {DEFAULT_HOME / 'models'}")
        stack = plan_local_stack(
            layout, store=args.store, sessions=args.sessions, speculative=args.speculative
        )
        specs = stack.specs
        config = load_config(args.config, **stack.config, **routing, **overrides)
        url = f"http://{config.listen.host}:{config.listen.port}"
        logs = specs[0].log_path.parent
        model = specs[0].served_model_name
        startup = EngineStartup(stack.engines, _say, where_to_point(url, model, logs))
        _say(
            f"starting {layout.engines} local vLLM engines ({layout.label}, store {args.store}, "
            f"sessions {args.sessions}); logs in {logs}"
        )
        startup.start()
        _say(f"gateway on {url}: /ready answers 503 until the engines are up (about 1-2 minutes)")

        def attach(server: Any) -> None:
            def stop_server() -> None:
                server.should_exit = True

            assert startup is not None
            startup.on_failure = stop_server

        notes = {s.name: f"log {s.log_path}" for s in specs}
        _serve_app(config, args.log_level, engine_notes=notes, on_server=attach)
    except KeyboardInterrupt:
        pass
    except (EngineError, ConfigError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        # FileNotFoundError: mooncake_master or redis-server missing (the message says how to install)
        _say(str(exc))
        return 1
    finally:
        # uvicorn re-raises the signal that stopped it once it has shut down: ``_terminate`` turns
        # that into KeyboardInterrupt above; while the engines stop, further signals are ignored.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if startup is not None:
            startup.stop()
        if stack is not None:
            stack.stop()
        signal.signal(signal.SIGTERM, previous)
    return 1 if startup is not None and startup.error is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
