#!/usr/bin/env bash
# Install the tools the benchmarks need beyond scripts/setup.sh (run by `make bench`):
# - wrk (Debian's package): the load generator of benchmarks/overhead.py;
# - vllm-router 0.1.17 (PyPI) in its own virtual environment .bench-venv, where
#   benchmarks/overhead.py looks for it (`--peers vllm-router`); it is not a project dependency.
# With --with-dynamo also ai-dynamo 1.6.1 in .dynamo-venv (Python 3.10, ~630 MB) for
# `benchmarks.compare --with-dynamo` (docs/benchmarks_sim.md). benchmarks/aiperf_run.sh installs
# its own aiperf venv. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/progress.sh
. scripts/progress.sh  # step: a line every 10 s while an install runs, its output in a log
: "${HOME:=$(getent passwd "$(id -u)" | cut -d: -f6)}"
LOGS=${AGENTGW_HOME:-$HOME/.cache/agentgw}/logs
STEP_PREFIX=bench-setup

VLLM_ROUTER_VERSION=0.1.17
DYNAMO_VERSION=1.6.1
with_dynamo=0
for arg in "$@"; do
  case "$arg" in
    --with-dynamo) with_dynamo=1 ;;
    *) echo "usage: $0 [--with-dynamo]" >&2; exit 2 ;;
  esac
done

SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
if ! command -v wrk >/dev/null 2>&1; then
  step bench-apt "installing wrk (apt)" bash -c \
    "$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y wrk"
fi

PY=${PYTHON:-python3}
pip_version() {  # the version of distribution $2 in the venv $1, or nothing
  [ -x "$1/bin/python" ] && "$1/bin/python" -c \
    'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$2" || true
}
if [ "$(pip_version .bench-venv vllm-router)" != "$VLLM_ROUTER_VERSION" ] || [ ! -x .bench-venv/bin/vllm-router ]; then
  [ -x .bench-venv/bin/python ] || "$PY" -m venv .bench-venv
  step bench-router "installing vllm-router $VLLM_ROUTER_VERSION into .bench-venv" \
    .bench-venv/bin/python -m pip install "vllm-router==$VLLM_ROUTER_VERSION"
fi

if [ "$with_dynamo" = 1 ] && [ "$(pip_version .dynamo-venv ai-dynamo)" != "$DYNAMO_VERSION" ]; then
  PY310=${DYNAMO_PYTHON_BASE:-}
  # a pyenv shim on PATH fails unless 3.10 is a selected version: take the first that runs
  for c in $(command -v python3.10 || true) "$HOME"/.pyenv/versions/3.10*/bin/python3.10 /usr/bin/python3.10; do
    [ -n "$PY310" ] && break
    if [ -x "$c" ] && "$c" -c 'import sys' >/dev/null 2>&1; then PY310=$c; fi
  done
  if [ -z "$PY310" ]; then
    echo "bench-setup: --with-dynamo needs a Python 3.10 (set DYNAMO_PYTHON_BASE)" >&2
    exit 1
  fi
  [ -x .dynamo-venv/bin/python ] || "$PY310" -m venv .dynamo-venv
  step bench-dynamo "installing ai-dynamo $DYNAMO_VERSION into .dynamo-venv (~630 MB)" \
    .dynamo-venv/bin/python -m pip install "ai-dynamo==$DYNAMO_VERSION"
fi
