"""Tiny, deterministic Hugging Face model folders that vLLM serves on CPU.

`build_tiny_model(out_dir, arch)` writes a model folder with random weights (fixed seed, bf16
safetensors), a hand-written `config.json`, and a byte-level BPE tokenizer trained on the corpus
shipped in `gateway/local/corpus/` with the ChatML-style template in `gateway/local/templates/`.
Building twice gives identical bytes; a marker file holding the recipe's fingerprint is written
last, so a half-built folder (or one built from an older recipe) is rebuilt.

Architectures (served names in `SERVED_MODEL_NAMES`):

- `llama`: hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, tied embeddings.
- `gemma3`: the same sizes, 4 layers (3 sliding-window layers of `GEMMA3_SLIDING_WINDOW` tokens,
  then 1 full-attention layer); vLLM's hybrid KV manager makes 4 cache groups of it.
- `qwen3_next`: 1 gated-delta-net (linear attention) layer and 1 full-attention layer, each with a
  4-expert MoE MLP. Linear key/value head dims are 128: vLLM's CPU GDN kernel fails with 32.
  vLLM sizes its blocks to 384 tokens (attention page >= linear-state page) and, in its "align"
  prefix-cache mode, keeps the linear state only where a prefill chunk ends on a block boundary:
  serve it with `SERVE_ARGS["qwen3_next"]` (chunks of one block) for hits of
  floor((prompt_tokens - 1) / 384) * 384 tokens on a repeated prompt; with vLLM's default chunk
  size, whether a repeated prompt hits depends on its length.
- `llama_ctx`: the `llama` shapes in float32 with weights drawn `CTX_INIT_STD` wide. At the
  usual 0.02 the residual stream is the last token's embedding and greedy decoding repeats one
  token whatever came before; at 0.15 attention mixes the whole context, so the greedy output
  depends on every earlier token's KV. A drafter's acceptance then depends on its KV too (the
  speculative-decoding tests draft with this model itself). Serve it with
  `SERVE_ARGS["llama_ctx"]` (`--dtype float32`: in bf16 near-ties flip greedy choices).

torch and safetensors are imported inside functions: `gateway` imports without them.

CLI: `python -m gateway.local.tiny_model --arch llama|gemma3|qwen3_next --out DIR`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHS",
    "GEMMA3_SLIDING_WINDOW",
    "MAX_POSITION_EMBEDDINGS",
    "SERVED_MODEL_NAMES",
    "SERVE_ARGS",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_tiny_model",
    "chat_template",
    "main",
]

ARCHS = ("llama", "gemma3", "qwen3_next", "llama_ctx")
SERVED_MODEL_NAMES = {
    "llama": "tiny-llama",
    "gemma3": "tiny-gemma3",
    "qwen3_next": "tiny-qwen3-next",
    "llama_ctx": "tiny-llama-ctx",
}

# Extra vLLM arguments each model needs for dependable prefix-cache hits (see the docstring).
SERVE_ARGS: dict[str, tuple[str, ...]] = {
    "llama": (),
    "gemma3": (),
    "qwen3_next": ("--max-num-batched-tokens", "384"),
    "llama_ctx": ("--dtype", "float32"),
}

VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 131072  # room for 64K-token prompts plus output
GEMMA3_SLIDING_WINDOW = 256
SEED = 0
INIT_STD = 0.02
CTX_INIT_STD = 0.15

EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
_TOKEN_IDS = {token: i for i, token in enumerate(SPECIAL_TOKENS)}

# Bump when the recipe changes in a way the fingerprint below cannot see (e.g. the weight init).
RECIPE_VERSION = 1
MARKER_NAME = ".tiny-model-complete"

_HERE = Path(__file__).resolve().parent
CORPUS_DIR = _HERE / "corpus"
TEMPLATE_PATH = _HERE / "templates" / "chatml.jinja"

_HIDDEN = 128
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 32
_INTERMEDIATE = 256


def chat_template() -> str:
    """The ChatML-style Jinja chat template shipped with the tiny models."""
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def _corpus_files() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.txt"))


# ---------------------------------------------------------------------------------------------
# config.json


def _common_config() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": _HIDDEN,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "intermediate_size": _INTERMEDIATE,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "bos_token_id": _TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": _TOKEN_IDS[EOS_TOKEN],
        "pad_token_id": _TOKEN_IDS["<|endoftext|>"],
        "dtype": "bfloat16",
        "use_cache": True,
    }


def model_config(arch: str) -> dict[str, Any]:
    """The `config.json` contents for `arch` (hand-written, independent of the transformers version)."""
    config = _common_config()
    if arch == "llama_ctx":
        return model_config("llama") | {"dtype": "float32", "initializer_range": CTX_INIT_STD}
    if arch == "llama":
        config |= {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_act": "silu",
            "mlp_bias": False,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": True,
        }
    elif arch == "gemma3":
        config |= {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "sliding_window": GEMMA3_SLIDING_WINDOW,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _HEAD_DIM,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
        }
    elif arch == "qwen3_next":
        config |= {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "full_attention_interval": 2,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "partial_rotary_factor": 0.25,
            "linear_conv_kernel_dim": 4,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 1,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        }
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------
# Weights: (name, shape, init) in checkpoint order; init is "normal", "ones" or "zeros".

_Tensor = tuple[str, tuple[int, ...], str]


def _attention(prefix: str, *, q_out: int, norms: str | None) -> Iterator[_Tensor]:
    yield f"{prefix}.q_proj.weight", (q_out, _HIDDEN), "normal"
    yield f"{prefix}.k_proj.weight", (_KV_HEADS * _HEAD_DIM, _HIDDEN), "normal"
    yield f"{prefix}.v_proj.weight", (_KV_HEADS * _HEAD_DIM, _HIDDEN), "normal"
    yield f"{prefix}.o_proj.weight", (_HIDDEN, _HEADS * _HEAD_DIM), "normal"
    if norms is not None:
        yield f"{prefix}.q_norm.weight", (_HEAD_DIM,), norms
        yield f"{prefix}.k_norm.weight", (_HEAD_DIM,), norms


def _mlp(prefix: str, intermediate: int) -> Iterator[_Tensor]:
    yield f"{prefix}.gate_proj.weight", (intermediate, _HIDDEN), "normal"
    yield f"{prefix}.up_proj.weight", (intermediate, _HIDDEN), "normal"
    yield f"{prefix}.down_proj.weight", (_HIDDEN, intermediate), "normal"


def _llama_tensors(config: dict[str, Any]) -> Iterator[_Tensor]:
    yield "model.embed_tokens.weight", (VOCAB_SIZE, _HIDDEN), "normal"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _attention(f"{p}.self_attn", q_out=_HEADS * _HEAD_DIM, norms=None)
        yield from _mlp(f"{p}.mlp", _INTERMEDIATE)
        yield f"{p}.input_layernorm.weight", (_HIDDEN,), "ones"
        yield f"{p}.post_attention_layernorm.weight", (_HIDDEN,), "ones"
    yield "model.norm.weight", (_HIDDEN,), "ones"


def _gemma3_tensors(config: dict[str, Any]) -> Iterator[_Tensor]:
    # Gemma norms scale by (1 + weight): zeros are the identity.
    yield "model.embed_tokens.weight", (VOCAB_SIZE, _HIDDEN), "normal"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _attention(f"{p}.self_attn", q_out=_HEADS * _HEAD_DIM, norms="zeros")
        yield from _mlp(f"{p}.mlp", _INTERMEDIATE)
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            yield f"{p}.{norm}_layernorm.weight", (_HIDDEN,), "zeros"
    yield "model.norm.weight", (_HIDDEN,), "zeros"


def _qwen3_next_tensors(config: dict[str, Any]) -> Iterator[_Tensor]:
    # Qwen3-Next norms scale by (1 + weight), except the gated norm inside linear attention.
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
    yield "model.embed_tokens.weight", (VOCAB_SIZE, _HIDDEN), "normal"
    for i, layer_type in enumerate(config["layer_types"]):
        p = f"model.layers.{i}"
        if layer_type == "linear_attention":
            la = f"{p}.linear_attn"
            yield f"{la}.in_proj_qkvz.weight", (2 * nk * dk + 2 * nv * dv, _HIDDEN), "normal"
            yield f"{la}.in_proj_ba.weight", (2 * nv, _HIDDEN), "normal"
            yield (
                f"{la}.conv1d.weight",
                (2 * nk * dk + nv * dv, 1, config["linear_conv_kernel_dim"]),
                "normal",
            )
            yield f"{la}.A_log", (nv,), "zeros"
            yield f"{la}.dt_bias", (nv,), "ones"
            yield f"{la}.norm.weight", (dv,), "ones"
            yield f"{la}.out_proj.weight", (_HIDDEN, nv * dv), "normal"
        else:
            # Gated attention: q_proj emits the query and an output gate.
            yield from _attention(f"{p}.self_attn", q_out=2 * _HEADS * _HEAD_DIM, norms="zeros")
        yield f"{p}.mlp.gate.weight", (experts, _HIDDEN), "normal"
        for e in range(experts):
            yield from _mlp(f"{p}.mlp.experts.{e}", moe_inter)
        yield from _mlp(f"{p}.mlp.shared_expert", config["shared_expert_intermediate_size"])
        yield f"{p}.mlp.shared_expert_gate.weight", (1, _HIDDEN), "normal"
        yield f"{p}.input_layernorm.weight", (_HIDDEN,), "zeros"
        yield f"{p}.post_attention_layernorm.weight", (_HIDDEN,), "zeros"
    yield "model.norm.weight", (_HIDDEN,), "zeros"
    yield "lm_head.weight", (VOCAB_SIZE, _HIDDEN), "normal"


_TENSORS = {
    "llama": _llama_tensors,
    "gemma3": _gemma3_tensors,
    "qwen3_next": _qwen3_next_tensors,
    "llama_ctx": _llama_tensors,
}


def _weights_bytes(arch: str, config: dict[str, Any]) -> bytes:
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(SEED)
    std = float(config["initializer_range"])
    dtype = torch.float32 if config["dtype"] == "float32" else torch.bfloat16
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, init in _TENSORS[arch](config):
        if init == "normal":
            value = torch.randn(shape, generator=generator, dtype=torch.float32) * std
        elif init == "ones":
            value = torch.ones(shape, dtype=torch.float32)
        else:
            value = torch.zeros(shape, dtype=torch.float32)
        tensors[name] = value.to(dtype).contiguous()
    return save(tensors, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _corpus_lines() -> Iterator[str]:
    for path in _corpus_files():
        yield from path.read_text(encoding="utf-8").splitlines(keepends=True)


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"the corpus in {CORPUS_DIR} yields {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}: "
            "add text to it"
        )
    return tokenizer.to_str(pretty=True) + "\n"


def _tokenizer_config() -> dict[str, Any]:
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, i in _TOKEN_IDS.items()
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


DEFAULT_MAX_NEW_TOKENS = 1024
"""The output limit of a request that sets none (``max_tokens`` / ``max_output_tokens``; Codex sets
none), from ``generation_config.json``: a random-weight model rarely emits end-of-sequence and
would write until the window is full (minutes on a CPU). vLLM reads it as a default only: a
request's own limit (Claude Code's 32,000) is kept."""


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": _TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": _TOKEN_IDS[EOS_TOKEN],
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
    }


# ---------------------------------------------------------------------------------------------
# Building


def _json_text(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def recipe_fingerprint(arch: str) -> str:
    """A hash of everything that decides the built bytes, stored in the marker file."""
    digest = hashlib.sha256()
    digest.update(f"recipe={RECIPE_VERSION};arch={arch};seed={SEED};std={INIT_STD}\n".encode())
    digest.update(_json_text(model_config(arch)).encode())
    digest.update(chat_template().encode())
    digest.update(_json_text(_generation_config()).encode())
    for path in _corpus_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build_tiny_model(out_dir: Path, arch: str = "llama") -> Path:
    """Build the tiny `arch` model into `out_dir` unless a complete build of this recipe is there.

    Returns `out_dir`. Every file is rewritten on a rebuild; the marker is written last.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    out_dir = Path(out_dir)
    marker = out_dir / MARKER_NAME
    fingerprint = recipe_fingerprint(arch)
    if marker.is_file() and marker.read_text(encoding="utf-8").strip() == fingerprint:
        return out_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    config = model_config(arch)
    files = {
        "config.json": _json_text(config).encode(),
        "generation_config.json": _json_text(_generation_config()).encode(),
        "tokenizer.json": _tokenizer_json().encode(),
        "tokenizer_config.json": _json_text(_tokenizer_config()).encode(),
        "chat_template.jinja": chat_template().encode(),
        "model.safetensors": _weights_bytes(arch, config),
    }
    for name, data in files.items():
        _write_atomic(out_dir / name, data)
    _write_atomic(marker, (fingerprint + "\n").encode())
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.local.tiny_model", description="Build a tiny model folder for vLLM."
    )
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to build")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, args.arch)
    print(f"{path} (served as {SERVED_MODEL_NAMES[args.arch]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
