"""Where the time of ``ztriton.defragment`` goes on the device, for 602 partitions of the 8.6 GiB LLM
mix at W=8 (1.07 GiB) and W=1: the memory probe, the flat buffer's allocation, the pack launch, the
re-pointing, the whole call; then the evict tier at W=1 against the pinned-copy floor of the bytes it
moves (out to host memory and back), its first call (which pins the spill) and a later one.

    python bench/probe_defragment.py [--out FILE.json]

One GPU; prints one line per part; ``--out`` writes the figures as JSON."""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.models import llm_mix  # noqa: E402
from ztriton import defragmenting as D  # noqa: E402
from ztriton import memory  # noqa: E402

CUDA = torch.device("cuda")


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def partitions(world: int) -> list[torch.Tensor]:
    """Rank 0's partitions of the LLM mix at ``world``, in 50 buffers, as zero.Init under the key leaves
    them (one per module)."""
    numels = [-(-torch.Size(s).numel() // world) for s in llm_mix()]
    per = -(-len(numels) // 50)
    tensors = []
    for k in range(0, len(numels), per):
        group = numels[k:k + per]
        buf = torch.empty(sum(group), dtype=torch.bfloat16, device=CUDA)
        at = 0
        for n in group:
            tensors.append(torch.empty(0, dtype=torch.bfloat16, device=CUDA).set_(buf.untyped_storage(), at, (n,)))
            at += n
        del buf
    return tensors


def one_plan():
    """Within it, a fresh pack goes as one plan (no turns): the A/B of the pack's two ways in one run."""
    from unittest import mock

    from ztriton.kernels import turns

    return mock.patch.object(turns, "MIN_PIECES", 1 << 62)


def device_tier(world: int, repeat: int) -> dict:
    tensors = partitions(world)
    total = sum(t.numel() for t in tensors)
    _, probe_ms = timed(lambda: memory.probe_memory(CUDA))
    flat, alloc_ms = timed(lambda: torch.empty(total, dtype=torch.bfloat16, device=CUDA))
    with one_plan():
        _, one_plan_ms = timed(lambda: D._copy_into(flat, tensors, D._places(tensors)))
    _, pack_ms = timed(lambda: D._copy_into(flat, tensors, D._places(tensors)))
    _, repoint_ms = timed(lambda: D._repoint(flat, tensors, D._places(tensors)))
    del flat
    again = partitions(world)  # in module buffers, as a real call finds them (clones would be 602 allocations)
    _, whole_ms = timed(lambda: D.defragment(again))
    row = {"world": world, "gib": total * 2 / 2**30, "partitions": len(tensors), "probe_ms": probe_ms,
           "alloc_ms": alloc_ms, "pack_ms": pack_ms, "pack_one_plan_ms": one_plan_ms, "repoint_ms": repoint_ms,
           "whole_ms": whole_ms}
    print(f"W={world} {row['gib']:.2f} GiB {len(tensors)} partitions (run {repeat}): probe {probe_ms:.2f} ms, "
          f"alloc {alloc_ms:.2f} ms, pack {pack_ms:.2f} ms (as one plan {one_plan_ms:.2f} ms), repoint "
          f"{repoint_ms:.2f} ms; whole defragment {whole_ms:.2f} ms", flush=True)
    del tensors, again
    torch.cuda.empty_cache()
    return row


def pinned_floor_ms(nbytes: int) -> float:
    """One device-to-host and one host-to-device copy of ``nbytes`` through an already pinned buffer."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=CUDA)
    samples = []
    for _ in range(3):
        def both():
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)
        samples.append(timed(both)[1])
    del host, dev
    torch.cuda.empty_cache()
    return statistics.median(samples)


def evict_tier(world: int = 1, calls: int = 3) -> dict:
    """The forced evict tier (every storage goes out to the spill and comes back), ``calls`` calls on fresh
    partitions: the first pins the spill, later ones reuse it."""
    samples = []
    for _ in range(calls):
        tensors = partitions(world)
        nbytes = sum(t.numel() for t in tensors) * 2
        flat, ms = timed(lambda: D.defragment(tensors, tier="evict"))
        assert all(t.device.type == "cuda" for t in tensors), "an evicted partition was left in host memory"
        samples.append(ms)
        del tensors, flat
        torch.cuda.empty_cache()
    floor = pinned_floor_ms(nbytes)
    row = {"world": world, "gib": nbytes / 2**30, "first_call_ms": samples[0], "later_calls_ms": samples[1:],
           "pinned_floor_ms": floor, "over_floor": statistics.median(samples[1:]) / floor}
    print(f"evict tier W={world} {row['gib']:.2f} GiB: first call {samples[0]:.0f} ms, later "
          f"{', '.join(f'{s:.0f}' for s in samples[1:])} ms; pinned floor {floor:.0f} ms: "
          f"{row['over_floor']:.2f}x", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=6, help="device-tier runs per world size")
    args = parser.parse_args()
    rows = [device_tier(world, repeat) for world in (8, 1) for repeat in range(args.repeats)]
    medians = {}
    for world in (8, 1):
        mine = [r for r in rows[1:] if r["world"] == world]  # the first run of the process pays first calls
        medians[f"W={world}"] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k.endswith("_ms")}
        print(f"W={world} median of runs after the first: " +
              ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in medians[f"W={world}"].items()), flush=True)
    figures = {"device": rows, "device_medians": medians, "evict": evict_tier()}
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
