"""Where the flatten's device tier spends its host time: the LLM mix, a warm process, under cProfile.

    python bench/probes/profile_flatten.py [--repeats 5] [--top 30] [--no-kernels] [--kernels-loaded] [--torch-profiler]
                                    [--out prof.pstats]

Times ``ztriton.flatten_groups`` (device tier, simulated W = 8 rank 3) end to end, median of ``--repeats``
after one warm call, then profiles one more call and prints the top functions by own time. Each call
gets freshly built params (the flatten re-points them). ``--no-kernels`` skips every launch, leaving the
host's share. By default no kernel is loaded before the untimed first call, which loads the ones the job
needs (from the compiled cache where it has them); ``--kernels-loaded`` loads the commonest variant first.
``--torch-profiler`` also runs one call under torch.profiler and prints its ops by own CPU time (a host blocked
on the device shows as a synchronising call). On a machine without CUDA the mix is scaled down 16x per dimension
(602 params still).
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kernels-loaded", action="store_true", help="load the kernels before timing")
    parser.add_argument("--torch-profiler", action="store_true", help="also one call under torch.profiler")
    args = parser.parse_args(argv)

    import torch

    from bench.harness import cpu_fallback, kernel_launches_skipped, sync

    cuda = not cpu_fallback(threads=1)
    import ztriton
    from bench.models import llm_mix
    from ztriton.testing import simulated_world

    device = "cuda" if cuda else "cpu"
    shapes = llm_mix() if cuda else [[max(1, d // 16) for d in s] for s in llm_mix()]

    def params():
        made = [torch.nn.Parameter(torch.empty(*s, dtype=torch.bfloat16, device=device)) for s in shapes]
        sync()
        return made

    def once() -> float:
        group = params()
        start = time.perf_counter()
        flat = ztriton.flatten_groups([group])
        sync()
        seconds = time.perf_counter() - start
        del flat, group
        return seconds

    if args.kernels_loaded and cuda:
        from ztriton.kernels.warmup import warm_up

        warm_up(torch.device("cuda", torch.cuda.current_device()))
    skipped = kernel_launches_skipped() if args.no_kernels else contextlib.nullcontext()
    with simulated_world(8, 3), skipped:
        once()
        times = [once() for _ in range(args.repeats)]
        print(f"[profile_flatten] device tier, {len(shapes)} params: median {statistics.median(times) * 1e3:.2f} ms "
              f"(min {min(times) * 1e3:.2f}){' (no kernels)' if args.no_kernels else ''}", flush=True)
        if args.torch_profiler and cuda:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            group = params()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ztriton.flatten_groups([group])
                sync()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top), flush=True)
            del group
        group = params()
        profile = cProfile.Profile()
        profile.enable()
        ztriton.flatten_groups([group])
        sync()
        profile.disable()
    stats = pstats.Stats(profile)
    if args.out:
        stats.dump_stats(args.out)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
