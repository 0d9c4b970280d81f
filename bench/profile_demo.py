"""Where the demo's small steps spend their milliseconds, key off vs on, in a warm process.

    python bench/profile_demo.py [--steps zero_init zero2_optimizer] [--repeats 5] [--out DIR]

Runs the demo's warm-up (as ``python -m ztriton demo`` does), then each step ``--repeats`` times with the key
off and on, as rank 0 of a simulated W = 8: prints the median seconds of each, then the top functions by own
time of the key-on repeats and, function by function, key on minus key off under cProfile (a separate set of
repeats, so the profiler's overhead does not enter the medians), with the CUDA allocator's counts per run
(tensor allocations, and segments: each a ``cudaMalloc``; ``--empty-cache`` empties the cache before each run
as the demo does). ``--out`` keeps each profile (``python -m pstats``). On a machine
without CUDA it runs the demo's CPU shape under the interpreter: the host-side shares still mean something.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _step(kind: str, shape, backend: str, device: str, world: int, sharded_init_bytes: int):
    from ztriton.integrations.deepspeed import demo

    if kind == "zero_init":
        return demo.zero_init_step(shape, backend, world, 0, sharded_init_bytes)
    if kind == "zero3_optimizer":
        return demo.zero3_optimizer_step(shape, backend, world, 0, sharded_init_bytes)
    return demo.zero2_optimizer_step(shape, backend, device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", default=["zero_init", "zero2_optimizer"],
                        choices=["zero_init", "zero3_optimizer", "zero2_optimizer"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--torch-profiler", action="store_true",
                        help="also run each backend under torch.profiler (CPU and CUDA activity) and print its top ops")
    parser.add_argument("--callees", metavar="REGEX",
                        help="also print, key on, what the functions matching REGEX call (pstats' print_callees)")
    parser.add_argument("--time-agreements", action="store_true",
                        help="also time, key on, each part of every min_over_ranks call (tensor, all_reduce, tolist) "
                             "and the garbage collector's pauses per run")
    parser.add_argument("--no-profile", action="store_true", help="only the medians: skip the cProfile repeats")
    parser.add_argument("--empty-cache", action="store_true",
                        help="empty the CUDA cache before each run, as the demo does (every allocation a cudaMalloc)")
    args = parser.parse_args(argv)

    import torch

    from bench.harness import cpu_fallback

    cpu_fallback()
    from ztriton.integrations.deepspeed import demo
    from ztriton.testing import simulated_world

    demo.quiet_foreign_warnings()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = demo.GPU_SHAPE if device == "cuda" else demo.CPU_SHAPE
    sharded_init_bytes = 256 * 2**20 if device == "cuda" else 4096
    demo.run_steps(demo.WARMUP_SHAPE, device, args.world, 4096, quiet=True)

    allocations: dict[str, list[tuple[int, int]]] = {"torch": [], "triton": []}

    def once(kind: str, backend: str) -> float:
        with simulated_world(args.world, 0):
            step = _step(kind, shape, backend, device, args.world, sharded_init_bytes)
            if device == "cuda":
                if args.empty_cache:
                    torch.cuda.empty_cache()
                torch.cuda.synchronize()
                before = torch.cuda.memory_stats()
            start = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if device == "cuda":
                after = torch.cuda.memory_stats()
                # tensor allocations, and segments (each a cudaMalloc) the step asked the driver for
                allocations[backend].append(tuple(after.get(k, 0) - before.get(k, 0) for k in (
                    "allocation.all.allocated", "segment.all.allocated")))
            return seconds

    for kind in args.steps:
        if args.time_agreements:
            _time_agreements(kind, once, args.repeats)
        if args.torch_profiler:
            _torch_profile(kind, once, args)
        medians = {b: statistics.median(once(kind, b) for _ in range(args.repeats)) for b in ("torch", "triton")}
        print(f"[profile_demo] {kind}: key off {medians['torch'] * 1e3:.2f} ms, key on "
              f"{medians['triton'] * 1e3:.2f} ms (median of {args.repeats}"
              f"{', CUDA cache emptied before each' if args.empty_cache else ''})", flush=True)
        for backend, counts in allocations.items():
            if counts:
                print(f"[profile_demo]   {backend}: {counts[-1][0]} tensor allocations, {counts[-1][1]} cudaMalloc "
                      "segments per run", flush=True)
            counts.clear()
        profiles = {}
        for backend in () if args.no_profile else ("triton", "torch"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.repeats):
                once(kind, backend)
            profile.disable()
            profiles[backend] = stats = pstats.Stats(profile)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                stats.dump_stats(args.out / f"demo_{kind}_{backend}.pstats")
            if backend == "triton":
                print(f"[profile_demo] {kind} key on, {args.repeats} repeats, by own time:", flush=True)
                stats.sort_stats("tottime").print_stats(args.top)
                if args.callees:
                    stats.sort_stats("cumulative").print_callees(args.callees)
        if profiles:
            _print_difference(kind, profiles["triton"], profiles["torch"], args.repeats, args.top)
    return 0


def _time_agreements(kind: str, once, repeats: int) -> None:
    """Key on: milliseconds of each part of every ``min_over_ranks`` call, and of the GC's pauses, per run."""
    import gc

    import torch
    import torch.distributed as dist

    from ztriton import comm

    parts: dict[str, list[float]] = {"tensor": [], "all_reduce": [], "tolist": [], "whole": []}
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)

    def timed_min(values, world):
        t0 = time.perf_counter()
        if world.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=world.comm_device)
        t1 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.group)
        t2 = time.perf_counter()
        out = [int(v) for v in t.tolist()]
        t3 = time.perf_counter()
        for name, ms in (("tensor", t1 - t0), ("all_reduce", t2 - t1), ("tolist", t3 - t2), ("whole", t3 - t0)):
            parts[name].append(ms * 1e3)
        return out

    from ztriton.flatten import groups

    users = (comm, groups)  # all_ranks looks it up in comm; the flatten imported it by name
    originals = [module.min_over_ranks for module in users]
    for module in users:
        module.min_over_ranks = timed_min
    gc.callbacks.append(on_gc)
    try:
        runs = [once(kind, "triton") * 1e3 for _ in range(repeats)]
    finally:
        for module, original in zip(users, originals):
            module.min_over_ranks = original
        gc.callbacks.remove(on_gc)
    summary = ", ".join(f"{name} median {statistics.median(v):.3f} max {max(v):.3f} ms" for name, v in parts.items() if v)
    print(f"[profile_demo] {kind} key on, min_over_ranks over {repeats} runs ({len(parts['whole'])} calls): {summary}; "
          f"GC pauses {len(pauses)}, {sum(pauses):.2f} ms in all; runs median {statistics.median(runs):.2f} ms", flush=True)


def _print_difference(kind: str, on: pstats.Stats, off: pstats.Stats, repeats: int, top: int) -> None:
    """Function by function, key on minus key off per run under cProfile (ms of cumulative and own time,
    calls): where the key's extra host time goes, and what it saves."""
    def name(key) -> str:
        path, line, function = key
        return f"{path.split('site-packages/')[-1].replace(str(ROOT) + '/', '')}:{line}({function})"

    rows = []
    for key in set(on.stats) | set(off.stats):
        a, b = off.stats.get(key, (0, 0, 0, 0, {})), on.stats.get(key, (0, 0, 0, 0, {}))
        rows.append(((b[3] - a[3]) / repeats * 1e3, (b[2] - a[2]) / repeats * 1e3, (b[1] - a[1]) / repeats,
                     a[3] / repeats * 1e3, b[3] / repeats * 1e3, name(key)))
    total = sum(r[1] for r in rows)
    print(f"[profile_demo] {kind}: key on minus key off under cProfile, per run: {total:+.2f} ms of own time; "
          "by cumulative difference (cum, own, calls, off cum, on cum, function):", flush=True)
    for row in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        print(f"  {row[0]:+8.3f} {row[1]:+8.3f} {row[2]:+7.1f} {row[3]:8.3f} {row[4]:8.3f}  {row[5]}")


def _torch_profile(kind: str, once, args) -> None:
    """Each backend's repeats under torch.profiler: the ops and runtime calls (cudaMalloc, synchronisations,
    launches) by self CPU time and by device time, where a Python profile cannot see."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for backend in ("torch", "triton"):
        with profile(activities=activities) as prof:
            for _ in range(args.repeats):
                once(kind, backend)
        table = prof.key_averages()
        print(f"[profile_demo] {kind} key {'off' if backend == 'torch' else 'on'} under torch.profiler, "
              f"{args.repeats} repeats, by self CPU time:", flush=True)
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.top), flush=True)
        if torch.cuda.is_available():
            print(f"[profile_demo] {kind} key {'off' if backend == 'torch' else 'on'}, by device time:", flush=True)
            print(table.table(sort_by="self_device_time_total", row_limit=15), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.out / f"demo_{kind}_{backend}_trace.json"))


if __name__ == "__main__":
    sys.exit(main())
