"""The content-keyed tokenizer: prompt tokens and block hashes equal transformers' chat template +
full encode, reuse across requests by content (no session id), a byte bound, vLLM's chat
normalisation (tools, tool calls, content formats) and 400s for what vLLM refuses."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.analysis.tokenize import ChatTokenizer, Unsupported
from gateway.api.errors import to_api_error
from gateway.core.block_hash import hash_tokens
from gateway.errors import BadRequest

JSON = {"content-type": "application/json"}
SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 60
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def scratch_ids(ref: Any, msgs: list[dict[str, Any]], **kw: Any) -> list[int]:
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    return list(ref.encode(text, add_special_tokens=False))


def test_incremental_equals_scratch_over_interleaved_sessions_without_ids(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    rng = random.Random(1)
    convs: list[list[dict[str, Any]]] = [[{"role": "system", "content": SYSTEM}] for _ in range(3)]
    encoded = []
    for turn in range(45):
        msgs = convs[rng.randrange(3)]
        msgs.append({"role": "user", "content": f"step {turn} " + "x " * rng.randrange(1, 300)})
        info = tok.prompt_info("chat", {"messages": msgs})
        ids = scratch_ids(ref, msgs)
        assert list(info.tokens) == ids
        assert info.num_tokens == len(ids)
        assert info.hashes == hash_tokens(ids, 128, "0")
        encoded.append((info.encoded_tokens, len(ids)))
        msgs.append({"role": "assistant", "content": "done " * rng.randrange(1, 100)})
        if rng.random() < 0.1:  # a harness that rewrites history
            del msgs[-3:-1]
    # later turns encode a small fraction of the context
    assert sum(e for e, _ in encoded[15:]) < 0.3 * sum(n for _, n in encoded[15:])


def test_a_request_extending_a_cached_one_encodes_only_the_new_part(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list the files " * 50}]
    a = tok.prompt_info("chat", {"messages": first, "tools": TOOLS})
    assert a.encoded_tokens == a.num_tokens
    nxt = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "now read main.py"}]
    b = tok.prompt_info("chat", {"messages": nxt, "tools": TOOLS})
    assert b.encoded_tokens < 40 < b.num_tokens - a.num_tokens + 40
    assert list(b.tokens[: a.num_tokens - 5]) == list(a.tokens[: a.num_tokens - 5])
    # the same conversation with other tools shares no key root: encoded from scratch
    c = tok.prompt_info("chat", {"messages": nxt})
    assert c.encoded_tokens == c.num_tokens


def test_first_turns_of_two_sessions_share_the_system_prompt_and_tools(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    s1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "fix bug 1 " * 30}]
    s2 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "write docs " * 30}]
    a = tok.prompt_info("chat", {"messages": s1, "tools": TOOLS})
    b = tok.prompt_info("chat", {"messages": s2, "tools": TOOLS})
    assert b.encoded_tokens < 0.2 * b.num_tokens
    assert list(b.tokens) == scratch_ids(ref, s2, tools=b_tools(tok))
    assert b.hashes[:3] == a.hashes[:3]
    # session 1's next turn still finds its own entry (keyed by its second message)
    s1 += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    c = tok.prompt_info("chat", {"messages": s1, "tools": TOOLS})
    assert c.encoded_tokens < 30


def b_tools(tok: ChatTokenizer) -> list[dict[str, Any]]:
    _, tools = tok.renderer.normalize({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    assert tools is not None
    return tools


def test_the_cache_is_bounded_by_bytes_and_evicts_least_recently_used(tiny_llama: Path) -> None:
    budget = 400_000
    tok = ChatTokenizer(tiny_llama, 128, "0", cache_bytes=budget)
    bodies = [
        {
            "messages": [
                {"role": "system", "content": f"agent {i} " + "context " * 4000},
                {"role": "user", "content": "go"},
            ]
        }
        for i in range(12)
    ]
    for b in bodies:
        tok.prompt_info("chat", b)
        assert tok.cached_bytes <= budget
    assert 0 < tok.cached_entries < 12
    again_last = tok.prompt_info("chat", bodies[-1])
    assert again_last.encoded_tokens < 10  # recent: still cached
    again_first = tok.prompt_info("chat", bodies[0])
    assert again_first.encoded_tokens == again_first.num_tokens  # evicted


def test_tokens_handed_out_are_never_changed_by_later_requests(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}]
    a = tok.prompt_info("chat", {"messages": msgs})
    before = list(a.tokens)
    tok.prompt_info(
        "chat", {"messages": [*msgs, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}
    )
    tok.prompt_info("chat", {"messages": [msgs[0], {"role": "user", "content": "z"}]})
    assert list(a.tokens) == before


def test_list_content_and_completions(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    a = tok.prompt_info("chat", {"messages": [{"role": "user", "content": parts}]})
    b = tok.prompt_info("chat", {"messages": [{"role": "user", "content": "a\nb"}]})
    assert list(a.tokens) == list(b.tokens)
    ids = list(range(300))
    assert tok.prompt_info("completions", {"prompt": ids}).hashes == hash_tokens(ids, 128, "0")
    again = tok.prompt_info("completions", {"prompt": [*ids, *range(300)]})
    assert again.hashes == hash_tokens([*ids, *range(300)], 128, "0")
    assert again.encoded_tokens < 600
    text = "def main():\n    return 1\n" * 400
    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    c = tok.prompt_info("completions", {"prompt": text})
    assert list(c.tokens) == list(ref.encode(text))
    d = tok.prompt_info("completions", {"prompt": text + "# more\n"})
    assert list(d.tokens) == list(ref.encode(text + "# more\n"))  # (no special token: whole)


def test_cache_salt_changes_every_hash_but_no_token(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    plain = tok.prompt_info("chat", {"messages": msgs})
    salted = tok.prompt_info("chat", {"messages": msgs, "cache_salt": "tenant-a"})
    assert list(plain.tokens) == list(salted.tokens)
    assert salted.hashes == hash_tokens(list(plain.tokens), 128, "0", "tenant-a")
    assert not set(salted.hashes) & set(plain.hashes)


def test_tools_and_tool_calls_are_normalised_as_vllm_does(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    body = {
        "messages": [
            {"role": "user", "content": "hi", "extra": 1},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think",
                "tool_calls": [
                    {
                        "type": "function",
                        "index": 0,
                        "id": "c1",
                        "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'},
                    },
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}], "name": 5},
            {"role": "assistant", "content": "x", "tool_calls": []},
        ],
        "tools": [
            {
                "function": {"parameters": {"type": "object"}, "name": "f", "junk": 1},
                "type": "function",
                "x": 2,
            },
            {"type": "function", "function": {"name": "g", "strict": True}, "defer_loading": True},
        ],
    }
    conv, tools = tok.renderer.normalize(body)
    assert tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": None,
                "parameters": None,
                "strict": True,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    assert list(tools[0]["function"]) == ["name", "description", "parameters"]
    assert conv[0] == {"role": "user", "content": "hi"}
    calls = conv[1]["tool_calls"]
    assert list(calls[0]) == ["id", "function", "type", "index"]
    assert list(calls[0]["function"]) == ["arguments", "name"]
    assert calls[0]["function"]["arguments"] == {"b": 1, "a": 2}
    assert calls[1]["function"]["arguments"] == {}
    assert conv[1]["content"] == "" and conv[1]["reasoning"] == "think"
    assert conv[2] == {"role": "tool", "content": "r", "tool_call_id": "c1"}
    assert "tool_calls" not in conv[3]
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"b": 1, "a": 2}'  # not mutated
    text = tok.render(body)
    assert '"description": null' in text and '"arguments": {"b": 1, "a": 2}' in text


def test_content_format_detection_agrees_with_vllm(tiny_llama: Path) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from vllm.renderers.hf import _detect_content_format

    from gateway.analysis.chat_render import content_format

    templates = [
        (tiny_llama / "chat_template.jinja").read_text(),
        "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
        "{% macro r(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
    ]
    env = ImmutableSandboxedEnvironment()
    for t in templates:
        assert content_format(env, t) == _detect_content_format(t, default="string"), t


def test_openai_content_format_keeps_parts(tiny_llama: Path) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok = ChatTokenizer(tiny_llama, 128, "0")
    tok.renderer.content_format = "openai"
    conv, _ = tok.renderer.normalize(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a", "cache_control": 1},
                        {"type": "text", "text": ""},
                    ],
                },
                {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
                {"role": "user", "content": None},
            ]
        }
    )
    assert conv[0]["content"] == [
        {"type": "text", "text": "a", "cache_control": 1},
        {"type": "text", "text": ""},
    ]
    assert conv[1]["content"] == "r1\nr2"
    assert conv[2]["content"] == []
    assert ImmutableSandboxedEnvironment  # the detector itself is checked against vLLM above


@pytest.mark.parametrize("depth", [400, 1000])
def test_deeply_nested_tools_are_a_400_naming_tools(tiny_llama: Path, depth: int) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    x: dict[str, Any] = {"type": "string"}
    for _ in range(depth // 2):
        x = {"type": "object", "properties": {"a": x}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": x}}],
    }
    if depth < 800:
        assert tok.prompt_info("chat", body).num_tokens > depth  # vLLM renders this one too
        return
    with pytest.raises(BadRequest) as err:
        tok.prompt_info("chat", body)
    assert to_api_error(err.value).status == 400 and err.value.field == "tools"


def test_bad_tool_shapes_are_400s_and_engine_dependent_inputs_unsupported(tiny_llama: Path) -> None:
    tok = ChatTokenizer(tiny_llama, 128, "0")
    msgs = [{"role": "user", "content": "hi"}]
    for tools, param in (
        ([1], "tools[0]"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([{"type": "custom", "function": {"name": "f"}}], "tools[0].type"),
    ):
        with pytest.raises(BadRequest) as err:
            tok.prompt_info("chat", {"messages": msgs, "tools": tools})
        assert to_api_error(err.value).status == 400 and err.value.field == param
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    for body in ({"messages": image}, {"messages": msgs, "chat_template": "{{ 1 }}"}):
        with pytest.raises(Unsupported):
            tok.prompt_info("chat", body)


def test_tools_nested_1000_deep_through_the_gateway_are_a_json_400_naming_tools(tiny_llama: Path) -> None:
    from tests.conftest import ServedGateway, fake_engine, wait_ready

    # ~1,000 JSON levels, built as text: orjson still parses it (its limit is 1,024), json.dumps
    # (the templates' tojson) cannot render it
    params = '{"type":"object","properties":{"a":' * 500 + '{"type":"string"}' + "}}" * 500
    tools = '[{"type":"function","function":{"name":"f","parameters":' + params + "}}]"
    raw = ('{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":' + tools + "}").encode()
    with fake_engine("--model", "m") as url:
        cfg = {
            "pools": [{"name": "any", "role": "any", "engines": [{"name": "e0", "url": url, "model": "m"}]}],
            "models": [{"name": "m", "tokenizer": str(tiny_llama), "block_size": 128}],
        }
        with ServedGateway(cfg) as gw:
            wait_ready(gw.url)
            r = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers=JSON, timeout=60)
            ok = httpx.post(
                gw.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["param"] == "tools"
    assert ok.status_code == 200


def test_a_repeated_request_is_answered_from_the_cache_without_rendering(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The whole-conversation hit (the 647 KB body sent again, a retried turn): no render, no
    encode, the same token ids and hashes as a full render; any change to the conversation, the
    tools or the template kwargs misses it."""
    tok = ChatTokenizer(tiny_llama, 128, "0")
    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    renders = 0
    render = tok.renderer.render_conversation

    def counted(*a: Any, **kw: Any) -> str:
        nonlocal renders
        renders += 1
        return render(*a, **kw)

    tok.renderer.render_conversation = counted  # type: ignore[method-assign]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list the files " * 200}]
    body = {"messages": msgs, "tools": TOOLS}
    first = tok.prompt_info("chat", body)
    again = tok.prompt_info("chat", {"messages": [dict(m) for m in msgs], "tools": TOOLS})
    assert (renders, tok.exact_hits, again.encoded_tokens) == (1, 1, 0)
    ids = scratch_ids(ref, msgs, tools=TOOLS)
    assert list(again.tokens) == list(first.tokens) == ids
    assert again.hashes == first.hashes == hash_tokens(ids, 128, "0")
    # not the same prompt: rendered (and still exact)
    for other, kw in (
        (
            {"messages": msgs, "tools": TOOLS, "add_generation_prompt": False},
            {"add_generation_prompt": False},
        ),
        ({"messages": msgs}, {}),
        ({"messages": msgs[:1], "tools": TOOLS}, {}),
    ):
        info = tok.prompt_info("chat", other)
        expect = ref.apply_chat_template(
            other["messages"],
            tokenize=False,
            **{"add_generation_prompt": True, **kw},
            tools=other.get("tools"),
        )
        assert list(info.tokens) == list(ref.encode(expect, add_special_tokens=False))
    assert (renders, tok.exact_hits) == (4, 1)
    # a completions prompt sent twice: the second from the cache
    p = tok.prompt_info("completions", {"prompt": SYSTEM})
    q = tok.prompt_info("completions", {"prompt": SYSTEM})
    assert (q.encoded_tokens, tok.exact_hits, list(q.tokens)) == (0, 2, list(p.tokens))
    # a template that reads the date renders every time
    dated = tmp_path / "dated"
    shutil.copytree(tiny_llama, dated)
    cfg = json.loads((dated / "tokenizer_config.json").read_text())
    tfile = dated / "chat_template.jinja"
    if isinstance(cfg.get("chat_template"), str):
        cfg["chat_template"] = "{{- strftime_now('%Y') -}}" + cfg["chat_template"]
        (dated / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        tfile.write_text("{{- strftime_now('%Y') -}}" + tfile.read_text())
    tok2 = ChatTokenizer(dated, 128, "0")
    assert not tok2.render_is_pure
    tok2.prompt_info("chat", body)
    assert tok2.prompt_info("chat", body).encoded_tokens > 0 and tok2.exact_hits == 0
