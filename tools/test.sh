#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite. Extra arguments go to pytest (e.g. -m gpu).
# Without CUDA, Triton kernels run under the interpreter and GPU-marked tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m pytest "$@"
