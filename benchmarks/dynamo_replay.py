"""NVIDIA Dynamo's own offline trace replay, run next to our simulator on the same traces.

    python -m benchmarks.dynamo_replay                      # the ANCHORS configurations
    python -m benchmarks.dynamo_replay --configs 8x64x10 --policies kv_router
    python -m benchmarks.compare --with-dynamo              # side by side with our policies

Dynamo (``ai-dynamo==1.6.1``) lives in its own Python 3.10 virtual environment (its wheel does
not install on 3.11 here; our project needs 3.11), so this module has two halves:

- the **driver** (any Python): :func:`run_dynamo` prepares a copy of the Weka folder and starts
  this same file under the Dynamo interpreter with ``--worker``, then reads its JSON;
- the **worker** (Python 3.10, stdlib + ``dynamo`` only, no project imports): for each
  (configuration, policy) it calls ``dynamo.replay.run_trace_replay(folder,
  trace_format='weka', trace_block_size=64, agentic_lanes=L, num_workers=W,
  arrival_speedup_ratio=S, execution_model=...)`` with the mocker engines at their defaults
  (the engine model ``--engine dynamo-mocker`` reproduces in our simulator) and reduces the
  per-request records to the same metrics as :mod:`gateway.sim.metrics`.

Policies: ``round_robin`` (``router_mode='round_robin'``), ``kv_router`` (``router_mode=
'kv_router'``, default ``KvRouterConfig``: prefix overlap from KV events + load) and
``load_only`` (``kv_router`` with Dynamo's ``--load-aware`` preset: no KV events, no overlap
credit, active-block and prefill-token load tracking).

The trace copy: Dynamo's replay takes one Weka *folder*, and rejects a file whose subagents use
a model absent from the file's top-level ``models`` list (9 of the 48 dev files); the copy adds
every model a file's requests name to that list and changes nothing else.

Dynamo's KV router picks randomly among equal-cost workers (its docstring: "a fixed arrival seed
therefore does not guarantee identical routing"), so its rows move by a few ms between runs.

The interpreter: ``--dynamo-python``, else ``$DYNAMO_PYTHON``, else ``.dynamo-venv/bin/python``
in the checkout. Set it up with::

    ~/.pyenv/versions/3.10.13/bin/python -m venv .dynamo-venv
    .dynamo-venv/bin/pip install ai-dynamo==1.6.1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICIES = ("round_robin", "kv_router", "load_only")
ANCHOR_CONFIGS = ("4x16x1", "8x16x1", "8x64x10")
#: ANCHORS.md lists these (config, policy) pairs; ``--policies`` can ask for more.
ANCHOR_RUNS = {
    "4x16x1": POLICIES,
    "8x16x1": ("round_robin", "kv_router"),
    "8x64x10": POLICIES,
}
LABELS = {
    "round_robin": "Dynamo round-robin",
    "kv_router": "Dynamo KV router",
    "load_only": "Dynamo load-only",
}
EXECUTION_MODEL = "agent-model"
SLO_TOK_S = 50.0

#: Dynamo's ``--load-aware`` preset (dynamo/common/configuration/groups/kv_router_args.py,
#: ``_LOAD_AWARE_KWARG_OVERRIDES``), as ``KvRouterConfig`` keyword arguments.
LOAD_AWARE = {
    "overlap_score_credit": 0.0,
    "use_kv_events": False,
    "router_track_active_blocks": True,
    "router_assume_kv_reuse": False,
    "router_track_prefill_tokens": True,
    "use_remote_indexer": False,
    "serve_indexer": False,
    "shared_cache_multiplier": 0.0,
    "shared_cache_type": "none",
    "router_predicted_ttl_secs": None,
}


def _repo() -> Path:
    return Path(__file__).resolve().parents[1]


def default_python() -> str:
    env = os.environ.get("DYNAMO_PYTHON")
    if env:
        return env
    return str(_repo() / ".dynamo-venv" / "bin" / "python")


def default_traces() -> Path:
    from benchmarks._common import default_weka_traces  # not at the top: the worker runs as a script

    return default_weka_traces()


def _models_named(obj: object, out: list[str]) -> None:
    if isinstance(obj, dict):
        m = obj.get("model")
        if isinstance(m, str) and m and m not in out:
            out.append(m)
        for v in obj.values():
            _models_named(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _models_named(v, out)


def prepare_traces(src: Path, dst: Path) -> int:
    """Copy every ``*.json`` Weka file of ``src`` into ``dst`` with its ``models`` list extended
    to every model its requests name. Returns how many files needed the extension."""
    dst.mkdir(parents=True, exist_ok=True)
    fixed = 0
    for p in sorted(src.glob("*.json")):
        d = json.loads(p.read_text())
        models = list(d.get("models") or [])
        before = len(models)
        _models_named(d.get("requests"), models)
        fixed += len(models) > before
        d["models"] = models
        (dst / p.name).write_text(json.dumps(d))
    return fixed


def parse_config(text: str) -> tuple[int, int, float]:
    w, lanes, sp = text.split("x")
    return int(w), int(lanes), float(sp)


# -- worker (runs under Dynamo's Python 3.10) ---------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _reduce(report: object, workers: int) -> dict[str, object]:
    s = report.summary  # type: ignore[attr-defined]
    per = report.per_request or []  # type: ignore[attr-defined]
    done = [r for r in per if r.get("terminal_status") == "completed" and r.get("first_token_ms") is not None]
    ttft = [float(r["ttft_ms"]) for r in done if r.get("ttft_ms") is not None]
    tin = sum(int(r["input_length"]) for r in done)
    tout = sum(int(r["output_length"]) for r in done)
    hits = sum(int(r.get("reused_input_tokens") or 0) for r in done)
    inter = [
        (r["output_length"] - 1) / ((r["last_token_ms"] - r["first_token_ms"]) / 1000.0)
        for r in done
        if r["output_length"] > 1 and r["last_token_ms"] > r["first_token_ms"]
    ]
    t0 = min((r["arrival_time_ms"] for r in done), default=0.0)
    t1 = max((r["last_token_ms"] for r in done), default=0.0)
    span = max(1e-9, (t1 - t0) / 1000.0)
    p90_inter = _pct(inter, 10.0)
    tpgs = (tin + tout) / (span * workers)
    return {
        "requests": len(done),
        "hit_rate": hits / tin if tin else 0.0,
        "hit_rate_dynamo": s.get("prefix_cache_reused_ratio"),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "ttft_p99_ms": _pct(ttft, 99),
        "interactivity_p90": p90_inter,
        "tpgs": tpgs,
        "tpgs_at_slo": tpgs if p90_inter >= SLO_TOK_S else 0.0,
        "makespan_s": span,
        "readmissions": sum(int(r.get("readmission_count") or 0) for r in per),
        "total_throughput_tok_s": s.get("total_throughput_tok_s"),
    }


def _worker(args: argparse.Namespace) -> int:
    from dynamo._core import KvRouterConfig
    from dynamo.replay import run_trace_replay

    out: list[dict[str, object]] = []
    for run in json.loads(args.runs):
        config, policy = run["config"], run["policy"]
        w, lanes, sp = parse_config(config)
        kw: dict[str, object] = {"router_mode": "round_robin" if policy == "round_robin" else "kv_router"}
        if policy == "load_only":
            kw["router_config"] = KvRouterConfig(**LOAD_AWARE)
        t0 = time.perf_counter()
        report = run_trace_replay(
            [args.traces],
            trace_format="weka",
            trace_block_size=64,
            agentic_lanes=lanes,
            num_workers=w,
            arrival_speedup_ratio=sp,
            execution_model=EXECUTION_MODEL,
            capture_per_request=True,
            **kw,
        )
        row = {"config": config, "policy": policy, "label": LABELS[policy], **_reduce(report, w)}
        row["wall_s"] = time.perf_counter() - t0
        out.append(row)
        print(
            f"dynamo {config} {policy}: reuse {row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50_ms']:.0f} "
            f"p90 {row['ttft_p90_ms']:.0f} ms ({row['wall_s']:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
    Path(args.json_out).write_text(json.dumps(out))
    return 0


# -- driver ---------------------------------------------------------------------------------------
class DynamoUnavailable(RuntimeError):
    pass


def run_dynamo(
    runs: list[tuple[str, str]],
    traces: Path | None = None,
    python: str | None = None,
    timeout_s: float = 3600.0,
) -> list[dict[str, object]]:
    """Run Dynamo's replay for each (config, policy) in a subprocess; one row dict per run.
    Raises :class:`DynamoUnavailable` with the reason when it cannot run."""
    python = python or default_python()
    if not Path(python).exists():
        raise DynamoUnavailable(
            f"no Dynamo interpreter at {python} (create .dynamo-venv with Python 3.10 and "
            "`pip install ai-dynamo==1.6.1`, or set DYNAMO_PYTHON)"
        )
    src = traces or default_traces()
    with tempfile.TemporaryDirectory(prefix="dynamo-weka-") as tmp:
        folder = Path(tmp) / "weka"
        prepare_traces(Path(src), folder)
        json_out = Path(tmp) / "rows.json"
        cmd = [
            python,
            str(Path(__file__).resolve()),
            "--worker",
            "--traces",
            str(folder),
            "--json-out",
            str(json_out),
            "--runs",
            json.dumps([{"config": c, "policy": p} for c, p in runs]),
        ]
        env = {**os.environ, "PYTHONPATH": ""}
        tail: list[str] = []
        with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env) as proc:
            assert proc.stderr is not None
            deadline = time.monotonic() + timeout_s
            for line in proc.stderr:
                if line.startswith("dynamo "):
                    print(line.rstrip(), flush=True)  # progress, one line per run
                tail = (tail + [line.rstrip()])[-20:]
                if time.monotonic() > deadline:
                    proc.kill()
            rc = proc.wait()
        if rc != 0:
            sys.stderr.write("\n".join(tail) + "\n")
            last = next((t for t in reversed(tail) if t.strip()), "(no output)")
            raise DynamoUnavailable(f"Dynamo replay exited {rc}: {last}")
        return json.loads(json_out.read_text())


def anchor_runs(configs: list[str], policies: list[str] | None = None) -> list[tuple[str, str]]:
    out = []
    for c in configs:
        for p in policies or ANCHOR_RUNS.get(c, POLICIES):
            out.append((c, p))
    return out


def format_rows(rows: list[dict[str, object]]) -> str:
    head = f"{'config':<8} {'policy':<20} {'reuse':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'P90 tok/s':>9} {'TPGS':>7} {'wall s':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['config']:<8} {r['label']:<20} {r['hit_rate']:>7.1%} {r['ttft_p50_ms']:>9.0f} "
            f"{r['ttft_p90_ms']:>8.0f} {r['ttft_p99_ms']:>8.0f} {r['interactivity_p90']:>9.1f} "
            f"{r['tpgs']:>7.0f} {r['wall_s']:>6.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(ANCHOR_CONFIGS), help="WORKERSxLANESxSPEEDUP,...")
    ap.add_argument(
        "--policies", default="", help=f"subset of {','.join(POLICIES)} (default: the ANCHORS rows)"
    )
    ap.add_argument("--traces", default=None, help="Weka folder (default: shared/traces/weka)")
    ap.add_argument("--dynamo-python", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runs", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    configs = [c for c in args.configs.split(",") if c]
    policies = [p for p in args.policies.split(",") if p] or None
    rows = run_dynamo(
        anchor_runs(configs, policies), Path(args.traces) if args.traces else None, args.dynamo_python
    )
    print(format_rows(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
