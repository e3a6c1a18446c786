#!/usr/bin/env bash
# Set up what running needs (scripts/setup.sh: a .venv with the gateway and vLLM for CPUs) and run
# the gateway. With no arguments: builds the tiny local model, starts 3 local vLLM engines (the
# default layout, one pool) and serves on http://127.0.0.1:8000 while they start; it says what it
# is doing at least every 10 s, and once the engines are up, where to point an SDK, Claude Code
# and Codex. Arguments go to `agentgw serve` (e.g. --config agentgw.yaml, --engine URL, --port 9000).
# Logs: ~/.cache/agentgw/logs (AGENTGW_HOME).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/agentgw serve "$@"
