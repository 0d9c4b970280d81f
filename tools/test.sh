#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite. Extra arguments go to pytest (e.g. -m gpu).
# Without CUDA, Triton kernels run under the interpreter and GPU-marked tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# Only the pytest plugins the suite uses: the venv sees the system site-packages, whose unrelated
# plugins (anyio, benchmark, ...) would otherwise load too. hypothesis registers as one.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
exec .venv/bin/python -m pytest -p hypothesispytest "$@"
