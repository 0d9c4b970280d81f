#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv and install ztriton with its test extras.
#
# A torch that the chosen Python already has (a GPU user's CUDA build) is kept: the venv sees the
# system site-packages, and pip leaves a requirement that is already satisfied alone. Only where no
# torch is importable is torch 2.13.0 installed. DeepSpeed builds no ops here (DS_BUILD_OPS=0) and
# installs without build isolation, so that its setup sees the torch above instead of pulling another.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
pip_install() { "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "[setup] no torch found: installing torch 2.13.0"
  pip_install "torch==2.13.0"
fi
if ! "$VPY" -c "import deepspeed" 2>/dev/null; then
  echo "[setup] installing deepspeed 0.19.8 (no ops built)"
  pip_install "setuptools>=69" wheel ninja packaging psutil py-cpuinfo hjson msgpack pydantic tqdm nvidia-ml-py
  DS_BUILD_OPS=0 pip_install --no-build-isolation "deepspeed==0.19.8"
fi
# Reinstall only when what the install is made of changed (pip takes ~6 s even when nothing did): the
# package metadata and the start-up hook files. The stamp lives in .venv, so a fresh venv installs.
stamp=.venv/.ztriton-install-stamp
want=$(cat pyproject.toml tools/build_autoload.py tools/ztriton-autoload.pth | "$VPY" -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VPY" -c "import importlib.metadata as m; m.distribution('ztriton')" 2>/dev/null; then
  echo "[setup] installing ztriton (editable, with its start-up hook) and its test extras"
  rm -f "$stamp"
  pip_install --no-build-isolation -e ".[test]"
  "$VPY" -c "import importlib.metadata as m; m.distribution('ztriton')" || { echo "[setup] ztriton did not install" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
"$VPY" -c "import torch, triton, deepspeed, ztriton.kernels; print('[setup] torch', torch.__version__, '| triton', triton.__version__, '| deepspeed', deepspeed.__version__)" 2>&1 | grep '^\[setup\]' \
  || { echo "[setup] torch, triton, deepspeed or ztriton does not import in .venv" >&2; exit 1; }
