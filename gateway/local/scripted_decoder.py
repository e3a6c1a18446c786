"""The scripted decoder: a vLLM v1 logits processor that makes the tiny random-weight model follow
an agent script (`gateway/local/agent_script.py`) found in the request's prompt.

Loaded into an engine with `--logits-processors gateway.local.scripted_decoder:ScriptedDecoder`
(`agent_script.SCRIPTED_DECODER`). For every request vLLM builds a per-request processor that sees the prompt's
token ids and the output ids so far; on its first step it decodes the prompt, asks
`agent_script.next_output` what the assistant says next and encodes that with the model's own
tokenizer; then each step it leaves exactly one token possible, the next one of that text, and
end-of-sequence after it. A prompt without a script is left alone (the random model speaks).

Everything else is vLLM's own: scheduling, prefill, the KV cache and its prefix cache, the
detokenizer, and the `hermes` tool parser that turns the forced `<tool_call>` text into the
harness's tool calls. Only the choice of tokens is scripted, and nothing here is a model.

Imports vLLM and torch: the engine loads this module, the gateway never does.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from gateway.local.agent_script import SENTINEL, next_output

__all__ = ["ScriptedDecoder"]


class _Forced:
    """One request: the token ids to force, computed from its prompt on the first step."""

    def __init__(self, tokenizer: Tokenizer, eos: int, key: bytes) -> None:
        self._tokenizer = tokenizer
        self._eos = eos
        self._key = key
        self._target: list[int] | None = None
        self._scripted = True

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self._target is None and self._scripted:
            # a prompt without the sentinel's tail tokens holds no script: no decode needed
            if self._key not in array("I", prompt_ids).tobytes():
                self._scripted = False
                return logits
            text = next_output(self._tokenizer.decode(prompt_ids, skip_special_tokens=False))
            if text is None:
                self._scripted = False
            else:
                self._target = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self._target is None:
            return logits
        n = len(output_ids)
        token = self._target[n] if n < len(self._target) else self._eos
        logits.fill_(float("-inf"))
        logits[token] = 0.0
        return logits


def _eos_id(tokenizer: Tokenizer, model_dir: Path) -> int:
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    eos = config.get("eos_token")
    token = eos.get("content") if isinstance(eos, dict) else eos
    found = tokenizer.token_to_id(token) if isinstance(token, str) else None
    if found is None:
        raise ValueError(f"{model_dir}: no eos_token in tokenizer_config.json")
    return int(found)


class ScriptedDecoder(AdapterLogitsProcessor):
    """Forces, in each request whose prompt holds an agent script, the script's next step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        model_dir = Path(vllm_config.model_config.tokenizer)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._eos = _eos_id(self._tokenizer, model_dir)
        # "-SCRIPT" is always its own pre-tokens (punctuation, then letters) in a byte-level BPE
        tail = self._tokenizer.encode(SENTINEL[SENTINEL.index("-") :], add_special_tokens=False).ids
        self._key = array("I", tail).tobytes()

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> _Forced:
        return _Forced(self._tokenizer, self._eos, self._key)
