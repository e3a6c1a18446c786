#!/usr/bin/env bash
# Benchmark the gateway with NVIDIA aiperf's Weka (AgentX) trace replay.
#
#   benchmarks/aiperf_run.sh                       # starts a gateway (1 first-turn + 1 warm engine), replays, stops it
#   URL=http://127.0.0.1:8000 benchmarks/aiperf_run.sh   # against a gateway that is already running
#
# The same replay direct to one engine and through the gateway in one run, behind a recording
# pass-through, with the cached share of both and the prompt analysis:
#   .venv/bin/python -m benchmarks.aiperf_compare      (benchmarks/aiperf_compare.py)
#
# Environment (defaults in brackets):
#   URL            gateway base URL; empty: start `agentgw serve` with local engines [empty]
#   FIRST, WARM    local engines when starting one [1, 1]
#   PORT           gateway port when starting one [26500]
#   PLAYS          Weka plays to replay (ids or N) [trace_0010,trace_0274]
#   MAX_REQUESTS   first N requests of each play [20]
#   MAX_CONTEXT    scale each play so it fits this context (gateway/sim/scale.py, 128-token blocks) [4096]
#   CONCURRENCY    aiperf agentic lanes [2]
#   DURATION       profiling seconds (the scenario wants >= 900; --unsafe-override turns that into a warning) [90]
#   DELAY_CAP      cap on each recorded inter-turn delay, seconds (aiperf has no speed-up for weka_trace) [2]
#   OUT            output folder [benchmarks/out/aiperf]
#   AIPERF_VENV    a separate venv for aiperf (its deps must not touch the project's torch) [.bench-venv-aiperf]
#
# What aiperf sends (checked in aiperf 0.13.0, transports/base_transports.py): X-Correlation-ID
# (the session of each Weka conversation) always; X-Session-ID with
# AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID=true; X-Dynamo-Session-ID and, on subagent
# children, X-Dynamo-Parent-Session-ID with AIPERF_HTTP_X_DYNAMO_SESSION_ID_FROM_CORRELATION_ID=true.
# The gateway reads all of them (docs/hints.md).
# Timing: aiperf's agentic replay (subagent spawn/join, recorded delays) is only reachable through
# `--scenario inferencex-agentx-mvp` (or a YAML config); the scenario locks a >= 900 s duration and a
# pinned HF dataset, so `--unsafe-override` turns those locks into warnings (submission_valid=false)
# to replay a short local, scaled-down trace. Without the scenario a weka_trace runs in plain
# concurrency mode. Agentic replay needs `--endpoint-type chat` ("Completions endpoint only supports
# one turn"); aiperf synthesizes the text per hash id with the tokenizer, 64 tokens per id.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
AIPERF_VENV=${AIPERF_VENV:-$ROOT/.bench-venv-aiperf}
PLAYS=${PLAYS:-trace_0010,trace_0274}
MAX_REQUESTS=${MAX_REQUESTS:-20}
MAX_CONTEXT=${MAX_CONTEXT:-4096}
CONCURRENCY=${CONCURRENCY:-2}
OUT=${OUT:-$ROOT/benchmarks/out/aiperf}
PORT=${PORT:-26500}
DURATION=${DURATION:-90}
DELAY_CAP=${DELAY_CAP:-2}
MODEL_DIR=${MODEL_DIR:-${AGENTGW_HOME:-$HOME/.cache/agentgw}/models/tiny-llama}

if [ ! -x "$AIPERF_VENV/bin/aiperf" ]; then
  python3 -m venv "$AIPERF_VENV"
  nice -n 10 "$AIPERF_VENV/bin/pip" install -q aiperf==0.13.0
fi

mkdir -p "$OUT"
TRACE_DIR=$OUT/trace
rm -rf "$TRACE_DIR"
mkdir -p "$TRACE_DIR"
# The scaled-down plays as Weka JSON (recorded think times; each 128-token block's hash id split
# into two 64-token ids: aiperf 0.13.0's weka_trace loader decodes every id as 64 tokens whatever
# the file's block_size says, so unsplit ids would share only half of each block).
.venv/bin/python - "$TRACE_DIR" "$PLAYS" "$MAX_REQUESTS" "$MAX_CONTEXT" <<'EOF'
import json, sys
from pathlib import Path
from benchmarks.aiperf_compare import split_blocks
from benchmarks.live_replay import default_trace, load_trace, weka_json
out, plays, n, ctx = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for p in load_trace(default_trace(), plays, n, scale=True, max_context=ctx, block_size=128, max_output=64):
    w = split_blocks(weka_json(p))  # aiperf's weka_trace reads every hash id as 64 tokens
    (out / f"{p.play_id}.json").write_text(json.dumps(w))
    print(f"{p.play_id}: {len(p.requests)} requests")
EOF

GW_PID=""
cleanup() {
  if [ -n "$GW_PID" ]; then
    kill -TERM "$GW_PID" 2>/dev/null || true
    wait "$GW_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
if [ -z "${URL:-}" ]; then
  URL=http://127.0.0.1:$PORT
  .venv/bin/agentgw serve --port "$PORT" --first-turn "${FIRST:-1}" --warm "${WARM:-1}" >"$OUT/gateway.log" 2>&1 &
  GW_PID=$!
  for _ in $(seq 1 600); do
    curl -fsS "$URL/ready" >/dev/null 2>&1 && break
    kill -0 "$GW_PID" 2>/dev/null || { echo "gateway exited; see $OUT/gateway.log" >&2; exit 1; }
    sleep 1
  done
fi

export AIPERF_HTTP_X_SESSION_ID_FROM_CORRELATION_ID=true
export AIPERF_HTTP_X_DYNAMO_SESSION_ID_FROM_CORRELATION_ID=true
# Not HF_HUB_OFFLINE=1: aiperf 0.13.0's offline path calls snapshot_download() on a local
# tokenizer folder and fails (HFValidationError); online mode loads the local folder directly.
"$AIPERF_VENV/bin/aiperf" profile \
  --model-names tiny-llama \
  --tokenizer "$MODEL_DIR" \
  --url "$URL" \
  --endpoint-type chat \
  --streaming \
  --custom-dataset-type weka_trace \
  --input-file "$TRACE_DIR" \
  --scenario inferencex-agentx-mvp \
  --unsafe-override \
  --benchmark-duration "$DURATION" \
  --inter-turn-delay-cap-seconds "$DELAY_CAP" \
  --concurrency "$CONCURRENCY" \
  --workers-max 1 \
  --extra-inputs ignore_eos:true \
  --use-server-token-count \
  --no-gpu-telemetry \
  --ui-type simple \
  --output-artifact-dir "$OUT/artifacts" \
  "$@" 2>&1 | tee "$OUT/aiperf.log"
