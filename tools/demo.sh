#!/usr/bin/env bash
# Set up .venv if needed, then run the demo on the built-in model (GPU if present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m ztriton demo "$@"
