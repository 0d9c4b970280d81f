#!/usr/bin/env bash
# Create (once) a virtual environment and install ztriton with its test extras into it.
#
#   bash tools/setup_env.sh            .venv: the torch the chosen Python already has (a GPU user's CUDA
#                                      build) is kept -- the venv sees the system site-packages, and pip
#                                      leaves a requirement that is already satisfied alone. Only where no
#                                      torch is importable is torch 2.13.0 installed.
#   ZTRITON_STACK=newest bash ...      .venv-newest: exactly the versions pinned in tools/stacks/newest.txt
#   ZTRITON_STACK=seed bash ...        .venv-seed: tools/stacks/seed.txt (the CI matrix runs both)
#
# DeepSpeed builds no ops here (DS_BUILD_OPS=0) and installs without build isolation, so that its setup sees
# the torch above instead of pulling another. Prints the path of the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STACK=${ZTRITON_STACK:-}
if [ -n "$STACK" ]; then
  pins="tools/stacks/$STACK.txt"
  [ -f "$pins" ] || { echo "[setup] unknown ZTRITON_STACK=$STACK: no $pins (known: $(ls tools/stacks | sed 's/\.txt//' | xargs))" >&2; exit 2; }
  VENV=.venv-$STACK
  # The stack's pins are pip's constraints: they replace any machine-wide constraint file (a cap below them).
  export PIP_CONSTRAINT="$PWD/$pins"
  venv_flags=()
  # torch and the rest of the stack first, DeepSpeed (built against that torch) after
  first=$(mktemp); grep -v '^deepspeed' "$pins" > "$first"; trap 'rm -f "$first"' EXIT
  first_reqs=(-r "$first")
  ds_req=deepspeed
else
  pins=""
  VENV=.venv
  venv_flags=(--system-site-packages)
  first_reqs=("torch==2.13.0")
  ds_req="deepspeed==0.19.8"
fi
VPY=$VENV/bin/python
if [ ! -x "$VPY" ]; then
  echo "[setup] creating $VENV with $($PY --version)${STACK:+ for the stack '$STACK'}" >&2
  "$PY" -m venv "${venv_flags[@]}" "$VENV"
fi
# Whether every package pinned by the stack is installed at its pinned version ("report": say which are not).
pins_hold() {
  "$VPY" - "$pins" "${1:-}" <<'EOF'
import importlib.metadata as m, sys
wrong = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        try:
            have = m.version(name)
        except m.PackageNotFoundError:
            have = "missing"
        if have.split("+")[0] != version:
            wrong.append(f"{name} {have} (pinned {version})")
if wrong and sys.argv[2] == "report":
    print("  " + ", ".join(wrong))
sys.exit(1 if wrong else 0)
EOF
}
pip_install() { "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" >&2 || true; }
if ! "$VPY" -c "import torch" 2>/dev/null || { [ -n "$pins" ] && ! pins_hold; }; then
  echo "[setup] no torch found (or the stack's pins do not hold): installing ${first_reqs[*]}" >&2
  pip_install "${first_reqs[@]}"
fi
if ! "$VPY" -c "import deepspeed" 2>/dev/null; then
  echo "[setup] installing $ds_req (no ops built)" >&2
  pip_install "setuptools>=69" wheel ninja packaging psutil py-cpuinfo hjson msgpack pydantic tqdm nvidia-ml-py
  DS_BUILD_OPS=0 pip_install --no-build-isolation "$ds_req"
fi
# Reinstall only when what the install is made of changed (pip takes ~6 s even when nothing did): the
# package metadata, the stack's pins and the start-up hook files. The stamp lives in the venv.
stamp=$VENV/.ztriton-install-stamp
want=$(cat pyproject.toml tools/build_autoload.py tools/ztriton-autoload.pth $pins | "$VPY" -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VPY" -c "import importlib.metadata as m; m.distribution('ztriton')" 2>/dev/null; then
  echo "[setup] installing ztriton (editable, with its start-up hook) and its test extras" >&2
  rm -f "$stamp"
  pip_install --no-build-isolation -e ".[test]"
  "$VPY" -c "import importlib.metadata as m; m.distribution('ztriton')" || { echo "[setup] ztriton did not install" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
"$VPY" -c "import torch, triton, deepspeed, transformers, ztriton.kernels; print('[setup]', '$VENV:', 'torch', torch.__version__, '| triton', triton.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__)" 2>&1 | grep '^\[setup\]' >&2 \
  || { echo "[setup] torch, triton, deepspeed, transformers or ztriton does not import in $VENV" >&2; exit 1; }
if [ -n "$pins" ] && ! pins_hold; then
  echo "[setup] $VENV does not hold the stack's pins:" >&2; pins_hold report >&2; exit 1
fi
echo "$VPY"
