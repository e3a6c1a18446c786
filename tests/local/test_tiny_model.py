"""The tiny model builder: byte-for-byte determinism, idempotence, and a tokenizer and chat template
that transformers (and so vLLM) load and render."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.local import tiny_model
from gateway.local.tiny_model import (
    ARCHS,
    MARKER_NAME,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_tiny_model,
    chat_template,
)

REPO = Path(__file__).resolve().parents[2]


def digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_two_builds_give_identical_bytes(arch: str, built: dict[str, Path], tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / arch, arch)
    assert digests(again) == digests(built[arch])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        digests(again)
    )


def test_a_build_in_another_process_with_another_hash_seed_is_identical(
    built: dict[str, Path], tmp_path: Path
) -> None:
    code = "import sys; from pathlib import Path; from gateway.local.tiny_model import build_tiny_model as b; b(Path(sys.argv[1]), 'llama')"
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "llama")], cwd=REPO, env=env, check=True)
    assert digests(tmp_path / "llama") == digests(built["llama"])


def test_a_complete_build_is_not_rebuilt(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "llama")
    (model / "config.json").write_text("{}")  # a complete build is trusted as is
    build_tiny_model(model, "llama")
    assert (model / "config.json").read_text() == "{}"


def test_a_half_built_folder_is_rebuilt(built: dict[str, Path], tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "llama")
    (model / MARKER_NAME).unlink()
    (model / "model.safetensors").write_bytes(b"truncated")
    build_tiny_model(model, "llama")
    assert digests(model) == digests(built["llama"])


def test_a_build_from_another_recipe_is_rebuilt(
    built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_model(tmp_path / "m", "llama")
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(tiny_model, "RECIPE_VERSION", tiny_model.RECIPE_VERSION + 1)
    build_tiny_model(model, "llama")
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_model(tmp_path, "gpt2")


def test_cli_builds_the_folder(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.local.tiny_model", "--arch", "gemma3", "--out", str(tmp_path / "g")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tiny-gemma3" in out.stdout
    assert (tmp_path / "g" / MARKER_NAME).is_file()


def test_gateway_local_imports_without_torch_or_transformers() -> None:
    code = (
        "import sys, gateway.local.tiny_model, gateway.local.engines; "
        "bad = [m for m in ('torch', 'transformers', 'safetensors', 'vllm') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_have_the_configured_shapes(arch: str, built: dict[str, Path]) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built[arch])
    with safe_open(built[arch] / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [VOCAB_SIZE, config.hidden_size]
        assert str(embed.get_dtype()) == ("F32" if arch == "llama_ctx" else "BF16")
    assert config.vocab_size == VOCAB_SIZE
    assert config.max_position_embeddings >= 65536
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert layers == set(range(config.num_hidden_layers))


def test_gemma3_mixes_sliding_and_full_layers(built: dict[str, Path]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built["gemma3"])
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window == tiny_model.GEMMA3_SLIDING_WINDOW


def test_qwen3_next_uses_128_wide_linear_heads(built: dict[str, Path]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(built["qwen3_next"])
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert config.linear_key_head_dim == config.linear_value_head_dim == 128


@pytest.fixture(scope="module")
def tokenizer(built: dict[str, Path]):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built["llama"])


@pytest.mark.parametrize(
    "text",
    [
        "The keeper climbed the stairs.",
        "def f(x: int) -> int:\n    return x ** 2  # squared\n",
        "ünïcödé, 日本語, emoji 🙂 and\ttabs",
        "",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_has_the_full_vocab_and_special_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>"
    # No BOS or other token is added: the rendered template is the whole prompt.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_chat_template_renders_roles_parts_tools_and_generation_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Harbour."}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"at": "harbour"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "11 C"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        '<|im_start|>system\n# Tools\n{"type": "function", "function": {"name": "get_weather"}}\n<|im_end|>\n'
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather?\nHarbour.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"at": "harbour"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n11 C<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert without.endswith("Harbour.<|im_end|>\n")


def test_list_content_renders_like_vllms_flattened_string(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # vLLM joins text parts with "\n" for string-format templates; the template does the same.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    flat = [{"role": "user", "content": "a\nb"}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == tokenizer.apply_chat_template(
        flat, tokenize=False
    )


def test_the_shipped_template_is_the_one_in_the_model(built: dict[str, Path]) -> None:
    config = json.loads((built["llama"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == chat_template()


def test_vllms_hermes_parser_reads_back_the_tool_calls_the_template_renders(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The engines run with `--tool-call-parser hermes` (gateway.local.engines): what the model is
    # taught to emit for a tool call (the template's assistant turn) must be what that parser reads.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from gateway.local.engines import DEFAULT_TOOL_CALL_PARSER

    assert DEFAULT_TOOL_CALL_PARSER == "hermes"
    calls = [
        {"name": "read_file", "arguments": {"path": "src/main.py", "lines": [1, 20]}},
        {"name": "bash", "arguments": {"command": "ls -la"}},
    ]
    messages = [
        {"role": "user", "content": "Look around."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for i, c in enumerate(calls)
            ],
        },
    ]
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert full.startswith(prompt)
    output = full[len(prompt) :].removesuffix("<|im_end|>\n")  # the assistant's generated text
    tools = [
        {"type": "function", "function": {"name": c["name"], "parameters": {"type": "object"}}} for c in calls
    ]
    request = ChatCompletionRequest(
        model="tiny-llama", messages=messages[:1], tools=tools, tool_choice="auto"
    )
    parsed = Hermes2ProToolParser(tokenizer).extract_tool_calls(output, request)
    assert parsed.tools_called and parsed.content == "Checking.\n"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in parsed.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_the_context_dependent_llama_is_the_llama_in_float32_with_wider_weights(
    built: dict[str, Path],
) -> None:
    from safetensors.torch import load_file

    ctx = load_file(str(built["llama_ctx"] / "model.safetensors"))
    plain = load_file(str(built["llama"] / "model.safetensors"))
    assert ctx.keys() == plain.keys()
    q = ctx["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype.is_floating_point and q.element_size() == 4
    # drawn CTX_INIT_STD wide: attention mixes the context instead of echoing the last token
    assert 0.13 < float(q.std()) < 0.17
    assert 0.015 < float(plain["model.layers.0.self_attn.q_proj.weight"].float().std()) < 0.025
