#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: real vLLM engines on tiny local models,
# a real redis-server and mooncake_master, all started by the tests on loopback and stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check gateway engine_ext kernels benchmarks tests
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
