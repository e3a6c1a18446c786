#!/usr/bin/env bash
# Build the engine-gpu image here (no GPU needed) and check what can be checked without one:
# the CUDA build of torch (not the +cpu one), vllm 0.32.0, mooncake, engine_ext importable
# against that vLLM, the engine command the image runs (async pinning scheduler, CUDA graphs
# kept), and the vLLM internals engine_ext relies on (tests/engine_ext/test_device_pins_surface.py
# run inside the image). It does not serve a model: that needs an NVIDIA GPU.
#
#   scripts/gpu-image-check.sh      (not part of .ci/run: ~5 GB of CUDA wheels from PyPI)
#
# - starts dockerd when none answers and builds the debootstrapped base image, as
#   scripts/compose-check.sh does (run that once first, or let this do it);
# - downloads the wheelhouse .agentgw/wheels-gpu from PyPI itself (`pip --isolated`: this
#   machine's pip configuration resolves torch==2.13.0 to its local +cpu wheel), serves it on
#   loopback as GPU_WHEELS_URL for the engine-gpu stage.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
PY=${PYTHON:-.venv/bin/python}
BASE_IMAGE=agentgw-base:bookworm
STATE=.agentgw
WHEELS=$STATE/wheels-gpu
PORT=${AGENTGW_GPU_WHEELS_PORT:-47314}
INDEX=${AGENTGW_GPU_INDEX_URL:-https://pypi.org/simple}
IMAGE=agentgw-engine-gpu:check
mkdir -p "$STATE"
log() { echo "gpu-image-check: $* ($(($(date +%s) - t0)) s)"; }

# shellcheck source=scripts/docker-lib.sh
. scripts/docker-lib.sh
ensure_dockerd || exit 1
ensure_base_image || exit 1

stamp=$WHEELS/.stamp
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "downloading the CUDA wheelhouse into $WHEELS from $INDEX"
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  cert=()
  [ -f /etc/ssl/certs/ca-certificates.crt ] && cert=(--cert /etc/ssl/certs/ca-certificates.crt)
  "$PY" -m pip download --isolated "${cert[@]}" --index-url "$INDEX" -q --only-binary=:all: -d "$WHEELS" \
    "vllm==0.32.0" mooncake-transfer-engine . "setuptools>=77" wheel pip "async-timeout>=4.0.3" \
    "pytest>=8" >"$STATE/wheels-gpu.log" 2>&1 || { tail -30 "$STATE/wheels-gpu.log" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
log "wheelhouse: $(du -sh "$WHEELS" | cut -f1)"

# Docker's legacy builder (Debian's docker.io has no buildx) builds every stage above engine-gpu,
# engine-cpu included: those come from compose-check's images (its cache: the same build args)
# or, on a miss, from its CPU wheelhouse, served where compose-check serves it
CPU_WHEELS=$STATE/wheels
CPU_PORT=${AGENTGW_WHEELS_PORT:-47313}
cpu_wheelhouse "$CPU_WHEELS" || exit 1  # compose-check's (its build args and cache keys are these)
server=""
cpu_server=""
cleanup() {
  rc=$?
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  if [ -n "$cpu_server" ]; then kill "$cpu_server" 2>/dev/null || true; fi
  echo "gpu-image-check: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t0)) s"
  exit "$rc"
}
trap cleanup EXIT
"$PY" -m http.server "$PORT" --bind 127.0.0.1 --directory "$WHEELS" >"$STATE/wheels-gpu-server.log" 2>&1 &
server=$!
"$PY" -m http.server "$CPU_PORT" --bind 127.0.0.1 --directory "$CPU_WHEELS" >"$STATE/wheels-server.log" 2>&1 &
cpu_server=$!
sleep 1
log "building $IMAGE"
DOCKER_BUILDKIT=0 docker build --network host --target engine-gpu -t "$IMAGE" \
  --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELS_URL="http://127.0.0.1:$CPU_PORT/" \
  --build-arg GPU_WHEELS_URL="http://127.0.0.1:$PORT/" . \
  >"$STATE/build-engine-gpu.log" 2>&1 || { tail -30 "$STATE/build-engine-gpu.log" >&2; exit 1; }
log "image size: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"

log "checking the image (no GPU: imports, engine command, vLLM internals)"
docker run --rm --network host --user root -v "$PWD/tests:/checks/tests:ro" -e WHEELS_URL="http://127.0.0.1:$PORT/" \
  --entrypoint sh "$IMAGE" -c '
set -e
[ "$AGENTGW_ENGINE_PLATFORM" = cuda ] || { echo "AGENTGW_ENGINE_PLATFORM=$AGENTGW_ENGINE_PLATFORM, not cuda"; exit 1; }
python3 - <<PY
import json, sys
import importlib.metadata
import torch, vllm, engine_ext.plugin, engine_ext.scheduler
try:  # the CUDA build of Mooncake links the NVIDIA driver library, which only a GPU host has
    import mooncake.store
    mooncake = "imports"
except ImportError as e:
    if "libcuda.so.1" not in str(e):
        raise
    mooncake = "installed, not importable without the NVIDIA driver (libcuda.so.1)"
mooncake = "mooncake-transfer-engine " + importlib.metadata.version("mooncake-transfer-engine") + " " + mooncake
from gateway.local.engines import EngineSpec, engine_command
from engine_ext import config
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
assert "+cpu" not in torch.__version__, torch.__version__
assert vllm.__version__.startswith("0.32.0"), vllm.__version__
spec = EngineSpec(name="e", model_dir="/models/m", served_model_name="m", port=1, log_path="/dev/null",
                  extra_args=("--kv-transfer-config", json.dumps(config.kv_transfer_config(1 << 20))),
                  platform="cuda")
cmd = engine_command(spec)
assert cmd[cmd.index("--scheduler-cls") + 1] == "engine_ext.scheduler.AsyncPinningScheduler", cmd
assert "--enforce-eager" not in cmd, cmd
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, engine_ext imports, {mooncake}")
PY
pip install -q --no-index --find-links "$WHEELS_URL" pytest >/dev/null
cd /checks && python3 -m pytest -q -p no:cacheprovider --noconftest tests/engine_ext/test_device_pins_surface.py
'
