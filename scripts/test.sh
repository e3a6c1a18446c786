#!/usr/bin/env bash
# The tests. Three forms:
#
#   ./scripts/test.sh           set up everything the tests need (scripts/setup.sh --test), then
#                               ruff, mypy, the whole suite, engine_ext's engine-less tests
#                               against the newest vLLM (scripts/vllm-latest-lane.sh, beside the
#                               suite at idle priority) and
#                               scripts/compose-check.sh (the images, built beside the suite, and
#                               docker-compose.yml's cpu and replicas profiles). CI runs exactly this. The suite runs in two phases: every test that needs
#                               no engine or Mooncake on 2 pytest-xdist workers, then the tests
#                               that start real vLLM engines or share the mooncake_master
#                               (markers engine, store) and those xdist cannot run (serial) in
#                               one process, one set of engines at a time.
#   ./scripts/test.sh --fast    on an already set-up checkout: ruff, mypy and every test that
#                               needs no engine, Redis, Mooncake or Docker, on 2 pytest-xdist
#                               workers; no setup, no compose-check.
#   ./scripts/test.sh ARGS...   set up, ruff, mypy, then pytest with ARGS (e.g. a file, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${AGENTGW_TEST_WORKERS:-2}
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
lint() {
  .venv/bin/ruff check gateway engine_ext kernels benchmarks tests testing deploy scripts
  .venv/bin/mypy
}
if [ "${1:-}" = "--fast" ]; then
  shift
  lint
  FAST="not engine and not store and not redis and not docker"
  rc=0
  "${PYTEST[@]}" -n "$WORKERS" --dist loadfile -m "$FAST and not serial" "$@" || rc=$?
  "${PYTEST[@]}" -m "$FAST and serial" "$@" || rc=$?
  exit "$rc"
fi
./scripts/setup.sh --test
lint
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# the whole suite, as CI runs it: the tests that need no engine or Mooncake on 2 workers, then the
# engine and Mooncake tests in one process (one set of engines at a time), then docker-compose.yml
# run. Its images are built meanwhile (scripts/compose-check.sh --build: mostly downloads, wheel
# unpacking and Docker's layer writes, in the background at low priority); nothing else runs beside
# the pytest phases: beside the engine tests, gateways under test were starved for seconds
# (probes with timeouts of seconds failed).
logs=$(mktemp -d)
rc_rest=0 rc_engines=0 rc_build=0 rc_lane=0
nice -n 15 ./scripts/compose-check.sh --build >"$logs/compose-build.log" 2>&1 &
build=$!
# engine_ext against the newest vLLM (scripts/vllm-latest-lane.sh): its environment (downloads and
# unpacking, ~4 min, ~9.5 GB), then its engine-less tests (~40 s), meanwhile at idle priority
ionice -c 3 nice -n 15 bash scripts/vllm-latest-lane.sh >"$logs/lane.log" 2>&1 &
lane=$!
"${PYTEST[@]}" -n "$WORKERS" --dist loadfile -m "not engine and not store and not serial" --durations=10 2>&1 | tee "$logs/rest.log" || rc_rest=$?
"${PYTEST[@]}" -m "engine or store or serial" --durations=15 2>&1 | tee "$logs/engines.log" || rc_engines=$?
# the two runs' counts in one closing line
.venv/bin/python - "$logs"/rest.log "$logs"/engines.log <<'PY'
import re, sys
total = {"passed": 0, "failed": 0, "errors": 0}
for path in sys.argv[1:]:
    lines = [l for l in open(path, errors="replace") if re.search(r"\d+ (passed|failed)", l)]
    for n, what in re.findall(r"(\d+) (passed|failed|errors?)\b", lines[-1] if lines else ""):
        total["errors" if what.startswith("error") else what] += int(n)
print(f"suite: {total['passed']} passed, {total['failed'] + total['errors']} failed")
PY
wait "$lane" || rc_lane=$?
grep '^lane: ' "$logs/lane.log" || true
[ "$rc_lane" = 0 ] || cat "$logs/lane.log"
wait "$build" || rc_build=$?
cat "$logs/compose-build.log"
if [ "$rc_rest" != 0 ] || [ "$rc_engines" != 0 ] || [ "$rc_build" != 0 ] || [ "$rc_lane" != 0 ]; then exit 1; fi
./scripts/compose-check.sh --run
