"""benchmarks/aiperf_compare.py without aiperf or engines: its recording pass-through in front of the
stand-in engine, and the prompt analysis on recorded requests rendered with the tiny model's
chat template and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from benchmarks.aiperf_compare import (
    AIPERF_WEKA_BLOCK,
    BLOCK,
    Recorder,
    analyze,
    block_chain,
    common_prefix,
    parse_answer,
    read_rows,
    split_blocks,
    trace_hash_ids,
)
from gateway.local.engines import free_port
from tests.benchmarks.test_live_replay import _FakeEngine


def test_recorder_passes_streams_through_and_records_body_headers_and_usage(tmp_path: Path) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
    }
    headers = {"X-Correlation-ID": "conv-1", "X-Request-ID": "req-1", "X-Other": "not recorded"}
    with _FakeEngine() as eng:
        rec = Recorder(eng.url, free_port(), tmp_path / "requests.jsonl").start()
        try:
            direct = httpx.post(eng.url + "/v1/chat/completions", json=body, headers=headers).content
            via = httpx.post(rec.url + "/v1/chat/completions", json=body, headers=headers)
            models = httpx.get(rec.url + "/v1/models")
        finally:
            rec.stop()
    assert via.status_code == 200 and models.status_code == 200
    assert parse_answer(via.content) == parse_answer(direct)
    text, usage = parse_answer(via.content)
    assert text and usage is not None and usage["completion_tokens"] == 5
    rows = read_rows(tmp_path / "requests.jsonl")
    assert len(rows) == 1  # GET /v1/models is forwarded, not recorded
    row = rows[0]
    assert row["body"] == body
    assert row["headers"] == {"x-correlation-id": "conv-1", "x-request-id": "req-1"}
    assert (row["answer"], row["usage"]) == (text, usage)


def test_block_chain_keys_cover_the_whole_prefix() -> None:
    a = list(range(3 * BLOCK + 5))
    b = a[:BLOCK] + [0] + a[BLOCK + 1 :]
    ca, cb = block_chain(a), block_chain(b)
    assert len(ca) == 3  # the partial block has no key
    assert ca[0] == cb[0] and ca[1] != cb[1] and ca[2] != cb[2]  # a change in block 1 breaks 1 and 2
    assert common_prefix(a, b) == BLOCK


def _row(seq: int, conv: str, messages: list[dict[str, str]], prompt: int, cached: int) -> dict[str, Any]:
    return {
        "seq": seq,
        "status": 200,
        "headers": {"x-correlation-id": conv, "x-request-id": f"r{seq}"},
        "body": {"model": "tiny-llama", "messages": messages, "max_tokens": 8},
        "answer": "",
        "usage": {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}},
    }


def test_analysis_measures_shared_prefixes_of_consecutive_turns(tmp_path: Path, tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))

    def n_tokens(messages: list[dict[str, str]]) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tok.encode(text, add_special_tokens=False))

    words = " ".join(f"w{i}" for i in range(400))
    t0 = [{"role": "user", "content": words}]
    t1 = [*t0, {"role": "assistant", "content": "ok " * 50}, {"role": "user", "content": "next " * 80}]
    # the same conversation replayed with a different first message (a changed prefix marker)
    other = [{"role": "user", "content": "[rid:1]\n\n" + words}]
    rows = [
        _row(1, "a", t0, n_tokens(t0), 0),
        _row(2, "a", t1, n_tokens(t1), 0),
        _row(3, "b", other, n_tokens(other), 0),
    ]
    run = tmp_path / "direct"
    run.mkdir()
    (tmp_path / "trace").mkdir()
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = analyze(tmp_path, tiny_llama, ["direct"])
    assert "rendered length != engine prompt_tokens in 0" in report
    data = json.loads((run / "analysis.json").read_text())
    pair = data["pairs"][0]
    ids0 = tok.encode(
        tok.apply_chat_template(t0, tokenize=False, add_generation_prompt=False), add_special_tokens=False
    )
    # turn 1 repeats turn 0's messages: the common prefix is turn 0 (up to its generation prompt)
    assert len(ids0) <= pair["lcp"] <= n_tokens(t0)
    assert pair["lcp_blocks"] == pair["lcp"] // BLOCK >= 2
    reqs = data["requests"]
    assert reqs[0]["ideal"] == 0
    assert reqs[1]["ideal"] == pair["lcp_blocks"] * BLOCK
    assert reqs[2]["ideal"] == 0  # the marker before the content moves every block: nothing reusable


def test_split_blocks_keeps_the_trace_sharing_at_aiperf_block_size(tmp_path: Path) -> None:
    weka = {
        "id": "p0",
        "block_size": 128,
        "requests": [
            {"type": "n", "in": 300, "hash_ids": [2, 3]},
            {"type": "subagent", "agent_id": "a", "requests": [{"type": "n", "in": 200, "hash_ids": [2, 9]}]},
            {"type": "n", "in": 400, "hash_ids": [2, 3, 4]},
        ],
    }
    split = split_blocks(weka)
    assert split["block_size"] == AIPERF_WEKA_BLOCK == 64
    ids = [
        split["requests"][0]["hash_ids"],
        split["requests"][1]["requests"][0]["hash_ids"],
        split["requests"][2]["hash_ids"],
    ]
    assert [len(x) for x in ids] == [4, 4, 6]  # two 64-token ids per 128-token block
    assert len({*ids[0], *ids[1], *ids[2]}) == 2 * len({2, 3, 4, 9})  # distinct ids stay distinct
    assert common_prefix(ids[0], ids[2]) == 4 and common_prefix(ids[0], ids[1]) == 2  # same sharing
    assert split["requests"][0]["in"] == 300 and weka["requests"][0]["hash_ids"] == [2, 3]  # copy
    # the analysis reads the split file back as 128-token blocks
    (tmp_path / "p0.json").write_text(json.dumps(split))
    back = trace_hash_ids(tmp_path)
    assert len(back[("p0", 0, None)]) == 2 and len(back[("p0", 2, None)]) == 3
    assert back[("p0", 2, None)][:2] == back[("p0", 0, None)]
    assert back[("p0", 1, 0)][0] == back[("p0", 0, None)][0] != back[("p0", 1, 0)][1]
