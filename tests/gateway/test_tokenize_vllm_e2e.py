"""The gateway's prompt token ids and block hashes equal a real vLLM 0.32 engine's for multi-turn
chats with tools, assistant tool calls and tool results: token ids against the engine's
``/v1/chat/completions/render`` (``--enable-scale-out``), block hashes against its KV events, and
the same through the analyzer's worker processes (content-keyed, incremental)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.analysis import AnalysisRequest, PromptAnalyzer
from gateway.analysis.tokenize import ChatTokenizer
from gateway.config import AnalysisConfig, ModelConfig
from gateway.core.block_hash import hash_tokens
from gateway.local.engines import HASH_SEED, LocalEngine, start_engines
from tests.conftest import MODEL, engine_specs
from tests.gateway.test_routing_e2e import collect_events, drain, stored_hashes

pytestmark = pytest.mark.engine

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    # no description, extra keys, strict, keys out of order: vLLM's pydantic dump fixes all of it
    {
        "function": {"parameters": {"type": "object"}, "name": "list_dir", "x-extra": 1},
        "type": "function",
        "junk": 2,
    },
    {"type": "function", "function": {"name": "run", "strict": True, "parameters": None}},
]


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": [{"type": "text", "text": "You are a coding agent. " * 20}]},
        {"role": "user", "content": "Find the bug in main.py", "name": "dev", "extra_key": True},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should look at the file first.",
            "tool_calls": [
                {
                    "type": "function",
                    "index": 0,
                    "id": "call_1",
                    "function": {"name": "read_file", "arguments": '{"path": "main.py", "lines": 40}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "list_dir", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "def main():\n    return 1 / 0\n" * 20},
        {
            "role": "tool",
            "tool_call_id": "call_2",
            "content": [{"type": "text", "text": "main.py"}, {"type": "text", "text": "util.py"}],
        },
        {
            "role": "assistant",
            "content": "The division by zero is the bug.",
            "tool_calls": [
                {"id": "call_3", "type": "function", "function": {"name": "run", "arguments": "not json"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_3", "content": "ZeroDivisionError"},
        {"role": "assistant", "content": "Fixed.", "tool_calls": []},
        {
            "role": "user",
            "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Thanks, now the tests."}],
        },
    ]


def bodies() -> list[dict[str, Any]]:
    conv = conversation()
    out: list[dict[str, Any]] = []
    for end in (2, 4, 6, 9):  # the conversation as it grows, turn by turn
        out.append({"messages": copy.deepcopy(conv[:end]), "tools": TOOLS})
    out.append({"messages": conv, "tools": TOOLS, "add_generation_prompt": False})
    out.append({"messages": conv, "chat_template_kwargs": {"unused": None, "other": 1}})
    out.append({"messages": [{"role": "developer", "content": "Be brief."}, *conv[1:3]], "tools": TOOLS[:1]})
    return out


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, workdir: Path) -> Iterator[LocalEngine]:
    extra = ("--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    (eng,) = start_engines(engine_specs(tiny_llama, ["render0"], workdir, extra_args=extra), timeout_s=300)
    try:
        yield eng
    finally:
        eng.stop()


def vllm_ids(engine: LocalEngine, body: dict[str, Any]) -> list[int]:
    r = httpx.post(engine.url + "/v1/chat/completions/render", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["token_ids"])


def test_token_ids_equal_vllms_render_for_chats_with_tools(engine: LocalEngine, tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, HASH_SEED)
    encoded = []
    for body in bodies():
        sent = copy.deepcopy(body)
        info = tok.prompt_info("chat", body)
        assert body == sent  # the body the gateway forwards is not modified
        theirs = vllm_ids(engine, body)
        assert list(info.tokens) == theirs, body
        assert info.hashes == hash_tokens(theirs, 128, HASH_SEED)
        encoded.append(info.encoded_tokens / info.num_tokens)
    assert max(encoded[1:4]) < 0.5  # the growing turns were incremental without any session id


async def test_analyzer_workers_and_kv_event_hashes_equal_vllms(
    engine: LocalEngine, tiny_llama: Path
) -> None:
    model = ModelConfig(name=MODEL, tokenizer=str(tiny_llama), block_size=128, hash_seed=HASH_SEED)
    an = PromptAnalyzer(
        [model], AnalysisConfig(mode="process", inline_chars=0, thread_chars=0, small_chars=2000)
    )
    try:
        await an.wait_ready()
        for body in bodies()[:4]:
            info = await an.analyze(AnalysisRequest(MODEL, "chat", body, tokens=True))
            assert info is not None
            assert list(info.tokens) == vllm_ids(engine, body)
        body = bodies()[3]
        info = await an.analyze(AnalysisRequest(MODEL, "chat", body, tokens=True))
        assert info is not None and len(info.hashes) >= 3
    finally:
        await an.aclose()
    sock, events = collect_events(engine.spec.kv_events_endpoint or "")
    r = httpx.post(
        engine.url + "/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 1, "tool_choice": "auto", **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    drain(sock, events)
    sock.close(0)
    assert stored_hashes(events)[: len(info.hashes)] == info.hashes
