# Sourced by scripts/setup.sh and scripts/bench-setup.sh (not run). Needs LOGS (the folder for the logs); EVERY (seconds
# between progress lines, default 10) and STEP_PREFIX (default "setup") may be set.
#
# step NAME WHAT CMD...: run CMD with its output in $LOGS/setup-NAME.log, saying every $EVERY s
# how long it has run and the log's last line; on failure print the log's end and exit.
step() {
  local name=$1 what=$2
  shift 2
  local log="$LOGS/setup-$name.log" t0=$SECONDS next=${EVERY:-10} pid rc=0
  mkdir -p "$LOGS"
  : >"$log"
  echo "${STEP_PREFIX:-setup}: $what (log $log)"
  "$@" >>"$log" 2>&1 </dev/null &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if [ $((SECONDS - t0)) -ge "$next" ] && kill -0 "$pid" 2>/dev/null; then
      echo "${STEP_PREFIX:-setup}: $what: $((SECONDS - t0)) s; $(last_line "$log")"
      next=$((next + ${EVERY:-10}))
    fi
  done
  wait "$pid" || rc=$?
  if [ "$rc" != 0 ]; then
    echo "${STEP_PREFIX:-setup}: $what FAILED (exit $rc); the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit "$rc"
  fi
  echo "${STEP_PREFIX:-setup}: $what: done in $((SECONDS - t0)) s"
}
last_line() {  # the last non-empty line of log $1 (progress bars rewrite one line with \r)
  tail -c 4000 "$1" | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-110 || true
}

