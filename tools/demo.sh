#!/usr/bin/env bash
# Set up a venv if needed, then run the demo on the built-in model (GPU if present, else CPU).
#   bash tools/demo.sh                        .venv (the torch you have, else 2.13.0)
#   ZTRITON_STACK=newest bash tools/demo.sh   .venv-newest, pinned by tools/stacks/newest.txt (also: seed)
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash tools/setup_env.sh | tail -n 1)
exec "$VPY" -m ztriton demo "$@"
