"""Every engine_ext module imports against the installed vLLM (no engine): the offload spec,
tiers and plugin are loaded by name from `--kv-transfer-config` and the plugin entry point, so a
vLLM internal that moved would otherwise show only when an engine starts."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import engine_ext

MODULES = sorted(m.name for m in pkgutil.walk_packages(engine_ext.__path__, "engine_ext."))


def test_every_module_is_listed() -> None:
    assert {
        "engine_ext.spec",
        "engine_ext.scheduler",
        "engine_ext.tiers.mooncake",
        "engine_ext.plugin",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_the_names_vllm_loads_resolve() -> None:
    """What the engines' `--kv-transfer-config` (spec, cache policy, tier) and `--scheduler-cls`
    name, resolved as vLLM resolves them: a module path and a name in it."""
    from engine_ext import config
    from engine_ext.scheduler import AsyncPinningScheduler, PinningScheduler
    from engine_ext.spec import _DEFAULTS

    extra = config.kv_transfer_config(1 << 20, mooncake_master="m:1", mooncake_metadata="p2p")[
        "kv_connector_extra_config"
    ]
    tier = extra["secondary_tiers"][0]
    for module, name in (
        (extra["spec_module_path"], extra["spec_name"]),
        (_DEFAULTS["cache_policy_module_path"], _DEFAULTS["eviction_policy"]),
        (tier["module_path"], tier["type"]),
    ):
        assert isinstance(getattr(importlib.import_module(module), name), type), (module, name)
    assert issubclass(AsyncPinningScheduler, PinningScheduler)
