# Shared by scripts/compose-check.sh and scripts/gpu-image-check.sh (sourced, not run): the Docker
# daemon, the debootstrapped base image and the CPU wheelhouse, each made only when missing.
# Expects: STATE (the git-ignored state folder), PY (the project's Python), BASE_IMAGE, and a
# `log` function. Callers run each as `f || exit 1` (set -e does not reach inside them there).

# shellcheck source=scripts/net-retry.sh
. "$(dirname "${BASH_SOURCE[0]}")/net-retry.sh"

# Start dockerd in the background when no daemon answers (log $STATE/dockerd.log).
ensure_dockerd() {
  docker info >/dev/null 2>&1 && return 0
  command -v dockerd >/dev/null || { echo "no dockerd (scripts/setup.sh --test installs docker.io)" >&2; return 1; }
  log "starting dockerd"
  # the daemon outlives this script: it must not inherit the caller's descriptors beyond 0-2,
  # or it holds what they hold for ever (the flock of `flock /tmp/agentgw-heavy.lock
  # scripts/compose-check.sh`: every later job waiting on that lock waited on dockerd)
  (
    for fd in /proc/self/fd/*; do n=${fd##*/}; [ "$n" -gt 2 ] 2>/dev/null && eval "exec $n>&-"; done
    exec setsid dockerd
  ) >"$STATE/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; return 1; }
}

# Debian bookworm from Debian's packages as $BASE_IMAGE (no registry needed).
ensure_base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return 0
  log "building $BASE_IMAGE (debootstrap)"
  local rootfs
  rootfs=$(mktemp -d /tmp/agentgw-rootfs.XXXXXX)
  net_retry _debootstrap "$rootfs" >"$STATE/debootstrap.log" 2>&1 \
    || { tail -20 "$STATE/debootstrap.log" >&2; rm -rf "$rootfs"; return 1; }
  tar -C "$rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null || { rm -rf "$rootfs"; return 1; }
  rm -rf "$rootfs"
}

# One debootstrap into an emptied $1 (a failed try leaves a partial tree behind).
_debootstrap() {
  rm -rf "$1" && mkdir -p "$1"
  debootstrap --variant=minbase bookworm "$1" http://deb.debian.org/debian
}

# Every wheel the CPU images install, resolved by this machine's pip, in $1 (once per pyproject.toml).
# A retry keeps the wheels already downloaded into $1 (pip skips them) and fetches the rest.
cpu_wheelhouse() {
  local dir=$1 want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  [ "$(cat "$dir/.stamp" 2>/dev/null)" = "$want" ] && return 0
  log "downloading the wheelhouse into $dir"
  rm -rf "$dir" && mkdir -p "$dir"
  # async-timeout: redis needs it below Python 3.11.3 (Debian's is 3.11.2); pip evaluates markers
  # for the interpreter it runs on, not the image's
  net_retry "$PY" -m pip download -q --only-binary=:all: -d "$dir" "torch==2.13.0+cpu" ".[engine,store]" \
    "setuptools>=77" wheel pip "async-timeout>=4.0.3" >"$STATE/wheels.log" 2>&1 \
    || { tail -30 "$STATE/wheels.log" >&2; return 1; }
  echo "$want" > "$dir/.stamp"
}
