"""The local engine layout (gateway/local/layout.py): ``agentgw serve``'s flags, the pools it
configures, and docker-compose.yml / deploy/launch.py running the same default engines."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gateway.cli import layout_routing, main
from gateway.config import load_config
from gateway.local.embedded import plan_local_stack, speculative_config
from gateway.local.engines import engine_command
from gateway.local.layout import DEFAULT, LayoutError, LocalLayout, resolve

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("flags", "layout"),
    [
        ({}, DEFAULT),
        ({"first_turn": 1, "warm": 2}, LocalLayout(3, 1, DEFAULT.split, DEFAULT.role_controller)),
        ({"first_turn": 0, "warm": 1}, LocalLayout(1, 0)),
        ({"engines": 5}, LocalLayout(5, DEFAULT.first_turn, DEFAULT.split, DEFAULT.role_controller)),
        ({"engines": 4, "first_turn": 2}, LocalLayout(4, 2, DEFAULT.split, DEFAULT.role_controller)),
        (
            {"engines": 3, "first_turn": 1, "warm": 2},
            LocalLayout(3, 1, DEFAULT.split, DEFAULT.role_controller),
        ),
    ],
)
def test_flags_resolve_to_a_layout(flags: dict[str, int], layout: LocalLayout) -> None:
    assert resolve(**flags) == layout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"engines": 3, "first_turn": 1, "warm": 1}, "--engines 3 disagrees with --first-turn 1 + --warm 1"),
        ({"engines": 3, "first_turn": 3}, "first-turn engines must be 0 .. engines - 1"),
        ({"engines": 0}, "at least one engine"),
        ({"first_turn": -1}, "--first-turn must be >= 0"),
        ({"warm": -2}, "--warm must be >= 0"),
    ],
)
def test_bad_flags_are_refused(flags: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("+", r"\+").replace(".", r"\.")):
        resolve(**flags)


def members(layout: LocalLayout) -> list[dict[str, Any]]:
    return [
        {"name": n, "url": f"http://127.0.0.1:{9000 + i}", "model": "m"} for i, n in enumerate(layout.names)
    ]


def test_pools_of_one_pool_and_of_a_split() -> None:
    one = LocalLayout(3)
    assert one.names == ["engine0", "engine1", "engine2"]
    assert [(p["name"], p["role"], [e["name"] for e in p["engines"]]) for p in one.pools(members(one))] == [
        ("default", "any", ["engine0", "engine1", "engine2"])
    ]
    assert one.label == "one pool" and one.routing() == {}
    split = LocalLayout(3, 1, "cost", True)
    assert [(p["role"], [e["name"] for e in p["engines"]]) for p in split.pools(members(split))] == [
        ("first_turn", ["engine0"]),
        ("warm", ["engine1", "engine2"]),
    ]
    assert [split.role(n) for n in split.names] == ["first_turn", "warm", "warm"]
    assert split.label == "1+2 cost+ctl"
    assert split.routing() == {"split": "cost", "role_controller": True}
    assert split.serve_command() == (
        "AGENTGW_ROUTING__SPLIT=cost AGENTGW_ROUTING__ROLE_CONTROLLER=true agentgw serve --engines 3 --first-turn 1"
    )
    cfg = load_config(None, pools=split.pools(members(split)), **layout_routing(split, load_config(None)))
    assert [p.role for p in cfg.pools] == ["first_turn", "warm"] and cfg.routing.role_controller is True


def test_the_layout_routing_yields_to_the_config(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("routing: {profile: cache_aware, split: wall}\n")
    mine = load_config(path)
    routing = layout_routing(LocalLayout(3, 1, "cost", True), mine)["routing"]
    assert (routing["profile"], routing["split"], routing["role_controller"]) == ("cache_aware", "wall", True)
    assert layout_routing(LocalLayout(3), mine) == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--engines", "2", "--first-turn", "2"], "first-turn engines must be 0 .. engines - 1"),
        (["serve", "--engine", "http://127.0.0.1:1", "--warm", "2"], "start local engines: not with pools"),
        (
            ["serve", "--engine", "http://127.0.0.1:1", "--speculative-config", '{"method": "ngram"}'],
            "start local engines: not with pools",
        ),
    ],
)
def test_serve_refuses_a_bad_layout_before_starting_anything(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def launch_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("agentgw_launch", ROOT / "deploy" / "launch.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    return data


def default_of(value: str) -> str:
    """``${VAR:-x}`` -> ``x`` (what compose uses when VAR is unset)."""
    return value.split(":-", 1)[1].rstrip("}") if value.startswith("${") else value


def test_compose_runs_the_default_layouts_engines() -> None:
    data = compose()
    env = data["x-layout"]
    assert default_of(env["ENGINES"]) == str(DEFAULT.engines)
    assert default_of(env["FIRST_TURN_ENGINES"]) == str(DEFAULT.first_turn)
    for profile, prefix in (("cpu", ""), ("gpu", "gpu-")):
        engines = {
            name: s["command"][1]
            for name, s in data["services"].items()
            if s.get("command", [None])[0] == "engine" and profile in s.get("profiles", [])
        }
        assert engines == {f"{prefix}{n}": n for n in DEFAULT.names}, profile


@pytest.mark.parametrize("first_turn", [None, "1"])
def test_launch_writes_the_pools_of_the_layout(
    monkeypatch: pytest.MonkeyPatch, first_turn: str | None
) -> None:
    for key, value in compose()["x-layout"].items():
        monkeypatch.setenv(key, default_of(value))
    monkeypatch.delenv("WARM_ENGINES", raising=False)
    if first_turn is not None:
        monkeypatch.setenv("FIRST_TURN_ENGINES", first_turn)
    launch = launch_module().Layout.from_env()
    expected = resolve(first_turn=None if first_turn is None else int(first_turn))
    assert launch.engine_names == expected.names
    pools = launch.gateway_config()["pools"]
    assert [(p["role"], [e["name"] for e in p["engines"]]) for p in pools] == [
        (p["role"], [e["name"] for e in p["engines"]]) for p in expected.pools(members(expected))
    ]
    assert launch.engine_port(expected.names[-1]) == launch.engine_port_base + expected.engines - 1


@pytest.mark.parametrize(
    ("value", "message"),
    [("{method: ngram", "--speculative-config: not JSON"), ("[1]", "must be a JSON object")],
)
def test_serve_refuses_a_speculative_config_that_is_not_a_json_object(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--speculative-config", value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_every_local_engine_gets_the_speculative_config_and_a_draft_model_defaults_to_the_tiny_model(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    spec = {"method": "draft_model", "num_speculative_tokens": 3}
    stack = plan_local_stack(LocalLayout(2), store="none", home=tmp_path, model_dir=model, speculative=spec)
    # the context-dependent float32 Llama, served under the usual name
    assert json.loads((model / "config.json").read_text())["dtype"] == "float32"
    for s in stack.specs:
        cmd = engine_command(s)
        given = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert given == {**spec, "model": str(model)}
        assert cmd[cmd.index("--dtype") + 1] == "float32"
        assert s.served_model_name == "tiny-llama"
    other = {"method": "draft_model", "model": "/elsewhere", "num_speculative_tokens": 2}
    assert speculative_config(other, model) == other
    assert speculative_config({"method": "ngram"}, model) == {"method": "ngram"}
