#!/usr/bin/env bash
# The set-up every GPU batch needs before timing anything, then the measurements that answer the open
# questions (bench/NOTES.md, session 5). Run from the project root on the CUDA machine:
#
#   bash bench/gpu_session.sh OUT_DIR [SECTION ...]
#
# * DeepSpeed's wheels from ./.whl (../shared/tools/gpu-wheels.sh fills it) go to /tmp/site when present.
# * Every .py of torch's site-packages, the wheels and this tree is compiled first: a machine without .pyc
#   compiles torch._dynamo, sympy, ... from source inside deepspeed.initialize (3-4 s per process, ~1 s of
#   spread), which made session 4's fresh-process figures worthless.
# * Sections (default: tests demo zero2 zero3, whose time limits add up to more than one 10-minute device call:
#   split them):
#   setup (the set-up alone), tests (pytest -m gpu), demo (--json and profile_demo), zero2 / zero3 (the
#   fresh-process cells), warm (the warm-process benchmarks of issue 15: flatten device tier, defragment probe,
#   kernels' single-call figures), paths (probes/probe_copy_paths: which copy a warm-process flatten should take),
#   tiers (the flatten's evict and host tiers and the defragment's evict tier against the pinned-copy floor),
#   turns (probes/probe_turns: whether a copy in turns overlaps, and the flatten's host profile; the demo's agreements
#   timed part by part).
set -uo pipefail
out=${1:?usage: bash bench/gpu_session.sh OUT_DIR [setup] [tests] [demo] [zero2] [zero3] [warm] [paths] [tiers] [turns]}
shift
sections=" ${*:-tests demo zero2 zero3} "
for section in $sections; do
  case $section in setup|tests|demo|zero2|zero3|warm|paths|tiers|turns) ;; *) echo "unknown section '$section' (setup tests demo zero2 zero3 warm paths tiers turns)" >&2; exit 2;; esac
done
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
python3 -m compileall -q -j 0 ${PYTHONPATH//:/ } "$site" > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
step() { echo "=== $*"; local start=$SECONDS; "$@"; echo "=== exit $? after $((SECONDS - start)) s"; }
want() { [[ "$sections" == *" $1 "* ]]; }
if want tests; then
  step timeout 300 python3 -m pytest -m gpu tests -q -p no:cacheprovider
fi
if want demo; then
  step timeout 120 python3 -m ztriton demo --json "$out/demo.json"
  step timeout 200 python3 bench/profile_demo.py --empty-cache --repeats 15 --top 40 --steps zero_init zero2_optimizer \
    --callees 'min_over_ranks|all_ranks|probe_memory|_build' --out "$out/pstats"
fi
if want zero2; then
  # Warm processes in rounds of key off then key on (8 rounds): the ratio from pairs, not from drifting blocks.
  step timeout 240 python3 bench/bench_coldstart.py --steps zero2 --backends torch triton --warm-repeats 8 \
    --out "$out/coldstart_zero2.json"
fi
if want zero3; then
  step timeout 180 python3 bench/bench_coldstart.py --steps zero3 --backends torch triton --warm-repeats 4 \
    --out "$out/coldstart_zero3.json"
fi
if want warm; then
  step timeout 300 python3 bench/bench_flatten.py --device-only --keep-cache --out "$out"
  step timeout 300 python3 bench/bench_flatten.py --device-only --keep-cache --kernels-loaded \
    --name flatten_h200_kernels_loaded --out "$out"
  step timeout 200 python3 bench/probe_defragment.py --out "$out/defragment_probe.json"
  step timeout 300 python3 bench/bench_kernels.py --out "$out"
fi
if want paths; then
  step timeout 240 python3 bench/probes/probe_copy_paths.py --profile --out "$out/copy_paths.json"
fi
if want tiers; then
  step timeout 300 python3 bench/bench_flatten.py --sizes 8.6 --keep-cache --name flatten_h200_tiers --out "$out"
  step timeout 200 python3 bench/probe_defragment.py --out "$out/defragment_probe.json"
fi
if want turns; then
  step timeout 200 python3 bench/probes/probe_turns.py --out "$out/turns_probe.json"
  step timeout 200 python3 bench/profile_demo.py --empty-cache --repeats 15 --steps zero2_optimizer --no-profile --time-agreements
fi
