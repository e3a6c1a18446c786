#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the gateway. With no arguments: builds the tiny local model,
# starts 3 local vLLM engines (the default layout, one pool) and serves on http://127.0.0.1:8000.
# Arguments go to `agentgw serve` (e.g. --config agentgw.yaml, --engine URL, --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/agentgw serve "$@"
