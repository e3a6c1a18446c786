"""Next-turn TTFT and recomputed tokens after a first turn in the first-turn pool, with 3 real
engines: KV moved during the tool gap (ours) vs the alternatives, on a scaled-down Weka trace.

Modes (same sessions, same engines per phase):
- ``recompute``: first-turn/warm split, plain engines: turn 2 runs on a warm engine that must
  recompute the whole prefix.
- ``sticky``: one pool, sticky sessions: turn 2 runs where turn 1 ran (a local prefix hit, but
  the long fresh prefills share engines with warm turns).
- ``on_demand``: split + engine_ext engines with a Mooncake tier, no migration: turn 2's engine
  loads the prefix from Mooncake when the request arrives (what a pull-at-routing-time router gets).
- ``migrate``: split + engine_ext + the gateway's planner: the KV is prefetched onto the warm
  engine during the tool gap.

Sessions: two consecutive top-level turns (``--turn``) of Weka sessions (``../shared/traces/weka``, else the 3 in ``tests/data/traces/weka``), token counts
scaled to fit the tiny model (``--max-tokens``), gaps kept but capped (``--max-gap``).

    python -m benchmarks.migration [--sessions 6] [--max-tokens 6000] [--max-gap 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import default_weka_traces
from engine_ext.config import control_env, kv_transfer_config
from gateway.local.engines import HASH_SEED, EngineSpec, LocalEngine, free_ports, start_engines
from gateway.local.mooncake import MooncakeMaster
from gateway.local.tiny_model import build_tiny_model

TRACES = default_weka_traces()
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "router", "session", "cache", "block", "prefix"]
TOKEN = "bench-token"


def text_of(tokens: int, salt: str) -> str:
    # ~2 tokens per word with the tiny tokenizer
    return f"[{salt}] " + " ".join(
        WORDS[(i * 7 + len(salt)) % len(WORDS)] + str(i % 97) for i in range(tokens // 2)
    )


def load_sessions(n: int, max_tokens: int, max_gap: float, turn: int) -> list[dict[str, Any]]:
    """Turns ``turn`` and ``turn + 1`` of each session: the first arrives fresh (its whole context
    is a long prefill: the first-turn pool), the second is a typical warm turn (a small delta)."""
    out = []
    for f in sorted(TRACES.glob("trace_*.json")):
        d = json.loads(f.read_text())
        reqs = [r for r in d["requests"] if r.get("type", "n") == "n"][turn : turn + 2]
        if len(reqs) < 2 or reqs[1]["in"] <= reqs[0]["in"]:
            continue
        scale = min(1.0, max_tokens / reqs[1]["in"])
        gap = min(max_gap, max(0.5, reqs[1]["t"] - reqs[0]["t"] - reqs[0].get("api_time", 0)))
        out.append(
            {
                "id": f.stem,
                "in0": max(700, int(reqs[0]["in"] * scale)),
                "new1": max(32, int((reqs[1]["in"] - reqs[0]["in"]) * scale)),
                "gap": gap,
            }
        )
        if len(out) == n:
            break
    return out


def metric(url: str, name: str, label: str | None = None) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and (label is None or label in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def computed(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')


def stream_ttft(gw: str, body: dict[str, Any]) -> tuple[float, dict[str, str]]:
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", gw + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if ttft is None and line.startswith("data:"):
                ttft = time.perf_counter() - t0
        headers = dict(r.headers)
    if ttft is None:
        raise RuntimeError("no data")
    return ttft, headers


def run_mode(
    mode: str, gw_url: str, engines: dict[str, str], sessions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    rows = []
    for s in sessions:
        sid = f"{mode}-{s['id']}"
        m = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": text_of(s["in0"], sid)},
        ]
        hints = {"session_id": sid, "expected_tool_latency_ms": int(s["gap"] * 1000)}
        body = {
            "model": "tiny-llama",
            "messages": m,
            "max_tokens": 16,
            "temperature": 0,
            "agent_hints": hints,
        }
        r1 = httpx.post(gw_url + "/v1/chat/completions", json=body, timeout=300).json()
        time.sleep(s["gap"])  # the tool runs
        m2 = m + [
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
            {"role": "user", "content": text_of(s["new1"], sid + "-t2")},
        ]
        before = {n: computed(u) for n, u in engines.items()}
        ttft, headers = stream_ttft(gw_url, {**body, "messages": m2})
        eng = headers["x-agentgw-engine"]
        time.sleep(0.3)
        rows.append(
            {
                "mode": mode,
                "session": s["id"],
                "engine": eng,
                "ttft_ms": ttft * 1000,
                "recomputed": computed(engines[eng]) - before[eng],
                "prefix": s["in0"],
            }
        )
    return rows


def gateway_cfg(
    specs: list[EngineSpec], controls: list[str] | None, split: bool, migrate: bool, model: Path
) -> dict:
    def eng(i: int) -> dict:
        e = {
            "name": specs[i].name,
            "url": specs[i].url,
            "model": "tiny-llama",
            "kv_events": specs[i].kv_events_endpoint,
        }
        if controls:
            e["control_url"] = controls[i]
        return e

    pools = (
        [
            {"name": "first_turn", "role": "first_turn", "engines": [eng(0)]},
            {"name": "warm", "role": "warm", "engines": [eng(1), eng(2)]},
        ]
        if split
        else [{"name": "all", "role": "any", "engines": [eng(0), eng(1), eng(2)]}]
    )
    return {
        "pools": pools,
        "models": [
            {"name": "tiny-llama", "tokenizer": str(model), "block_size": 128, "hash_seed": HASH_SEED}
        ],
        "routing": {"first_turn_threshold_tokens": 512},
        "migration": {"enabled": migrate, "control_token": TOKEN},
    }


def serve(cfg: dict) -> tuple[subprocess.Popen[bytes], str, Path]:
    import yaml

    port = free_ports(1)[0]
    d = Path(tempfile.mkdtemp())
    (d / "gw.yaml").write_text(yaml.safe_dump({**cfg, "listen": {"host": "127.0.0.1", "port": port}}))
    p = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(d / "gw.yaml")])
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return p, url, d
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("gateway not ready")


def phase(model: Path, work: Path, sessions: list[dict[str, Any]], with_ext: bool) -> list[dict[str, Any]]:
    ports = free_ports(9)
    mc = MooncakeMaster(work / "mooncake.log").start() if with_ext else None
    specs, controls = [], []
    for i, name in enumerate(("first0", "warm0", "warm1")):
        extra: tuple[str, ...] = ()
        env: Mapping[str, str] = {}
        if mc is not None:
            controls.append(f"http://127.0.0.1:{ports[6 + i]}")
            cfg = kv_transfer_config(
                256 << 20,
                control_port=ports[6 + i],
                engine_url=f"http://127.0.0.1:{ports[i]}",
                mooncake_master=mc.master_address,
                mooncake_metadata=mc.metadata_server,
            )
            extra = ("--kv-transfer-config", json.dumps(cfg))
            env = {**MooncakeMaster.client_env, **control_env(TOKEN)}
        specs.append(
            EngineSpec(
                name,
                model,
                "tiny-llama",
                ports[i],
                work / f"{name}.log",
                max_model_len=16384,
                kv_events_port=ports[3 + i],
                extra_args=extra,
                extra_env=env,
            )
        )
    engines: list[LocalEngine] = start_engines(specs, timeout_s=400)
    urls = {s.name: s.url for s in specs}
    rows: list[dict[str, Any]] = []
    try:
        modes = (
            [("on_demand", True, False), ("migrate", True, True)]
            if with_ext
            else [("recompute", True, False), ("sticky", False, False)]
        )
        for mode, split, migrate in modes:
            p, url, _ = serve(gateway_cfg(specs, controls or None, split, migrate, model))
            try:
                rows += run_mode(mode, url, urls, sessions)
            finally:
                p.terminate()
                p.wait(10)
    finally:
        for e in engines:
            e.stop()
        if mc is not None:
            mc.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--max-gap", type=float, default=4.0)
    ap.add_argument("--turn", type=int, default=10, help="which pair of consecutive turns to replay")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="agentgw-migration-"))
    model = build_tiny_model(work / "tiny-llama", "llama")
    sessions = load_sessions(args.sessions, args.max_tokens, args.max_gap, args.turn)
    rows = phase(model, work, sessions, with_ext=False) + phase(model, work, sessions, with_ext=True)
    print(
        f"{'mode':>10} {'sessions':>8} {'prefix tok':>10} {'TTFT p50 ms':>12} {'TTFT max ms':>12} "
        f"{'recomputed p50':>15} {'recomputed sum':>15}"
    )
    base = None
    for mode in ("recompute", "sticky", "on_demand", "migrate"):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        p50 = statistics.median(r["ttft_ms"] for r in rs)
        base = base or p50
        print(
            f"{mode:>10} {len(rs):>8} {statistics.median(r['prefix'] for r in rs):>10.0f} {p50:>12.1f} "
            f"{max(r['ttft_ms'] for r in rs):>12.1f} {statistics.median(r['recomputed'] for r in rs):>15.0f} "
            f"{sum(r['recomputed'] for r in rs):>15.0f}   x{base / p50:.2f} vs recompute"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
