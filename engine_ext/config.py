"""Build the ``--kv-transfer-config`` that loads engine_ext into a vLLM 0.32 engine.

``OffloadingConnector`` (vLLM's own) with our ``AgentOffloadingSpec``: a host tier of
``cpu_bytes`` and, with a Mooncake master, a Mooncake secondary tier; the control API on
``control_port`` when given. See docs/engine_ext.md.

The control API's bearer token never travels in the config: ``--kv-transfer-config`` is in the
engine's process arguments, which any local user reads from ``/proc/<pid>/cmdline``. The engine
finds it in its environment (:data:`CONTROL_TOKEN_ENV`, :func:`control_env`; ``/proc/<pid>/environ``
is readable by the engine's user only) or in a file readable by its user only
(``control_token_file``, mode 0600 or stricter): :func:`control_token`.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONTROL_TOKEN_ENV = "AGENTGW_CONTROL_TOKEN"
"""The environment variable that holds the control API's bearer token."""


def _checked(token: str) -> str:
    if not token or token != token.strip():
        raise ValueError("control_token must be set (non-empty, no surrounding spaces)")
    return token


def control_env(token: str) -> dict[str, str]:
    """The environment entry that gives an engine its control API's bearer token (merge it into
    the engine's environment; never put the token in its arguments)."""
    return {CONTROL_TOKEN_ENV: _checked(token)}


def write_token_file(path: Path, token: str) -> Path:
    """Write ``token`` to ``path`` readable and writable by this user only (0600), for an
    engine's ``control_token_file``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, _checked(token).encode())
    finally:
        os.close(fd)
    return path


def control_token(extra: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """The control API's bearer token, in this order: the file ``control_token_file`` (refused
    when its group or others may read or write it), the environment's :data:`CONTROL_TOKEN_ENV`,
    then a ``control_token`` in the config itself (accepted with a warning: the process
    arguments show it to every local user). Raises ValueError when none is set."""
    path = extra.get("control_token_file")
    if path:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"control_token_file {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): "
                "chmod 600 it"
            )
        return _checked(Path(path).read_text(encoding="utf-8").strip())
    token = environ.get(CONTROL_TOKEN_ENV)
    if token:
        return _checked(token)
    legacy = extra.get("control_token")
    if legacy:
        logger.warning(
            "engine_ext: control_token in --kv-transfer-config is visible to every local user "
            "(/proc/<pid>/cmdline); set %s in the engine's environment or control_token_file instead",
            CONTROL_TOKEN_ENV,
        )
        return _checked(str(legacy))
    raise ValueError(
        f"control_port needs a control_token: set {CONTROL_TOKEN_ENV} in the engine's environment "
        "or control_token_file (mode 600)"
    )


def kv_transfer_config(
    cpu_bytes: int,
    *,
    control_port: int | None = None,
    control_token_file: str | Path | None = None,
    engine_url: str | None = None,
    mooncake_master: str | None = None,
    mooncake_metadata: str | None = None,
    retention: dict[str, Any] | None = None,
    mooncake_segment_bytes: int | None = None,
) -> dict[str, Any]:
    """``mooncake_segment_bytes``: the memory this engine lends the Mooncake store (the client's
    global segment; the tier's default when None). 0 makes the engine a pure client, so its
    objects live on store nodes and survive the engine (see docs/engine_ext.md).

    With ``control_port``, the engine reads the control API's token from ``control_token_file``
    when given, else from its environment (:func:`control_env`)."""
    extra: dict[str, Any] = {
        "spec_name": "AgentOffloadingSpec",
        "spec_module_path": "engine_ext.spec",
        "cpu_bytes_to_use": cpu_bytes,
    }
    if control_port is not None:
        extra["control_port"] = control_port
        if control_token_file is not None:
            extra["control_token_file"] = str(control_token_file)
    if engine_url is not None:
        extra["engine_url"] = engine_url
    if mooncake_master is not None:
        tier: dict[str, Any] = {
            "type": "MooncakeTier",
            "module_path": "engine_ext.tiers.mooncake",
            "master_address": mooncake_master,
            "metadata_server": mooncake_metadata,
        }
        if retention is not None:
            tier["retention"] = retention
        if mooncake_segment_bytes is not None:
            tier["global_segment_size"] = mooncake_segment_bytes
        extra["secondary_tiers"] = [tier]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
