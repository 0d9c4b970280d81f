"""ZeRO-3 partition of one fused expert tensor: DeepSpeed's zero.Init against ztriton.partition.

``python bench/bench_partition.py [--out DIR] [--sizes 4 20]`` on one GPU. A [128, 8192, 2048] bf16
tensor (4 GiB) and a 20 GiB one, at simulated world size 8 (torch's fake process group, so every
rank's work is this process's) and at 1. Peak device memory is measured from just before the call,
so a source that already sits on the GPU is not counted; it is reported over the partition size.

(a) DeepSpeed ``zero.Init`` building the module (its default path; with ``offload_param``-style
remote_device="cpu" too); (b) ztriton from a GPU source; (c) from a pinned host source; (d) ztriton
with ``remote_device="cpu"`` from a pinned host source. Every ztriton partition is checked bit for bit
against the source's slice first.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.harness import RESULTS, measure_peak, plot_ratios, torch_copy_gbps, write_result  # noqa: E402

DTYPE = torch.bfloat16
GiB = 1 << 30
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # CPU: a smoke run of the logic (--smoke), under the interpreter


class Experts(torch.nn.Module):
    """One fused expert weight, filled with random values (never zeros) as a checkpoint would be."""

    def __init__(self, shape, device=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(shape, dtype=DTYPE, device=device))
        with torch.no_grad():
            self.w.normal_()


def shape_for(gib: int) -> list[int]:
    return [128, 8192, 2048 * gib // 4] if gib else [4, 8, 16]  # 0: the smoke size


def check_partition(module, source: torch.Tensor, world: int, rank: int) -> None:
    from ztriton.layout import zero3_slice

    sl = zero3_slice(source.numel(), world)
    valid = sl.valid_numel(rank)
    got = module.w.ds_tensor[:valid].to(DEVICE)
    want = source.reshape(-1)[sl.rank_start(rank):sl.rank_start(rank) + valid].to(DEVICE)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "partition differs from the source's slice"


def run_case(gib: int, world: int, figures: dict, h2d_gbps: float, copy_gbps: float) -> None:
    import deepspeed

    import ztriton
    from ztriton.testing import simulated_world

    shape = shape_for(gib)
    numel = shape[0] * shape[1] * shape[2]
    part_bytes = -(-numel // world) * 2
    rank = world - 1
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    entry = {"gib": gib, "world_size": world, "partition_gib": part_bytes / GiB}

    def ds_init(remote):
        def build():
            with deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote, pin_memory=remote == "cpu"):
                return Experts(shape)
        return build

    with simulated_world(world, rank):
        for label, remote in (("deepspeed_zero_init", None), ("deepspeed_zero_init_remote_cpu", "cpu")):
            module, secs, peak = measure_peak(ds_init(remote))
            entry[label] = {"seconds": secs, "peak_gib": peak / GiB, "peak_over_partition": peak / part_bytes}
            del module
            _empty_cache()

        source = Experts(shape, device=DEVICE)
        host_source = torch.empty(shape, dtype=DTYPE, pin_memory=CUDA)
        host_source.copy_(source.w.detach())
        ref = source.w.detach().clone() if gib <= 4 else None  # the 20 GiB case compares with the host copy

        for label, make, remote, floor in (
            ("ztriton_gpu_source", lambda: source, None, 2 * part_bytes / (copy_gbps * 1e9)),
            ("ztriton_pinned_source", lambda: _host_module(host_source), None, part_bytes / (h2d_gbps * 1e9)),
            ("ztriton_pinned_source_remote_cpu", lambda: _host_module(host_source), "cpu", 0.0),
        ):
            module = make()
            result, secs, peak = measure_peak(lambda: ztriton.partition(module, remote_device=remote))
            check_partition(module, ref if ref is not None else host_source, world, rank)
            entry[label] = {"seconds": secs, "peak_gib": peak / GiB, "peak_over_partition": peak / part_bytes,
                            "chunk_mib": result.chunk_bytes / 2**20, "floor_seconds": floor,
                            "over_floor": secs / floor if floor else None}
            del module, result
            _empty_cache()
        del source, host_source, ref
        _empty_cache()
    key = f"experts_{gib}gib_w{world}"
    figures[key] = entry
    print(f"{key}: " + "; ".join(f"{k} {v['seconds']:.3f}s peak {v['peak_gib']:.2f} GiB "
                                  f"({v['peak_over_partition']:.2f}x part)"
                                  for k, v in entry.items() if isinstance(v, dict)), flush=True)


def _empty_cache() -> None:
    if CUDA:
        torch.cuda.empty_cache()


def _host_module(host_source: torch.Tensor) -> Experts:
    module = Experts.__new__(Experts)
    torch.nn.Module.__init__(module)
    module.w = torch.nn.Parameter(host_source, requires_grad=True)
    return module


def pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    if not CUDA:
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 20])
    parser.add_argument("--name", default="partition_h200")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU too")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.name = [0], "partition_smoke"
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == DEVICE, f"DeepSpeed's accelerator is not {DEVICE}"
    figures = {"torch_copy_gbps": torch_copy_gbps(2 << 30), "pinned_h2d_gbps": pinned_h2d_gbps()}
    print(f"copy {figures['torch_copy_gbps']:.0f} GB/s, pinned H2D {figures['pinned_h2d_gbps']:.1f} GB/s", flush=True)
    run_case(0, 8, {}, figures["pinned_h2d_gbps"], figures["torch_copy_gbps"])  # warm-up: Triton compiles
    for gib in args.sizes:
        for world in (8, 1):
            run_case(gib, world, figures, figures["pinned_h2d_gbps"], figures["torch_copy_gbps"])
    write_result(args.name, figures, args.out)
    keys = [k for k in figures if k.startswith("experts_")]
    series = {label: [figures[k][label]["peak_over_partition"] for k in keys]
              for label in ("deepspeed_zero_init", "ztriton_gpu_source", "ztriton_pinned_source",
                            "ztriton_pinned_source_remote_cpu")}
    plot_ratios(args.out / f"{args.name}.png", "ZeRO-3 partition: peak device memory over partition size", keys,
                series, ylabel="peak / partition size")


if __name__ == "__main__":
    main()
