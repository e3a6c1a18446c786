#!/usr/bin/env bash
# Set up everything the tests need (scripts/setup.sh --test) and run the whole test suite: real vLLM engines on tiny local models,
# a real redis-server and mooncake_master, all started by the tests on loopback and stopped; then
# scripts/compose-check.sh (the images and docker-compose.yml's cpu and replicas profiles).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
.venv/bin/ruff check gateway engine_ext kernels benchmarks tests
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
# the whole suite (no arguments, as CI runs it): then docker-compose.yml, built and run for real
if [ $# -eq 0 ]; then ./scripts/compose-check.sh; fi
