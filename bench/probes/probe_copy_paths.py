"""Which way of copying a few hundred to a few thousand params into one buffer a single warm-process call
should take, on the device, as one call from an idle device: the question behind issue 15's flatten target.

    python bench/probes/probe_copy_paths.py [--sizes 8.6 40] [--out FILE.json] [--profile] [--smoke]

For the LLM mix (602 bf16 params, 8.6 GiB) and its 40 GiB version (3,602), each of: a Python loop of
``copy_`` over byte views (what a torch-copy plan launches), the same over bf16 views, one
``torch._foreach_copy_`` over byte / bf16 / int64 views, one ``torch.cat(..., out=)``, DeepSpeed's flatten
(pad tensors + ``torch.cat``), and the kernel plan (after the kernels are loaded). Each row: the wall time
of one synchronised call (median of 5), the host time to issue it, and the device time alone (CUDA events
around a call on a quiet stream); every result is compared byte for byte with the loop's. Then the host
time of making 602 / 3,602 byte views, one ``split`` of the buffer, and re-pointing every param
(``as_strided`` + ``.data =``), and ``ztriton.flatten_groups``'s device tier before and after the kernels are
loaded (``--profile``: under cProfile too). ``--smoke``: the mix scaled down 64x per dimension, on the CPU
under Triton's interpreter where there is no GPU (a check of the script, no figures worth keeping).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness import CUDA, cpu_fallback, sync  # noqa: E402

cpu_fallback()
from bench.bench_flatten import llm_mix_40  # noqa: E402
from bench.models import llm_mix  # noqa: E402

GiB = 1 << 30
DEVICE = "cuda" if CUDA else "cpu"


def _synced(fn) -> tuple[float, float]:
    """(wall seconds of one call from an idle device, host seconds until it returned)."""
    sync()
    start = time.perf_counter()
    fn()
    issued = time.perf_counter()
    sync()
    return time.perf_counter() - start, issued - start


def _device_ms(fn) -> float:
    if not CUDA:
        return _synced(fn)[0] * 1e3
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def _row(name: str, fn, reps: int = 5) -> dict:
    fn()  # warm: torch's own first-call costs
    samples = [_synced(fn) for _ in range(reps)]
    device = statistics.median(_device_ms(fn) for _ in range(3))
    row = {"wall_ms": statistics.median(s[0] for s in samples) * 1e3,
           "host_ms": statistics.median(s[1] for s in samples) * 1e3, "device_ms": device}
    print(f"   {name:22s} wall {row['wall_ms']:8.2f} ms  host {row['host_ms']:8.2f} ms  device {row['device_ms']:8.2f} ms",
          flush=True)
    return row


def _host_ms(fn, reps: int = 7) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def case(shapes, profile: bool) -> dict:
    import ztriton
    from ztriton.kernels import KERNELS_ONLY, pack_plan
    from ztriton.testing import deepspeed_flatten, simulated_world

    sources = [torch.randn(*s, device=DEVICE).to(torch.bfloat16) for s in shapes]
    numels = [s.numel() for s in sources]
    total = sum(numels)
    flat = torch.empty(total, dtype=torch.bfloat16, device=DEVICE)
    offsets = [0]
    for n in numels[:-1]:
        offsets.append(offsets[-1] + n)
    print(f"{len(shapes)} params, {total * 2 / GiB:.2f} GiB", flush=True)
    rows: dict = {"params": len(shapes), "gib": total * 2 / GiB}

    def views(buffer, dtype):
        return list(buffer.view(dtype).split([n * 2 // dtype.itemsize for n in numels]))

    src_u8 = [s.reshape(-1).view(torch.uint8) for s in sources]
    src_bf16 = [s.reshape(-1) for s in sources]
    src_i64 = [s.reshape(-1).view(torch.int64) for s in sources]
    out_u8, out_bf16, out_i64 = views(flat, torch.uint8), views(flat, torch.bfloat16), views(flat, torch.int64)

    def loop(outs, srcs):
        def run():
            for out, src in zip(outs, srcs):
                out.copy_(src)
        return run

    def equal() -> bool:  # every source's bits at its place
        return all(torch.equal(out, src) for out, src in zip(views(flat, torch.int16), sources_int16))

    sources_int16 = [s.reshape(-1).view(torch.int16) for s in sources]
    methods = {
        "loop_copy_u8": loop(out_u8, src_u8),
        "loop_copy_bf16": loop(out_bf16, src_bf16),
        "foreach_u8": lambda: torch._foreach_copy_(out_u8, src_u8),
        "foreach_bf16": lambda: torch._foreach_copy_(out_bf16, src_bf16),
        "foreach_i64": lambda: torch._foreach_copy_(out_i64, src_i64),
        "cat_out": lambda: torch.cat(src_bf16, out=flat),
    }
    for name, fn in methods.items():
        flat.zero_()
        rows[name] = _row(name, fn)
        rows[name]["equal"] = equal()
    paddings = [0] * len(sources)
    rows["deepspeed_flatten"] = _row("deepspeed_flatten", lambda: deepspeed_flatten(sources, paddings, 16))
    plan = pack_plan(flat, sources, offsets, tuning=KERNELS_ONLY)
    plan.launch()  # loads the kernels
    rows["kernel_launch_only"] = _row("kernel (plan made)", plan.launch)
    rows["kernel_plan_and_launch"] = _row("kernel plan + launch",
                                          lambda: pack_plan(flat, sources, offsets, tuning=KERNELS_ONLY).launch())
    del plan

    # Host-only pieces of a flatten.
    params = [torch.nn.Parameter(s) for s in sources]  # shares each source's memory; re-pointing leaves it
    shapes_t = [p.shape for p in params]
    rows["host_byte_views_ms"] = _host_ms(lambda: [p.detach().reshape(-1).view(torch.uint8) for p in params])
    rows["host_split_ms"] = _host_ms(lambda: flat.view(torch.uint8).split([n * 2 for n in numels]))

    def repoint():
        base = flat.storage_offset()
        with torch.no_grad():
            for p, shape, off in zip(params, shapes_t, offsets):
                p.data = flat.as_strided(shape, [shape[-1], 1] if len(shape) == 2 else [1], base + off)
    rows["host_repoint_ms"] = _host_ms(repoint)
    print(f"   host: byte views {rows['host_byte_views_ms']:.2f} ms, split {rows['host_split_ms']:.2f} ms, "
          f"re-pointing {rows['host_repoint_ms']:.2f} ms", flush=True)
    del params, flat, out_u8, out_bf16, out_i64

    # The whole device tier, after the kernels were loaded above: KERNELS_LOADED decides its path.
    from ztriton.kernels import state as kernel_state
    loaded = set(kernel_state.LOADED)
    with simulated_world(8, 3):
        for label, state in (("flatten_torch_copies", set()), ("flatten_kernels", loaded)):
            kernel_state.LOADED.clear()
            kernel_state.LOADED.update(state)
            samples = []
            for _ in range(6):
                group = [torch.nn.Parameter(s) for s in sources]  # read, then re-pointed: sources stay
                wall, _ = _synced(lambda: ztriton.flatten_groups([group], parameter_alignment=True))
                samples.append(wall)
                del group
            rows[label] = {"wall_ms": statistics.median(samples[1:]) * 1e3}
            print(f"   {label:22s} wall {rows[label]['wall_ms']:8.2f} ms", flush=True)
            if profile:
                group = [torch.nn.Parameter(s) for s in sources]
                prof = cProfile.Profile()
                prof.enable()
                ztriton.flatten_groups([group], parameter_alignment=True)
                sync()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(22)
                del group
    plan_module.LOADED.update(loaded)
    del sources
    if CUDA:
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8.6", "40"], choices=["8.6", "40"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if not CUDA and not args.smoke:
        parser.error("needs a CUDA device (or --smoke)")

    def shapes(name):
        full = llm_mix() if name == "8.6" else llm_mix_40()
        return [[max(1, d // 64) for d in s] for s in full] if args.smoke else full

    figures = {name: case(shapes(name), args.profile) for name in args.sizes}
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if CUDA else "cpu",
                                        "torch": torch.__version__, "cases": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
