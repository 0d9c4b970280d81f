"""Does the lead (``kernels/turns.py``: the biggest pieces first, as torch copies) pay, and from what size? One GPU.

    python bench/probes/probe_lead.py [--out FILE.json]

``pack(fresh=True)`` of three jobs with the kernels loaded, the whole call (host and device, synchronised)
median of 10, three ways interleaved: without the lead, with it as shipped (``LEAD_BYTES``), and from 64 MiB.
The jobs: the LLM mix (two 1.16 GiB embeddings lead), 200 experts of 64 MiB (from 64 MiB, each is a copy_ of
20-60 us of host for ~32 us of copying) and 24 of 512 MiB. Each against the copy floor (the bytes read and
written at torch's copy bandwidth, measured in the same run). Batch s10d ran an earlier version whose ways were
no lead, from 64 MiB capped at 2 GiB below 256 MiB, and from 64 MiB uncapped.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bench_kernels import group_layout, make_params  # noqa: E402
from bench.harness import environment, torch_copy_gbps  # noqa: E402
from bench.models import llm_mix  # noqa: E402
from ztriton.kernels import pack  # noqa: E402
from ztriton.kernels import turns  # noqa: E402
from ztriton.kernels.warmup import warm_up  # noqa: E402

CASES = {"llm_602": llm_mix, "experts_200x64MiB": lambda: [[32 << 20]] * 200,
         "experts_24x512MiB": lambda: [[256 << 20]] * 24}
WAYS = {"no lead": 1 << 62, "lead": turns.LEAD_BYTES, "lead from 64 MiB": 64 << 20}  # LEAD_BYTES of each


def whole_call_ms(flat, params, offsets, lead_bytes: int) -> float:
    with mock.patch.object(turns, "LEAD_BYTES", lead_bytes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        pack(flat, params, offsets, fresh=True)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    warm_up(torch.device("cuda", torch.cuda.current_device()))
    copy_gbps = torch_copy_gbps(1 << 30)
    figures = {"torch_copy_gbps": copy_gbps}
    for name, shapes in CASES.items():
        params = make_params(shapes())
        layout, offsets = group_layout(params)
        total = sum(p.numel() for p in params)
        flat = torch.empty(layout.total_numel, dtype=params[0].dtype, device="cuda")
        floor_ms = 2 * total * params[0].element_size() / copy_gbps / 1e6
        times = {way: [] for way in WAYS}
        for way, lead_bytes in WAYS.items():  # compile and cache every variant
            whole_call_ms(flat, params, offsets, lead_bytes)
        for _ in range(10):
            for way, lead_bytes in WAYS.items():
                times[way].append(whole_call_ms(flat, params, offsets, lead_bytes))
        row = {"pieces": len(params), "gib": total * params[0].element_size() / 2**30, "copy_floor_ms": floor_ms}
        for way in WAYS:
            row[way] = {"median_ms": statistics.median(times[way]), "over_floor": floor_ms / statistics.median(times[way]),
                        "runs_ms": times[way]}
        figures[name] = row
        print(f"{name}: {len(params)} pieces, {row['gib']:.2f} GiB, copy floor {floor_ms:.2f} ms; " +
              "; ".join(f"{way} {row[way]['median_ms']:.2f} ms ({row[way]['over_floor']:.3f}x copy)" for way in WAYS),
              flush=True)
        del params, flat
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"environment": environment(), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
