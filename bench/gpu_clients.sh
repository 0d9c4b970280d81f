#!/usr/bin/env bash
# On a CUDA machine, from the project root: the HF Trainer recipe of examples/ through torchrun on one GPU, ZeRO-3
# and ZeRO-2, key on (the recipe's config) and key off (the same without "partition_backend"), on a tiny Mixtral
# that tests/hf_models.py writes. ztriton is pip-installed first so that its start-up hook (not an import in the
# script) turns the key on, as for a user. Prints each run's ztriton lines and losses; logs go to OUT_DIR.
# STAGES (default "3 2") picks the ZeRO stages, KEYS (default "on off") the key settings; EXPERTS the Mixtral's experts (default 4: each loaded tensor is a
# job of at most 8 pieces; 16 makes the fused expert tensors jobs of 32 and 16 pieces, the kernels' route).
#
#   bash bench/gpu_clients.sh OUT_DIR
set -uo pipefail
out=$(realpath -m "${1:?usage: bash bench/gpu_clients.sh OUT_DIR}")
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --no-index . > "$out/install.log" 2>&1 \
  || { echo "pip install . failed:"; tail -20 "$out/install.log"; exit 1; }
work=$(mktemp -d)
python3 - "$work" <<'PY'
import os, sys
from pathlib import Path
sys.path.insert(0, "tests")
import hf_models
experts = {"num_local_experts": int(os.environ["EXPERTS"])} if os.environ.get("EXPERTS") else {}
hf_models.save_checkpoint("mixtral", Path(sys.argv[1]) / "mixtral", intermediate_size=16, **experts)
PY
cd examples
for stage in ${STAGES:-3 2}; do
  python3 -c "import json, sys; c = json.load(open('ds_zero$stage.json')); c.pop('partition_backend'); json.dump(c, open(sys.argv[1], 'w'))" "$work/off_zero$stage.json"
  for key in ${KEYS:-on off}; do
    config=ds_zero$stage.json; [ "$key" = off ] && config=$work/off_zero$stage.json
    log=$out/trainer_zero${stage}_key_$key.log
    start=$SECONDS
    timeout 300 python3 -m torch.distributed.run --nproc-per-node 1 trainer_deepspeed.py "$work/mixtral" \
      "$work/out_${stage}_$key" --deepspeed "$config" > "$log" 2>&1
    echo "=== Trainer ZeRO-$stage key $key: exit $? after $((SECONDS - start)) s"
    grep "ztriton" "$log" | cut -c1-220
    grep -oE "'loss': '?[0-9.]+" "$log" | tr -d "'" | xargs
  done
done
