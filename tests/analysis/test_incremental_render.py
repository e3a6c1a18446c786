"""Incremental rendering of an append-only conversation (``ChatTokenizer._stitch``): a turn that
extends a cached conversation renders only its new messages, and its tokens and block hashes
equal a whole render's, encoded from scratch, on every template shape tried; a template that is
not append-only is found by the start-up probe or by the live check and rendered whole from then
on; message keys are sketches, so messages that share one are told apart by comparison."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.analysis.tokenize import RENDER_CHECK_FIRST, ChatTokenizer
from gateway.core.block_hash import hash_tokens

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]

# a Llama-3-like template: the system message taken out of the loop, the rest indexed after it
LLAMA3_LIKE = """{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}
{%- else -%}{%- set system = 'default' -%}{%- endif -%}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + ' ' + (loop.index0 % 2) | string + '\\n' -}}
{%- if message['content'] is string -%}{{- message['content'] | trim -}}{%- endif -%}
{%- for c in message.tool_calls or [] -%}{{- '\\n<call>' + c.function.name + (c.function.arguments | tojson) + '</call>' -}}{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

# a Qwen-2.5-like template: consecutive tool results share one user turn (looks both ways)
QWEN_LIKE = """{%- if tools -%}{{- '<|im_start|>system\\ntools: ' + (tools | tojson) + '<|im_end|>\\n' -}}{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') -}}
{%- if message.reasoning_content -%}{{- '<think>' + message.reasoning_content + '</think>' -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

# not append-only: the last message renders differently (the probe finds it)
LAST_DIFFERS = """{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') -}}
{%- if loop.last -%}{{- ' (latest)' -}}{%- endif -%}{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

# not append-only past 12 messages, longer than any probe conversation (the live check finds it)
LONG_DIFFERS = """{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') -}}
{%- if messages | length > 12 -%}{{- ' [long]' -}}{%- endif -%}{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""


def with_template(tiny_llama: Path, dest: Path, template: str | None) -> Path:
    if template is None:
        return tiny_llama
    shutil.copytree(tiny_llama, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    return dest


def whole(tok: ChatTokenizer, body: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Token ids and block hashes of a whole render, encoded from scratch by the tokenizer."""
    text = tok.renderer.render(body)
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    return ids, hash_tokens(ids, tok.block_size, tok.hash_seed, body.get("cache_salt"))


def call(i: int, cmd: str) -> dict[str, Any]:
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"cmd": cmd})},
    }


_text = st.text(st.sampled_from("ab cd\n\tEé.{}<|>_"), min_size=0, max_size=300)
_message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _text),
    st.builds(lambda t: {"role": "assistant", "content": t}, _text),
    st.builds(lambda t, r: {"role": "assistant", "content": t, "reasoning_content": r}, _text, _text),
    st.builds(lambda t: {"role": "assistant", "content": None, "tool_calls": [call(1, t)]}, _text),
    st.builds(lambda t: {"role": "tool", "tool_call_id": "c1", "content": t}, _text),
    st.builds(
        lambda a, b: {"role": "user", "content": [{"type": "text", "text": a}, {"type": "text", "text": b}]},
        _text,
        _text,
    ),
)


_TOKENIZERS: dict[str | None, ChatTokenizer] = {}


def tokenizer(tiny_llama: Path, factory: pytest.TempPathFactory, template: str | None) -> ChatTokenizer:
    """One tokenizer per template for every example (its cache carries over: more reuse)."""
    if template not in _TOKENIZERS:
        _TOKENIZERS[template] = ChatTokenizer(
            with_template(tiny_llama, factory.mktemp("m") / "m", template), 16, "0"
        )
    return _TOKENIZERS[template]


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE, QWEN_LIKE])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.booleans(),
    tools=st.booleans(),
    turns=st.lists(st.lists(_message, min_size=1, max_size=3), min_size=2, max_size=8),
)
def test_every_turn_equals_a_whole_render_encoded_from_scratch(
    tiny_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
    template: str | None,
    system: bool,
    tools: bool,
    turns: list[list[dict[str, Any]]],
) -> None:
    tok = tokenizer(tiny_llama, tmp_path_factory, template)
    assert tok.stitch, tok.stitch_reason
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. " * 20}] if system else []
    msgs.append({"role": "user", "content": "start " * 30})
    for new in turns:
        msgs = msgs + new
        body: dict[str, Any] = {"messages": msgs, **({"tools": TOOLS} if tools else {})}
        info = tok.prompt_info("chat", body)
        ids, hashes = whole(tok, body)
        assert (list(info.tokens), info.hashes) == (ids, hashes)
    assert tok.stitch_mismatches == 0 and tok.stitch
    assert tok.stitched > 0


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE, QWEN_LIKE])
def test_an_agent_session_renders_only_its_new_messages(
    tiny_llama: Path, tmp_path: Path, template: str | None
) -> None:
    tok = ChatTokenizer(with_template(tiny_llama, tmp_path / "m", template), 128, "0")
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " * 100},
        {"role": "user", "content": "Fix the tests."},
    ]
    for i in range(30):
        body = {"messages": msgs, "tools": TOOLS}
        info = tok.prompt_info("chat", body)
        assert (list(info.tokens), info.hashes) == whole(tok, body)
        msgs = [*msgs, {"role": "assistant", "content": None, "tool_calls": [call(i, f"pytest -k t{i}")]}]
        msgs += [{"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} passed\n" * 40}]
        if i % 3 == 2:
            msgs += [{"role": "user", "content": f"Now step {i}."}]
    assert tok.stitched == 29 and tok.stitch_checks >= RENDER_CHECK_FIRST and tok.stitch_mismatches == 0


def test_a_template_that_is_not_append_only_is_found_by_the_probe(tiny_llama: Path, tmp_path: Path) -> None:
    tok = ChatTokenizer(with_template(tiny_llama, tmp_path / "m", LAST_DIFFERS), 128, "0")
    assert not tok.stitch and "differently once messages follow" in tok.stitch_reason
    msgs = [{"role": "user", "content": "a " * 200}]
    for i in range(5):
        msgs = [*msgs, {"role": "assistant", "content": f"ok {i}"}, {"role": "user", "content": "more " * 50}]
        body = {"messages": msgs}
        info = tok.prompt_info("chat", body)
        assert (list(info.tokens), info.hashes) == whole(tok, body)
    assert tok.stitched == 0


def test_the_live_check_turns_stitching_off_at_the_first_difference(tiny_llama: Path, tmp_path: Path) -> None:
    tok = ChatTokenizer(with_template(tiny_llama, tmp_path / "m", LONG_DIFFERS), 128, "0")
    assert tok.stitch, tok.stitch_reason  # the probe's conversations are all under 13 messages
    msgs = [{"role": "system", "content": "sys " * 100}, {"role": "user", "content": "go"}]
    for i in range(12):
        body = {"messages": msgs}
        info = tok.prompt_info("chat", body)
        assert (list(info.tokens), info.hashes) == whole(tok, body)  # the turn that found it too
        msgs = [
            *msgs,
            {"role": "assistant", "content": f"done {i}"},
            {"role": "user", "content": f"next {i}"},
        ]
    assert not tok.stitch and tok.stitch_mismatches == 1
    assert tok.stitch_reason == "differed from a whole render on a live prompt"


def test_messages_with_the_same_sketch_are_told_apart(tiny_llama: Path) -> None:
    """Long strings enter a message's key by length, head and tail: two conversations that differ
    only in the middle of one share keys, and neither is answered from the other's entry."""
    tok = ChatTokenizer(tiny_llama, 16, "0")
    head, tail = "h" * 100, "t" * 100
    a = [{"role": "system", "content": head + "A" * 300 + tail}, {"role": "user", "content": "q"}]
    b = [{"role": "system", "content": head + "B" * 300 + tail}, {"role": "user", "content": "q"}]
    for msgs in (a, b, a):
        body = {"messages": msgs}
        info = tok.prompt_info("chat", body)
        assert (list(info.tokens), info.hashes) == whole(tok, body)
    assert tok.exact_hits == 0
    # B's next turn finds A's entry under its keys: it is not stitched onto A's render
    nxt = {"messages": [*b, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}
    tok.prompt_info("chat", {"messages": a})  # A's entry again (an exact hit), under B's keys too
    assert tok.exact_hits == 1
    info = tok.prompt_info("chat", nxt)
    assert (list(info.tokens), info.hashes) == whole(tok, nxt)
    # and the same request again is an exact hit
    again = tok.prompt_info("chat", json.loads(json.dumps(nxt)))
    assert tok.exact_hits == 2 and again.hashes == info.hashes
