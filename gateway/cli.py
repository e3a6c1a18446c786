"""`agentgw serve`: config -> (local engines when none are configured) -> create_app -> uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.config import ConfigError, GatewayConfig, load_config


def _serve_app(config: GatewayConfig, log_level: str) -> None:
    import uvicorn

    from gateway.api.app import create_app

    uvicorn.run(
        create_app(config),
        host=config.listen.host,
        port=config.listen.port,
        log_level=log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
        lifespan="on",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentgw", description="Agentic OpenAI-compatible gateway for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="YAML config file (default: embedded local engines)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    overrides: dict[str, object] = {}
    if args.host or args.port is not None:
        overrides["listen"] = {
            "host": args.host or "127.0.0.1",
            "port": args.port if args.port is not None else 8000,
        }
    try:
        config = load_config(args.config, **overrides)
    except ConfigError as exc:
        print(f"agentgw: {exc}", file=sys.stderr)
        return 2
    if not config.pools:
        print(
            "agentgw: no pools configured (the embedded default arrives with gateway.local)", file=sys.stderr
        )
        return 2
    _serve_app(config, args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
