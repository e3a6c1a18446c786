#!/usr/bin/env bash
# The tests. Three forms:
#
#   ./scripts/test.sh           set up everything the tests need (scripts/setup.sh --test), then
#                               ruff, mypy, the whole suite and scripts/compose-check.sh (the
#                               images and docker-compose.yml's cpu and replicas profiles). CI runs
#                               exactly this. The suite runs on 2 pytest-xdist workers: the tests
#                               that start real vLLM engines or share the mooncake_master all on
#                               one worker, in order (one set of engines at a time), every other
#                               test module on either worker.
#   ./scripts/test.sh --fast    on an already set-up checkout: ruff, mypy and every test that
#                               needs no engine, Redis, Mooncake or Docker, on 2 workers; no setup,
#                               no compose-check.
#   ./scripts/test.sh ARGS...   set up, ruff, mypy, then pytest with ARGS (e.g. a file, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${AGENTGW_TEST_WORKERS:-2}
lint() {
  .venv/bin/ruff check gateway engine_ext kernels benchmarks tests testing deploy scripts
  .venv/bin/mypy
}
if [ "${1:-}" = "--fast" ]; then
  shift
  lint
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadgroup \
    -m "not engine and not store and not redis and not docker" "$@"
fi
./scripts/setup.sh --test
lint
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
# the whole suite, as CI runs it: then docker-compose.yml, built and run for real
.venv/bin/python -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadgroup --durations=25
./scripts/compose-check.sh
