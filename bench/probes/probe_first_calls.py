"""What a copy costs the first time a process makes it: each way in its own fresh process, after the LLM mix is
built on the device (as ``bench_coldstart.py``'s ZeRO-2 cell builds it), timed on its first call and again.

    python bench/probes/probe_first_calls.py [--repeats 2] [--ways ds-cat pack] [--out bench/results/first_calls.json]

Ways: ``ds-cat`` (DeepSpeed's flatten: ``torch.cat`` of every param), ``pack`` (``ztriton.kernels.pack`` of
every param into a fresh buffer, on torch's route: no kernel loaded), ``pack-precat`` (the same after one tiny
``torch.cat(out=)`` of 200 int64 tensors on the device, untimed: whether loading torch's cat kernel is what the
pack's first call pays beyond its second), and the 400 small params of the mix copied
by ``foreach-int64`` (``_foreach_copy_`` of 8-byte-word views in batches of 64, as torch's route does),
``foreach-native`` (the same in bf16) and ``copy-each`` (one ``copy_`` each: contiguous same-dtype copies are
``cudaMemcpyAsync``, so no kernel to load). Session 11 found ``_foreach_copy_`` taking 14-36 ms in a fresh
process's flatten, against DeepSpeed's whole flatten at 8 ms.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WAYS = ("ds-cat", "pack", "pack-precat", "foreach-int64", "foreach-native", "copy-each")


def _small_copy(way: str, sources, dst) -> None:
    import torch

    outs = list(dst[: sum(s.numel() for s in sources)].split([s.numel() for s in sources]))
    ins = [s.view(-1) for s in sources]
    if way == "foreach-int64":
        outs, ins = [o.view(torch.int64) for o in outs], [i.view(torch.int64) for i in ins]
    if way == "copy-each":
        for o, i in zip(outs, ins):
            o.copy_(i)
        return
    for start in range(0, len(outs), 64):
        torch._foreach_copy_(outs[start:start + 64], ins[start:start + 64])


def run_way(way: str) -> dict:
    import torch

    from bench.models import LLMMix, llm_mix

    model = LLMMix(llm_mix(), 50, dtype=torch.bfloat16, device="cuda")
    params = list(model.parameters())
    small = [p for p in params if p.dim() == 1]
    torch.cuda.synchronize()
    import gc

    gc.collect()  # a full collection (0.1-0.2 s in this process) must not land inside a timed call
    if way == "pack-precat":
        tiny = [torch.zeros(16, dtype=torch.int64, device="cuda") for _ in range(200)]
        torch.cat(tiny, out=torch.empty(16 * 200, dtype=torch.int64, device="cuda"))
        torch.cuda.synchronize()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with torch.no_grad():
            if way == "ds-cat":
                from torch._utils import _flatten_dense_tensors

                out = _flatten_dense_tensors(params)
            elif way in ("pack", "pack-precat"):
                from ztriton.kernels import pack

                numels = [p.numel() for p in params]
                offsets = [sum(numels[:i]) for i in range(len(numels))]
                out = pack(torch.empty(sum(numels), dtype=torch.bfloat16, device="cuda"), params, offsets, fresh=True)
            else:
                out = torch.empty(sum(p.numel() for p in small), dtype=torch.bfloat16, device="cuda")
                _small_copy(way, small, out)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del out
    return {"way": way, "first_ms": times[0] * 1e3, "second_ms": times[1] * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.way:
        print("RESULT " + json.dumps(run_way(args.way)), flush=True)
        return 0
    runs = []
    for _ in range(args.repeats):
        for way in args.ways:  # alternating: the host drifts
            proc = subprocess.run([sys.executable, __file__, "--way", way], capture_output=True, text=True, timeout=300)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            result = json.loads(found[-1][7:]) if found else {"way": way, "error": (proc.stdout + proc.stderr)[-2000:]}
            runs.append(result)
            print(json.dumps(result), flush=True)
    if args.out:
        from bench.harness import write_result

        print(f"wrote {write_result(args.out.stem, {'runs': runs}, args.out.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
