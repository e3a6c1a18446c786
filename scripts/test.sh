#!/usr/bin/env bash
# The tests. Three forms:
#
#   ./scripts/test.sh           set up everything the tests need (scripts/setup.sh --test), then
#                               ruff, mypy, the whole suite and scripts/compose-check.sh (the
#                               images and docker-compose.yml's cpu and replicas profiles). CI runs
#                               exactly this. The suite runs as two pytest processes side by side,
#                               one per core: the tests that start real vLLM engines or share the
#                               mooncake_master (markers engine, store), in order, one set of
#                               engines at a time; and every other test. Then the tests marked
#                               quiet (liveness against timeouts of seconds) run alone.
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
  exec "${PYTEST[@]}" -n "$WORKERS" --dist loadfile -m "not engine and not store and not redis and not docker" "$@"
fi
./scripts/setup.sh --test
lint
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# the whole suite, as CI runs it: two lanes side by side, then docker-compose.yml built and run
logs=$(mktemp -d)
"${PYTEST[@]}" -m "(engine or store) and not quiet" --durations=15 >"$logs/engines.log" 2>&1 &
engines=$!
"${PYTEST[@]}" -m "not engine and not store and not quiet" --durations=10 >"$logs/rest.log" 2>&1 &
rest=$!
t0=$SECONDS
while kill -0 "$engines" 2>/dev/null || kill -0 "$rest" 2>/dev/null; do
  sleep 60
  echo "test.sh: $(( (SECONDS - t0) / 60 )) min; engines lane: $(tail -c 120 "$logs/engines.log" | tr '\n' ' ' | tail -c 60); other lane: $(tail -c 120 "$logs/rest.log" | tr '\n' ' ' | tail -c 60)"
done
rc_rest=0 rc_engines=0
wait "$rest" || rc_rest=$?
wait "$engines" || rc_engines=$?
echo "== tests that need no engine or Mooncake (exit $rc_rest) =="
cat "$logs/rest.log"
echo "== engine and Mooncake tests (exit $rc_engines) =="
cat "$logs/engines.log"
echo "== tests that need the machine to themselves (quiet) =="
rc_quiet=0
"${PYTEST[@]}" -m quiet 2>&1 | tee "$logs/quiet.log" || rc_quiet=$?
# the three runs' counts in one closing line
.venv/bin/python - "$logs"/rest.log "$logs"/engines.log "$logs"/quiet.log <<'PY'
import re, sys
total = {"passed": 0, "failed": 0, "errors": 0}
for path in sys.argv[1:]:
    lines = [l for l in open(path, errors="replace") if re.search(r"\d+ (passed|failed)", l)]
    for n, what in re.findall(r"(\d+) (passed|failed|errors?)\b", lines[-1] if lines else ""):
        total["errors" if what.startswith("error") else what] += int(n)
print(f"suite: {total['passed']} passed, {total['failed'] + total['errors']} failed")
PY
if [ "$rc_rest" != 0 ] || [ "$rc_engines" != 0 ] || [ "$rc_quiet" != 0 ]; then exit 1; fi
./scripts/compose-check.sh
