"""The served routes equal the contract in openapi/agentgw.yaml; config errors name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.api.app import HOT_ROUTES, create_app
from gateway.config import ConfigError, load_config

SPEC = Path(__file__).resolve().parents[2] / "openapi" / "agentgw.yaml"
CFG = {
    "pools": [
        {"name": "p", "role": "any", "engines": [{"name": "e", "url": "http://127.0.0.1:9", "model": "m"}]}
    ]
}


def test_served_routes_match_the_contract() -> None:
    app = create_app(load_config(None, **CFG))
    served = {(p, "post") for p in HOT_ROUTES}
    for path, item in app.api.openapi()["paths"].items():
        served |= {(path, m) for m in item}
    spec = yaml.safe_load(SPEC.read_text())
    documented = {
        (p, m) for p, item in spec["paths"].items() for m in item if m in ("get", "post", "delete", "put")
    }
    assert served == documented


def test_hint_schema_bounds_match_the_parser() -> None:
    from gateway.core.hints import _RANGES, MAX_ID_LEN

    props = yaml.safe_load(SPEC.read_text())["components"]["schemas"]["AgentHints"]["properties"]
    assert props["session_id"]["maxLength"] == MAX_ID_LEN
    for key in ("turn_index", "expected_tool_latency_ms", "fan_out", "priority", "kv_retention_ttl_s"):
        assert (props[key]["minimum"], props[key]["maximum"]) == _RANGES[key], key


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            {
                "pools": [
                    {"name": "p", "role": "boss", "engines": [{"name": "e", "url": "http://x", "model": "m"}]}
                ]
            },
            "pools.0.role",
        ),
        (
            {"pools": [{"name": "p", "engines": [{"name": "e", "url": "ftp://x", "model": "m"}]}]},
            "pools.0.engines.0.url",
        ),
        ({"pools": [{"name": "p", "engines": []}]}, "pools.0.engines"),
        ({"listen": {"port": 70000}}, "listen.port"),
        ({"routing": {"profile": "magic"}}, "routing.profile"),
        ({"limits": {"max_body_bytes": 0}}, "limits.max_body_bytes"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_config_names_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, **overrides)


def test_yaml_file_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(CFG))
    monkeypatch.setenv("AGENTGW_LISTEN__PORT", "9123")
    c = load_config(f)
    assert c.listen.port == 9123 and c.pools[0].engines[0].name == "e"
    f.write_text("pools: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
