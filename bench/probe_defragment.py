"""Where the time of ``ztriton.defragment`` goes on the device, for 602 partitions of the 8.6 GiB LLM
mix at W=8 (1.07 GiB) and W=1: the memory probe, the flat buffer's allocation, the pack launch, the
re-pointing. ``python bench/probe_defragment.py`` (one GPU); prints one line per part."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.models import llm_mix  # noqa: E402
from ztriton import defragmenting as D  # noqa: E402
from ztriton import memory  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


for world in (8, 1):
    numels = [-(-torch.Size(s).numel() // world) for s in llm_mix()]
    for repeat in range(2):
        # partitions in 50 buffers, as zero.Init under the key leaves them (one per module)
        per = -(-len(numels) // 50)
        tensors = []
        for k in range(0, len(numels), per):
            group = numels[k:k + per]
            buf = torch.empty(sum(group), dtype=torch.bfloat16, device="cuda")
            at = 0
            for n in group:
                tensors.append(torch.empty(0, dtype=torch.bfloat16, device="cuda").set_(buf.untyped_storage(), at, (n,)))
                at += n
            del buf
        total = sum(numels)
        _, probe_ms = timed(lambda: memory.probe_memory(torch.device("cuda")))
        flat, alloc_ms = timed(lambda: torch.empty(total, dtype=torch.bfloat16, device="cuda"))
        _, pack_ms = timed(lambda: D._copy_into(flat, tensors))
        _, repoint_ms = timed(lambda: D._repoint(flat, tensors))
        del flat
        again = [t.clone() for t in tensors]
        _, whole_ms = timed(lambda: D.defragment(again))
        print(f"W={world} {total * 2 / 2**30:.2f} GiB {len(tensors)} partitions (run {repeat}): probe {probe_ms:.2f} ms, "
              f"alloc {alloc_ms:.2f} ms, pack {pack_ms:.2f} ms, repoint {repoint_ms:.2f} ms; whole defragment "
              f"{whole_ms:.2f} ms", flush=True)
        del tensors, again
        torch.cuda.empty_cache()
