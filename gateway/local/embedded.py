"""The embedded default: a tiny local model, local vLLM engines with engine_ext, and a config
that fronts them.

``agentgw serve`` with no config builds the tiny model if it is missing and starts the engines of
a :class:`~gateway.local.layout.LocalLayout` (default: :data:`~gateway.local.layout.DEFAULT`, what
``agentgw plan`` recommends for 3 engines; prefix caching, ``--enforce-eager``, KV events on ZMQ,
a small KV cache), waits until they are healthy and returns the gateway config for them (its
pools as the layout says) in a :class:`LocalStack`, which the caller stops on exit
(:func:`plan_local_stack` leaves the engines to start, so ``agentgw serve`` listens meanwhile).

The whole stack by default (``store="host"``): every engine loads engine_ext
(docs/engine_ext.md): vLLM's offload connector with engine_ext's host tier, the pinning scheduler
(device soft pins), and the control API on loopback behind a token generated here, which the
gateway's config is given (``migration.control_token``) with each engine's ``control_url``; so
the gateway pins a session's KV through its tool gaps and the planner can demote and move it.
``store="mooncake"`` starts a local ``mooncake_master`` and adds the shared Mooncake tier;
``store="none"`` starts plain vLLM engines. ``sessions="redis"`` starts a local ``redis-server``
(no persistence) and keeps the sessions there.

Each engine serves the tiny model under two names: its own (``tiny-llama``) and
:data:`~gateway.local.agent_script.AGENT_MODEL` (``tiny-agent``), with the scripted decoder loaded
(``gateway/local/scripted_decoder.py``): a request whose prompt holds an agent script gets the
script's next step (a tool call, or the answer), so a real harness runs a real agent loop; any
other request gets the random model's tokens, whichever name it used.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine_ext.config import control_env, kv_transfer_config
from gateway.local.agent_script import AGENT_MODEL, SCRIPTED_DECODER
from gateway.local.engines import HASH_SEED, EngineSpec, LocalEngine, free_ports, start_engines, stop_engines
from gateway.local.layout import DEFAULT, LocalLayout
from gateway.local.mooncake import MooncakeMaster
from gateway.local.redis_server import LocalRedis
from gateway.local.tiny_model import SERVE_ARGS, SERVED_MODEL_NAMES, build_tiny_model

__all__ = [
    "DEFAULT_HOME",
    "SERVED_NAMES",
    "STORES",
    "LocalStack",
    "config_for",
    "plan_local_stack",
    "start_local_stack",
    "stop_all",
]

DEFAULT_HOME = Path(os.environ.get("AGENTGW_HOME", Path.home() / ".cache" / "agentgw"))
SERVED_NAMES = {"llama": "tiny-llama", "gemma3": "tiny-gemma3", "qwen3_next": "tiny-qwen3-next"}
Store = Literal["none", "host", "mooncake"]
Sessions = Literal["memory", "redis"]
STORES: tuple[Store, ...] = ("none", "host", "mooncake")
SESSIONS: tuple[Sessions, ...] = ("memory", "redis")
HOST_CACHE_MIB = 512
"""engine_ext's host tier per engine: a ``/dev/shm`` region, resident as it fills (all of it once
the engine has served enough), so it is kept small; the device KV cache is 1 GiB."""
DEFAULT_MAX_MODEL_LEN = 131072
"""The tiny model's whole window: a scripted Claude Code session (an 18K-token first prompt that
grows with every tool result) never meets it, and Claude Code does not compact against a window
it does not know."""


@dataclass
class LocalStack:
    """What :func:`start_local_stack` started; :meth:`stop` stops it all."""

    engines: list[LocalEngine]
    config: dict[str, Any]
    """The gateway config (as a dict) that fronts them: pools, models, migration, sessions."""
    mooncake: MooncakeMaster | None = None
    redis: LocalRedis | None = None
    specs: list[EngineSpec] = field(default_factory=list)

    def stop(self) -> None:
        stop_all(self.engines)  # first: a Mooncake client unmounts its segment on the way out
        if self.mooncake is not None:
            self.mooncake.stop()
        if self.redis is not None:
            self.redis.stop()


def plan_local_stack(
    layout: LocalLayout = DEFAULT,
    *,
    store: Store = "host",
    sessions: Sessions = "memory",
    arch: str = "llama",
    home: Path = DEFAULT_HOME,
    kv_cache_gib: int = 1,
    host_cache_mib: int = HOST_CACHE_MIB,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    extra_args: tuple[str, ...] = (),
    model_dir: Path | None = None,
    speculative: Mapping[str, Any] | None = None,
) -> LocalStack:
    """Build the tiny model if it is missing, start the side servers the stack asks for
    (``redis-server``, ``mooncake_master``: about a second each), choose the engines' ports and
    token: the stack with its engines not started yet (``agentgw serve`` listens while they start)
    and the gateway config that fronts them. Stops what it started if a part fails.

    ``model_dir``: where the tiny model is built (default: under ``home``). Raises
    FileNotFoundError, naming the install command, when ``mooncake_master`` or ``redis-server``
    is asked for and missing.

    ``speculative``: vLLM's ``--speculative-config`` for every engine (speculative decoding);
    ``draft_model`` without a ``model`` drafts with the tiny model itself (see
    :func:`speculative_config`). The Llama is then its context-dependent float32 variant
    (``llama_ctx``, still served as ``tiny-llama``), whose greedy drafts are accepted only while
    the drafter's KV is intact. vLLM refuses custom logits processors beside speculative
    decoding, so the engines then load no scripted decoder and do not serve ``tiny-agent``."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")
    if sessions not in SESSIONS:
        raise ValueError(f"sessions must be one of {SESSIONS}, got {sessions!r}")
    build = arch
    if speculative is not None and arch == "llama":
        # the random tiny Llama accepts any drafter's greedy drafts; its context-dependent float32
        # variant accepts them only while the drafter's KV is right (served under the same name)
        build = "llama_ctx"
        extra_args = (*extra_args, *SERVE_ARGS[build])
    model_dir = build_tiny_model(model_dir or home / "models" / SERVED_MODEL_NAMES[build], build)
    if speculative is not None:
        extra_args = (
            *extra_args,
            "--speculative-config",
            json.dumps(speculative_config(speculative, model_dir)),
        )
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(engines=[], config={})
    try:
        if sessions == "redis":
            stack.redis = LocalRedis(logs / "redis.log").start()
        if store == "mooncake":
            stack.mooncake = MooncakeMaster(logs / "mooncake_master.log").start()
        token = secrets.token_urlsafe(32) if store != "none" else None
        ports = free_ports(3 * layout.engines)
        for i, name in enumerate(layout.names):
            port, events, control = ports[3 * i : 3 * i + 3]
            ext_args: tuple[str, ...] = ()
            env: dict[str, str] = {}
            if token is not None:
                kv = kv_transfer_config(
                    host_cache_mib << 20,
                    control_port=control,
                    engine_url=f"http://127.0.0.1:{port}",
                    mooncake_master=stack.mooncake.master_address if stack.mooncake else None,
                    mooncake_metadata=stack.mooncake.metadata_server if stack.mooncake else None,
                )
                ext_args = ("--kv-transfer-config", json.dumps(kv))
                # the token through the environment, never the arguments (/proc/<pid>/cmdline)
                env = {**(MooncakeMaster.client_env if stack.mooncake else {}), **control_env(token)}
            stack.specs.append(
                EngineSpec(
                    name=name,
                    model_dir=model_dir,
                    served_model_name=SERVED_NAMES[arch],
                    # vLLM refuses custom logits processors beside speculative decoding
                    served_aliases=(AGENT_MODEL,) if speculative is None else (),
                    logits_processors=(SCRIPTED_DECODER,) if speculative is None else (),
                    port=port,
                    kv_events_port=events,
                    log_path=logs / f"{name}.log",
                    kv_cache_gib=kv_cache_gib,
                    max_model_len=max_model_len,
                    extra_args=(*ext_args, *extra_args),
                    extra_env=env,
                )
            )
        stack.engines = [LocalEngine(spec) for spec in stack.specs]
        controls = [ports[3 * i + 2] for i in range(layout.engines)] if token is not None else None
        stack.config = config_for(stack.specs, model_dir, layout, controls)
        if token is not None:
            stack.config["migration"] = {"control_token": token}
        if stack.redis is not None:
            stack.config["sessions"] = {"backend": "redis", "redis_url": stack.redis.url}
    except BaseException:
        with contextlib.suppress(Exception):
            stack.stop()
        raise
    return stack


def start_local_stack(layout: LocalLayout = DEFAULT, *, timeout_s: float = 240.0, **kw: Any) -> LocalStack:
    """:func:`plan_local_stack`, then start the engines and wait until all are ready (stopping the
    whole stack if one fails)."""
    stack = plan_local_stack(layout, **kw)
    try:
        stack.engines = start_engines(stack.specs, timeout_s=timeout_s)
    except BaseException:
        with contextlib.suppress(Exception):
            stack.stop()
        raise
    return stack


def config_for(
    specs: list[EngineSpec], model_dir: Path, layout: LocalLayout, control_ports: list[int] | None = None
) -> dict[str, Any]:
    """``pools`` and ``models`` for the engines of ``specs`` (one per layout engine, in order),
    with each engine's ``control_url`` when ``control_ports`` are given."""

    def engine(i: int, s: EngineSpec) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": s.name,
            "url": s.url,
            "model": s.served_model_name,
            "kv_events": s.kv_events_endpoint,
        }
        if s.served_aliases:
            out["aliases"] = list(s.served_aliases)
        if control_ports is not None:
            out["control_url"] = f"http://127.0.0.1:{control_ports[i]}"
        return out

    pools = layout.pools([engine(i, s) for i, s in enumerate(specs)])
    names = [specs[0].served_model_name, *specs[0].served_aliases]
    models = [
        {"name": n, "tokenizer": str(model_dir), "block_size": 128, "hash_seed": HASH_SEED} for n in names
    ]
    return {"pools": pools, "models": models}


def speculative_config(config: Mapping[str, Any], model_dir: Path) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for the tiny model's engines: as given, except that a
    ``draft_model`` without a ``model`` drafts with the served model itself (the tiny model is its
    own drafter)."""
    out = dict(config)
    if out.get("method") == "draft_model" and not out.get("model"):
        out["model"] = str(model_dir)
    return out


def stop_all(engines: list[LocalEngine]) -> None:
    stop_engines(engines)
