#!/usr/bin/env bash
# How long `./scripts/run.sh` takes from a fresh clone until the README's first chat request
# answers: cold (a fresh container of compose-check's base image, Debian bookworm minbase with
# nothing installed: apt, pip's downloads from PyPI and PyTorch's CPU index, the model build,
# the engines' start) and warm (the same container, run again: everything installed and built).
#
#   scripts/start-times.sh [--port P]   (root or docker access; not in CI: it downloads ~1 GB)
#
# The container's pip has no configuration but the host pip's find-links folder, mounted read-only
# when there is one (AGENTGW_FIND_LINKS overrides; on the development machine it holds torch's
# CPU wheel, since PyTorch's index is not reachable from it), and its system CA store gets the
# host's bundle (the development machine reaches PyPI through a TLS-inspecting proxy): everything
# else comes from PyPI and Debian's mirror, into empty caches.
# Starts dockerd when no daemon answers and builds the base image with debootstrap when it is
# missing (scripts/docker-lib.sh, as compose-check does); the container uses the host's network.
# Prints, per run, the seconds to the first answered chat completion, the longest silence of
# run.sh's output (its progress lines) and that output with each line's second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BASE_IMAGE=agentgw-base:bookworm
STATE=.agentgw
port=""
while [ $# -gt 0 ]; do
  case "$1" in
    --port) port=$2; shift 2 ;;
    *) echo "usage: $0 [--port P]" >&2; exit 2 ;;
  esac
done
mkdir -p "$STATE"
log() { echo "start-times: $*"; }
# shellcheck source=scripts/docker-lib.sh
. scripts/docker-lib.sh
ensure_dockerd || exit 1
ensure_base_image || exit 1
[ -n "$port" ] || port=$("$PY" -c 'from gateway.local.engines import free_ports; print(free_ports(1)[0])')
src=$(mktemp -d /tmp/agentgw-start-times.XXXXXX)
trap 'rm -rf "$src"' EXIT
git clone -q . "$src/agentgw"  # a fresh clone of HEAD: nothing git ignores comes along
links=${AGENTGW_FIND_LINKS-$("$PY" -m pip config get global.find-links 2>/dev/null || true)}
mounts=()
if [ -n "$links" ] && [ -d "$links" ]; then mounts=(-v "$links:$links:ro" -e "PIP_FIND_LINKS=$links"); fi
# the host's CA bundle joins the container's system store when its ca-certificates package is
# installed (a network whose TLS-inspecting proxy this host trusts: a machine set up for it)
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/usr/local/share/ca-certificates/agentgw-host.crt:ro)
fi
log "cold and warm runs of ./scripts/run.sh in a fresh $BASE_IMAGE container (port $port; pip find-links: ${links:-none})"
docker run --rm --network host --shm-size 4g -e PORT="$port" "${mounts[@]}" -v "$src/agentgw:/src:ro" "$BASE_IMAGE" bash -c '
set -u
cp -a /src /root/agentgw && cd /root/agentgw
answered() {  # the README snippet'"'"'s request, without the SDK (not installed by the run command)
  [ -x .venv/bin/python ] && .venv/bin/python - "$PORT" >/dev/null 2>&1 <<PY
import json, sys, urllib.request
body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions",
                             data=json.dumps(body).encode(), headers={"content-type": "application/json"})
assert json.loads(urllib.request.urlopen(req, timeout=10).read())["choices"]
PY
}
measure() {
  local t0 now pid
  t0=$(date +%s)
  ./scripts/run.sh --port "$PORT" > >(while IFS= read -r line; do echo "$(( $(date +%s) - t0 )) $line"; done >"/root/$1.log") 2>&1 &
  pid=$!  # run.sh, which becomes `agentgw serve`
  until answered; do
    kill -0 "$pid" 2>/dev/null || { echo "$1: run.sh exited"; cat "/root/$1.log"; exit 1; }
    sleep 1
  done
  now=$(date +%s)
  kill -TERM "$pid"; wait "$pid" || true; sleep 1
  echo "== $1: first chat answered after $((now - t0)) s; longest silence of the output: $(awk "BEGIN{p=0;m=0} {if (\$1-p>m) m=\$1-p; p=\$1} END{print m}" "/root/$1.log") s"
  cat "/root/$1.log"
}
measure cold
measure warm
'
