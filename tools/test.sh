#!/usr/bin/env bash
# Set up a venv if needed, then run the test suite. Extra arguments go to pytest (e.g. -m gpu).
#   bash tools/test.sh                        .venv (the torch you have, else 2.13.0)
#   ZTRITON_STACK=newest bash tools/test.sh   .venv-newest, pinned by tools/stacks/newest.txt (also: seed)
# Without CUDA, Triton kernels run under the interpreter and GPU-marked tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash tools/setup_env.sh | tail -n 1)
# Only the pytest plugins the suite uses: a venv that sees the system site-packages would otherwise load
# their unrelated plugins (anyio, benchmark, ...) too. hypothesis registers as one.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
exec "$VPY" -m pytest -p hypothesispytest "$@"
