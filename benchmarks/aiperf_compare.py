"""aiperf's agentic replay direct to one engine and through the gateway, in one run; and where its
prompt cache share comes from.

    .venv/bin/python -m benchmarks.aiperf_compare                  # both runs, then the analysis
    .venv/bin/python -m benchmarks.aiperf_compare --analyze OUT     # the analysis of recorded runs

Each run starts fresh local engines exactly as ``agentgw serve`` starts them
(``gateway.local.embedded.plan_local_stack``: engine_ext's host tier, prefix caching, 128-token
blocks), then runs ``aiperf profile`` (``benchmarks/aiperf_run.sh``'s settings: the Weka plays as
``weka_trace``, ``--scenario inferencex-agentx-mvp --unsafe-override``, chat endpoint, streaming)
against

- ``direct``: the engine itself (one engine);
- ``gateway``: ``agentgw serve --config`` over the same kind of engines (``--engines``,
  ``--first-turn``: default one engine, so the gateway cannot split a conversation).

aiperf talks to a recording pass-through (this module, aiohttp on loopback) in front of the
engine or gateway: it forwards every request and streamed answer unchanged and writes each chat
request's body, session headers, answer text and usage to ``OUT/<run>/requests.jsonl``.

Per run it reports the cached share two ways (``usage.prompt_tokens_details.cached_tokens`` /
``prompt_tokens`` over the recorded requests, and the engines' ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` deltas) beside aiperf's own theoretical figure. The analysis
renders every recorded request with the engine's chat template and tokenizer (the tiny model's
folder, ``apply_chat_template`` + encode, checked against the engine's ``prompt_tokens``), and for
consecutive turns of one conversation (``X-Correlation-ID``) compares the common token prefix
(tokens, whole 128-token blocks) with what the trace's hash ids promise, and where the first
difference lies (which message, which part of it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import ClientSession, ClientTimeout, web

from benchmarks.live_replay import default_trace, load_trace, parse_prometheus, weka_json

__all__ = ["Recorder", "common_prefix", "main", "turn_pairs"]

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128
_HOP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
)
_SESSION_HEADERS = (
    "x-request-id",
    "x-correlation-id",
    "x-session-id",
    "x-dynamo-session-id",
    "x-dynamo-parent-session-id",
)
_RECORD_PATHS = ("/v1/chat/completions",)


# -- recording pass-through ----------------------------------------------------------------------
class Recorder:
    """A loopback HTTP pass-through to ``upstream`` that records chat requests (JSON lines).

    Runs its own event loop in a thread: ``start()`` returns once it listens on ``port``."""

    def __init__(self, upstream: str, port: int, path: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.path = path
        self._seq = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Recorder:
        self._thread = threading.Thread(target=self._run, name="aiperf-recorder", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"recorder failed to start: {self._error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        timeout = ClientTimeout(total=None, sock_connect=30)
        async with ClientSession(timeout=timeout, auto_decompress=False) as self._session:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as self._out:
                self._ready.set()
                await self._stop.wait()
                await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        record = request.method == "POST" and request.path in _RECORD_PATHS
        self._seq += 1
        seq, t0 = self._seq, time.time()
        buf = bytearray()
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            )
            status = up.status
            try:
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                    if record:
                        buf += chunk
                await resp.write_eof()
            except ConnectionResetError:  # the client went away (aiperf cancels at its deadline)
                status = 499
        if record:
            self._write(request, body, bytes(buf), status, seq, t0)
        return resp

    def _write(
        self, request: web.Request, body: bytes, answer: bytes, status: int, seq: int, t0: float
    ) -> None:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        text, usage = parse_answer(answer)
        row = {
            "seq": seq,
            "t": t0,
            "t_end": time.time(),
            "status": status,
            "headers": {h: request.headers[h] for h in _SESSION_HEADERS if h in request.headers},
            "body": payload,
            "answer": text,
            "usage": usage,
        }
        if status != 200:
            row["error"] = answer[:2000].decode("utf-8", "replace")
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()


def parse_answer(raw: bytes) -> tuple[str, dict[str, Any] | None]:
    """The answer text and the usage of a chat completion, streamed (SSE) or not."""
    text = raw.decode("utf-8", "replace")
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    chunks: list[Any] = []
    if text.lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            chunks.append(json.loads(text))
    else:
        for line in text.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                with contextlib.suppress(ValueError):
                    chunks.append(json.loads(line[5:]))
    for c in chunks:
        if not isinstance(c, dict):
            continue
        if c.get("usage"):
            usage = c["usage"]
        for ch in c.get("choices") or []:
            part = ch.get("delta") or ch.get("message") or {}
            if isinstance(part.get("content"), str):
                parts.append(part["content"])
    return "".join(parts), usage


# -- one run -------------------------------------------------------------------------------------
@dataclass
class RunResult:
    label: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    engine_hits: float
    engine_queries: float
    theoretical: float | None
    profiling_prompt_tokens: int
    profiling_cached_tokens: int

    @property
    def usage_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def profiling_share(self) -> float:
        if not self.profiling_prompt_tokens:
            return 0.0
        return self.profiling_cached_tokens / self.profiling_prompt_tokens

    @property
    def engine_share(self) -> float:
        return self.engine_hits / self.engine_queries if self.engine_queries else 0.0


def _engine_counters(urls: Sequence[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for u in urls:
        text = httpx.get(u.rstrip("/") + "/metrics", timeout=10).text
        hits += parse_prometheus(text, "vllm:prefix_cache_hits_total")
        queries += parse_prometheus(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"gateway not ready after {timeout_s:.0f} s; see {log}")


def aiperf_command(args: argparse.Namespace, url: str, trace_dir: Path, artifacts: Path) -> list[str]:
    return [
        str(Path(args.aiperf_venv) / "bin" / "aiperf"),
        "profile",
        "--model-names",
        "tiny-llama",
        "--tokenizer",
        str(args.model_dir),
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--custom-dataset-type",
        "weka_trace",
        "--input-file",
        str(trace_dir),
        "--scenario",
        "inferencex-agentx-mvp",
        "--unsafe-override",
        "--benchmark-duration",
        str(args.duration),
        "--inter-turn-delay-cap-seconds",
        str(args.delay_cap),
        "--concurrency",
        str(args.concurrency),
        "--workers-max",
        "1",
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--no-gpu-telemetry",
        "--ui-type",
        "simple",
        "--output-artifact-dir",
        str(artifacts),
        *args.aiperf_args,
    ]


def aiperf_env() -> dict[str, str]:
    env = dict(os.environ)
    env["AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID"] = "true"
    env["AIPERF_HTTP_X_DYNAMO_SESSION_ID_FROM_CORRELATION_ID"] = "true"
    # not HF_HUB_OFFLINE=1: aiperf 0.13.0's offline path calls snapshot_download() on a local
    # tokenizer folder and fails; online mode loads the local folder directly
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONPATH"):
        env.pop(k, None)
    return env


def aiperf_theoretical(artifacts: Path) -> float | None:
    """aiperf's own theoretical prefix cache hit share (its infinite-cache walk over the trace's hash
    ids, profiling requests), from ``profile_export_aiperf.json``."""
    path = artifacts / "profile_export_aiperf.json"
    if not path.exists():
        return None

    def find(x: Any) -> float | None:
        if isinstance(x, dict):
            v = x.get("theoretical_prefix_cache_hit")
            if isinstance(v, dict):
                for k in ("avg", "current", "value"):
                    if isinstance(v.get(k), int | float):
                        return float(v[k]) / 100
            if x.get("tag") == "theoretical_prefix_cache_hit" and isinstance(x.get("avg"), int | float):
                return float(x["avg"]) / 100
            for y in x.values():
                if (r := find(y)) is not None:
                    return r
        elif isinstance(x, list):
            for y in x:
                if (r := find(y)) is not None:
                    return r
        return None

    try:
        return find(json.loads(path.read_text()))
    except ValueError:
        return None


def run_one(args: argparse.Namespace, label: str, trace_dir: Path) -> RunResult:
    from gateway.local.embedded import plan_local_stack
    from gateway.local.engines import free_ports, start_engines
    from gateway.local.layout import LocalLayout

    out = Path(args.out) / label
    if out.exists():
        for p in sorted(out.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    layout = LocalLayout(1) if label == "direct" else LocalLayout(args.engines, args.first_turn)
    stack = plan_local_stack(layout, store=args.store)
    gw: subprocess.Popen[bytes] | None = None
    recorder: Recorder | None = None
    try:
        print(f"[{label}] starting {layout.engines} engine(s)", flush=True)
        stack.engines = start_engines(stack.specs, timeout_s=300)
        engine_urls = [s.url for s in stack.specs]
        rec_port, gw_port = free_ports(2)
        if label == "direct":
            target = engine_urls[0]
        else:
            cfg = dict(stack.config)
            routing = layout.routing()
            if routing:
                cfg["routing"] = routing
            cfg["listen"] = {"host": "127.0.0.1", "port": gw_port}
            (out / "gateway.yaml").write_text(json.dumps(cfg, indent=1))
            log = out / "gateway.log"
            with log.open("wb") as f:
                gw = subprocess.Popen(
                    [str(ROOT / ".venv" / "bin" / "agentgw"), "serve", "--config", str(out / "gateway.yaml")],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            target = f"http://127.0.0.1:{gw_port}"
            _wait_ready(target, gw, log)
        recorder = Recorder(target, rec_port, out / "requests.jsonl").start()
        h0, q0 = _engine_counters(engine_urls)
        print(f"[{label}] aiperf -> recorder {recorder.url} -> {target}", flush=True)
        cmd = aiperf_command(args, recorder.url, trace_dir, out / "artifacts")
        (out / "aiperf_command.txt").write_text(" ".join(cmd) + "\n")
        with (out / "aiperf.log").open("wb") as f:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=aiperf_env(), check=False
            ).returncode
        if rc != 0:
            print(f"[{label}] aiperf exited with {rc}; see {out / 'aiperf.log'}", flush=True)
        h1, q1 = _engine_counters(engine_urls)
    finally:
        if recorder is not None:
            recorder.stop()
        if gw is not None:
            gw.terminate()
            try:
                gw.wait(60)
            except subprocess.TimeoutExpired:
                gw.kill()
                gw.wait()
        stack.stop()
    rows = read_rows(out / "requests.jsonl")
    ok = [r for r in rows if r["status"] == 200 and r.get("usage")]
    meta = aiperf_records(out / "artifacts")
    prof = [
        r
        for r in ok
        if str(meta.get(r["headers"].get("x-request-id", ""), {}).get("benchmark_phase", "")).lower()
        == "profiling"
    ]
    res = RunResult(
        label,
        len(ok),
        len(rows) - len(ok),
        _prompt(ok),
        _cached(ok),
        h1 - h0,
        q1 - q0,
        aiperf_theoretical(out / "artifacts"),
        _prompt(prof),
        _cached(prof),
    )
    (out / "result.json").write_text(json.dumps(res.__dict__, indent=1))
    return res


def _prompt(rows: list[dict[str, Any]]) -> int:
    return sum(int(r["usage"].get("prompt_tokens") or 0) for r in rows)


def _cached(rows: list[dict[str, Any]]) -> int:
    return sum(int((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for r in rows)


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- analysis ------------------------------------------------------------------------------------
def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def turn_pairs(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The successful chat requests of each conversation (``X-Correlation-ID``), in send order."""
    convs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["seq"]):
        cid = r["headers"].get("x-correlation-id")
        if cid and r["status"] == 200 and isinstance(r.get("body"), dict):
            convs[cid].append(r)
    return dict(convs)


def block_chain(ids: Sequence[int], block: int = BLOCK) -> list[int]:
    """Chained hashes of the whole blocks of ``ids`` (as vLLM chains them: block i's key covers
    blocks 0..i)."""
    out: list[int] = []
    h = 0
    for i in range(len(ids) // block):
        h = hash((h, tuple(ids[i * block : (i + 1) * block])))
        out.append(h)
    return out


def aiperf_records(artifacts: Path) -> dict[str, dict[str, Any]]:
    """aiperf's per-request metadata (phase, conversation, turn, trace request) by X-Request-ID."""
    out: dict[str, dict[str, Any]] = {}
    path = artifacts / "profile_export.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            meta = rec.get("metadata") or {}
            if meta.get("x_request_id"):
                out[meta["x_request_id"]] = meta
    return out


def trace_hash_ids(trace_dir: Path) -> dict[tuple[str, int, int | None], list[Any]]:
    """Hash ids of every request of the Weka files, (trace id, outer index, inner index) -> one key
    per 128-token block (a file written with smaller blocks has its ids grouped per 128 tokens)."""
    out: dict[tuple[str, int, int | None], list[Any]] = {}
    for f in sorted(trace_dir.glob("*.json")):
        t = json.loads(f.read_text())
        per = max(1, BLOCK // int(t.get("block_size", BLOCK)))

        def group(ids: list[int], per: int = per) -> list[Any]:
            return [tuple(ids[i : i + per]) for i in range(0, len(ids) - per + 1, per)]

        for i, req in enumerate(t["requests"]):
            if req.get("type") == "subagent":
                for j, inner in enumerate(req.get("requests", [])):
                    out[(t["id"], i, j)] = group(list(inner.get("hash_ids", [])))
            else:
                out[(t["id"], i, None)] = group(list(req.get("hash_ids", [])))
    return out


AIPERF_WEKA_BLOCK = 64
"""The block size aiperf 0.13.0's ``weka_trace`` loader decodes every hash id with: its plugin
metadata's ``default_block_size`` (64) overrides the file's declared ``block_size``."""


def split_blocks(weka: dict[str, Any], block: int = AIPERF_WEKA_BLOCK) -> dict[str, Any]:
    """The Weka JSON with every hash id (one ``weka["block_size"]``-token block) split into
    ``block_size / block`` consecutive ids of ``block`` tokens, so a loader that reads each id as
    ``block`` tokens still builds the trace's whole blocks: equal ids before, equal runs after."""
    size = int(weka["block_size"])
    if size % block:
        raise ValueError(f"block_size {size} is not a multiple of {block}")
    per = size // block

    def split(req: dict[str, Any]) -> dict[str, Any]:
        out = dict(req)
        if "hash_ids" in req:
            out["hash_ids"] = [h * per + k for h in req["hash_ids"] for k in range(per)]
        if "requests" in req:
            out["requests"] = [split(r) for r in req["requests"]]
        return out

    return {**weka, "block_size": block, "requests": [split(r) for r in weka["requests"]]}


def _first_message_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x == y:
            continue
        xc, yc = str(x.get("content", "")), str(y.get("content", ""))
        role = x.get("role") if x.get("role") == y.get("role") else f"{x.get('role')}/{y.get('role')}"
        return f"msg {i} ({role}) differs at char {common_prefix(xc, yc)} of {len(xc)}/{len(yc)}"
    if len(a) == len(b):
        return "same messages"
    return f"appends {len(b) - len(a)} msg" if len(b) > len(a) else "fewer messages"


def _max_tokens(body: dict[str, Any]) -> int | None:
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    return v if isinstance(v, int) else None


def analyze(out: Path, model_dir: Path, labels: Sequence[str]) -> str:
    """Render every recorded request with the engine's chat template and tokenizer and explain the
    cached share: per request the whole blocks an ideal prefix cache could serve from the prompts
    sent before it in this run (``ideal``), beside what the engine served (``cached``); per pair of
    consecutive turns of one conversation, the common token prefix against the hash-id prefix the
    trace promises."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hashes: dict[Any, list[Any]] = dict(trace_hash_ids(out / "trace"))
    lines: list[str] = []

    def ids_of(body: dict[str, Any]) -> list[int]:
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    for label in labels:
        rows = [r for r in read_rows(out / label / "requests.jsonl") if r["status"] == 200]
        if not rows:
            continue
        rows.sort(key=lambda r: r["seq"])
        meta = aiperf_records(out / label / "artifacts")
        seen: set[int] = set()
        mismatched = 0
        per: list[dict[str, Any]] = []
        for r in rows:
            ids = ids_of(r["body"])
            usage = r.get("usage") or {}
            if usage.get("prompt_tokens") is not None and usage["prompt_tokens"] != len(ids):
                mismatched += 1
            chain = block_chain(ids)
            cap = (len(ids) - 1) // BLOCK  # at most num_tokens - 1 prompt tokens can hit
            ideal = 0
            while ideal < min(len(chain), cap) and chain[ideal] in seen:
                ideal += 1
            seen.update(chain)
            m = meta.get(r["headers"].get("x-request-id", ""), {})
            key = (m.get("source_trace_id"), m.get("source_outer_idx"), m.get("source_inner_idx"))
            phase = m.get("benchmark_phase") or ("warmup" if _max_tokens(r["body"]) == 1 else "?")
            per.append(
                {
                    "seq": r["seq"],
                    "conv": r["headers"].get("x-correlation-id", ""),
                    "phase": str(phase).lower(),
                    "turn": m.get("turn_index"),
                    "hash_ids": hashes.get(key) if key[0] is not None else None,
                    "ids": ids,
                    "messages": r["body"]["messages"],
                    "prompt": len(ids),
                    "ideal": ideal * BLOCK,
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                }
            )
        lines.append(
            f"[{label}] {len(per)} requests; rendered length != engine prompt_tokens in {mismatched}"
        )
        for phase in sorted({p["phase"] for p in per}):
            sel = [p for p in per if p["phase"] == phase]
            tot = sum(p["prompt"] for p in sel)
            ideal_t = sum(p["ideal"] for p in sel)
            cached_t = sum(p["cached"] for p in sel)
            lines.append(
                f"[{label}] {phase}: {len(sel)} requests, {tot} prompt tokens; ideal prefix cache over "
                f"the prompts sent {ideal_t} ({ideal_t / tot:.1%}); engine cached {cached_t} ({cached_t / tot:.1%})"
            )
        # consecutive turns of one conversation
        convs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for p in per:
            convs[p["conv"]].append(p)
        pairs: list[dict[str, Any]] = []
        for conv, turns in convs.items():
            for a, b in itertools.pairwise(turns):
                lcp = common_prefix(a["ids"], b["ids"])
                promised = (
                    common_prefix(a["hash_ids"], b["hash_ids"])
                    if a["hash_ids"] is not None and b["hash_ids"] is not None
                    else None
                )
                pairs.append(
                    {
                        "conv": conv,
                        "turns": (a["turn"], b["turn"]),
                        "phases": (a["phase"], b["phase"]),
                        "len": (a["prompt"], b["prompt"]),
                        "lcp": lcp,
                        "lcp_blocks": lcp // BLOCK,
                        "hash_blocks": (
                            None if a["hash_ids"] is None else len(a["hash_ids"]),
                            None if b["hash_ids"] is None else len(b["hash_ids"]),
                        ),
                        "promised_blocks": promised,
                        "cached_next": b["cached"],
                        "diff": _first_message_diff(a["messages"], b["messages"]),
                    }
                )
        firsts = [turns[0] for turns in convs.values()]
        tot = sum(p["prompt"] for p in per)
        first_tokens = sum(p["prompt"] for p in firsts)
        lines.append(
            f"[{label}] {len(convs)} conversations; their first requests carry {first_tokens} of {tot} "
            f"prompt tokens ({first_tokens / tot:.1%}), ideal-cached {sum(p['ideal'] for p in firsts)}"
        )
        if pairs:
            n_len = sum(p["len"][1] for p in pairs)
            n_lcp = sum(p["lcp"] for p in pairs)
            n_blk = sum(p["lcp_blocks"] * BLOCK for p in pairs)
            known = [p for p in pairs if p["promised_blocks"] is not None]
            lines.append(
                f"[{label}] {len(pairs)} consecutive pairs: turn k+1 {n_len} tokens, common prefix with turn k "
                f"{n_lcp} ({n_lcp / n_len:.1%}), whole blocks {n_blk} ({n_blk / n_len:.1%}); "
                f"{len(known)} pairs with trace hash ids: promised {sum(p['promised_blocks'] for p in known)} "
                f"blocks, common prefix {sum(p['lcp_blocks'] for p in known)} whole blocks"
            )
            for p in pairs[:16]:
                lines.append(
                    f"  {p['conv'][:8]} turns {p['turns']} {p['phases'][1][:4]}: {p['len'][0]}->{p['len'][1]} tok, "
                    f"lcp {p['lcp']} ({p['lcp_blocks']} blk), hash ids {p['hash_blocks']} promise "
                    f"{p['promised_blocks']} blk, cached {p['cached_next']}; {p['diff']}"
                )
        dump = [{k: v for k, v in p.items() if k not in ("ids", "messages")} for p in per]
        (out / label / "analysis.json").write_text(json.dumps({"requests": dump, "pairs": pairs}, indent=1))
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------
AIPERF_VERSION = "0.13.0"


def ensure_aiperf(venv: Path) -> None:
    """aiperf in its own venv (its transformers/pydantic stack must not touch the project's torch)."""
    if (venv / "bin" / "aiperf").exists():
        return
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # a new venv: no project packages
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    home = Path(os.environ.get("AGENTGW_HOME", Path.home() / ".cache" / "agentgw"))
    p.add_argument("--runs", default="direct,gateway", help="direct, gateway or both [direct,gateway]")
    p.add_argument("--plays", default="trace_0010,trace_0274")
    p.add_argument("--max-requests", type=int, default=20)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--duration", type=int, default=90)
    p.add_argument("--delay-cap", type=float, default=2)
    p.add_argument("--engines", type=int, default=1, help="gateway run: local engines [1]")
    p.add_argument("--first-turn", type=int, default=0, help="gateway run: first-turn engines [0]")
    p.add_argument("--store", default="host", choices=("none", "host", "mooncake"))
    p.add_argument("--model-dir", type=Path, default=home / "models" / "tiny-llama")
    p.add_argument("--aiperf-venv", default=str(ROOT / ".bench-venv-aiperf"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "aiperf_compare"))
    p.add_argument(
        "--as-declared",
        action="store_true",
        help="write the trace with its 128-token hash ids as they are (aiperf 0.13.0 then reads each "
        "as 64 tokens); default: split each id into two 64-token ids",
    )
    p.add_argument("--analyze", metavar="OUT", help="only analyse the runs recorded in OUT")
    p.add_argument("aiperf_args", nargs="*", help="more aiperf arguments (after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    labels = [x for x in args.runs.split(",") if x]
    if args.analyze:
        done = [Path(args.analyze) / label / "result.json" for label in labels]
        print(format_results([RunResult(**json.loads(f.read_text())) for f in done if f.exists()]))
        print(analyze(Path(args.analyze), args.model_dir, labels))
        return 0
    ensure_aiperf(Path(args.aiperf_venv))
    out = Path(args.out)
    trace_dir = out / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for f in trace_dir.glob("*.json"):
        f.unlink()
    plays = load_trace(
        default_trace(),
        args.plays,
        args.max_requests,
        scale=True,
        max_context=args.max_context,
        max_output=64,
    )
    for play in plays:
        weka = weka_json(play)
        if not args.as_declared:
            weka = split_blocks(weka)
        (trace_dir / f"{play.play_id}.json").write_text(json.dumps(weka))
    results = [run_one(args, label, trace_dir) for label in labels]
    print(format_results(results))
    print(analyze(out, args.model_dir, labels))
    return 0


def format_results(results: Sequence[RunResult]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    lines = [
        "| run | requests (ok / errors) | cached / prompt tokens (usage), all | profiling only "
        "| engine prefix hits / queries | aiperf theoretical |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.requests} / {r.errors} | {pct(r.usage_share)} ({r.cached_tokens} / {r.prompt_tokens}) "
            f"| {pct(r.profiling_share)} ({r.profiling_cached_tokens} / {r.profiling_prompt_tokens}) "
            f"| {pct(r.engine_share)} ({r.engine_hits:.0f} / {r.engine_queries:.0f}) | {pct(r.theoretical)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
