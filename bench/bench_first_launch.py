"""A fresh process's first kernel launch: from the compiled cache, through Triton's JIT (its cache warm or empty),
and torch's copies, each in its own fresh process, rounds interleaved.

``python bench/bench_first_launch.py [--rounds 3] [--pieces 700] [--out bench/results/first_launch.json]``

Each child imports torch and ztriton, initialises CUDA and builds ``--pieces`` bf16 sources (1,000-1,384
elements, gaps between them), then times its first ``pack`` (planning, table upload, launch, synchronised) and a
second one, checks the bytes against torch's reference, and reports the launches and whether triton was imported.
Cells: ``cache`` (``python -m ztriton compile`` ran first: the binaries load without triton), ``cache_triton_cold``
(the same with Triton's own cache empty), ``jit_warm`` (``ZTRITON_COMPILED=0``, Triton's cache warm: the old
first launch), ``jit_cold`` (Triton's cache empty: it compiles), ``torch`` (torch's copies for every piece).
The compile step's own time is recorded too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import torch
from ztriton.kernels import Tuning, bits, pack, pack_plan, state, torch_pack
device = torch.device("cuda", 0)
torch.zeros(1, device=device)
n = int(sys.argv[1]); route = sys.argv[2]
sources = [torch.randn(1000 + (i % 7) * 64, device=device).to(torch.bfloat16) for i in range(n)]
offsets, at = [], 0
for s in sources:
    offsets.append(at)
    at += s.numel() + 8
dst = torch.full((at,), float("nan"), dtype=torch.bfloat16, device=device)
tuning = Tuning(torch_pieces=10 ** 9) if route == "torch" else Tuning()
run = lambda: pack_plan(dst, sources, offsets, tuning=tuning).launch()
torch.cuda.synchronize()
times = []
for _ in range(2):
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - start) * 1e3)
expected = torch.empty_like(dst)
torch_pack(expected, sources, offsets)
assert torch.equal(bits(dst), bits(expected)), "bytes differ"
print("RESULT" + json.dumps(dict(first_ms=times[0], second_ms=times[1], launches=state.launches(),
                                 triton_imported="triton" in sys.modules)))
"""


def child(pieces: int, route: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(pieces), route], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{route}: {out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(out.stdout.split("RESULT", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pieces", type=int, default=700)
    parser.add_argument("--cold-rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "first_launch.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="first_launch_"))
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base.update(ZTRITON_BACKGROUND_COMPILE="0", ZTRITON_CACHE_DIR=str(work / "ztriton"),
                TRITON_CACHE_DIR=str(work / "triton_warm"))
    figures: dict = {"pieces": args.pieces, "python": sys.version.split()[0]}
    import torch

    figures["device"] = torch.cuda.get_device_name(0)
    figures["torch"] = torch.__version__
    from ztriton.kernels import cache

    figures["triton"] = cache.triton_version()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ztriton", "compile"], capture_output=True, text=True, env=base,
                          cwd=ROOT, timeout=600)
    figures["compile_s"] = time.perf_counter() - start
    figures["compile_output"] = (done.stdout + done.stderr)[-600:]
    print(f"python -m ztriton compile: {figures['compile_s']:.1f} s, {done.stdout.strip()}", flush=True)
    jit = dict(base, ZTRITON_COMPILED="0")
    child(args.pieces, "kernels", jit)  # fills Triton's own cache (the warm cells)
    cells: dict[str, list] = {}
    for r in range(args.rounds):
        for name, env in (("cache", base), ("jit_warm", jit), ("torch", base),
                          ("cache_triton_cold", dict(base, TRITON_CACHE_DIR=str(work / f"cold_a{r}"))),
                          ("jit_cold", dict(jit, TRITON_CACHE_DIR=str(work / f"cold_b{r}")))):
            if name == "jit_cold" and r >= args.cold_rounds:
                continue
            result = child(args.pieces, "torch" if name == "torch" else "kernels", env)
            cells.setdefault(name, []).append(result)
            print(f"round {r} {name:18s} first {result['first_ms']:8.2f} ms  second {result['second_ms']:6.2f} ms  "
                  f"launches {result['launches']}  triton imported {result['triton_imported']}", flush=True)
    figures["cells"] = cells
    figures["median_first_ms"] = {k: statistics.median(c["first_ms"] for c in v) for k, v in cells.items()}
    figures["median_second_ms"] = {k: statistics.median(c["second_ms"] for c in v) for k, v in cells.items()}
    print(json.dumps({k: figures[k] for k in ("median_first_ms", "median_second_ms")}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
