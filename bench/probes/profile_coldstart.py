"""Where a fresh process's seconds go, key off vs on: one cell of ``bench_coldstart.py`` under cProfile.

    python bench/probes/profile_coldstart.py zero3 triton [--scale 16] [--top 25] [--out prof.pstats]
    python bench/probes/profile_coldstart.py zero2 torch

On a machine without CUDA it runs on the CPU (DeepSpeed's cpu accelerator, Triton's interpreter) with the
LLM mix scaled down by ``--scale`` in each dimension (the 8.6 GiB mix's 602 params keep their count and
proportions) and the placeholder threshold scaled with it, so the two embeddings are still placeholders.
Prints the timed steps and the top functions by cumulative and own time; ``--out`` keeps the raw profile
(``python -m pstats``). Interpreter time (``triton/runtime/interpreter.py``) is CPU-only: subtract it, or
pass ``--no-kernels`` to skip every kernel launch (host planning still runs; the values are then wrong, so
only the timings mean anything). The last line sums what issue 15 asks about: the torch._dynamo import,
the recorder's modes, the memory probe, Triton's import, kernel launches.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("zero2", "zero3"))
    parser.add_argument("backend", choices=("torch", "triton"))
    parser.add_argument("--scale", type=int, default=16, help="divide each dimension of the mix (CPU only)")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (CPU only)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-kernels", action="store_true", help="skip kernel launches (timings only)")
    args = parser.parse_args(argv)

    import torch

    from bench.harness import cpu_fallback

    cpu_fallback(threads=args.threads)
    profile = cProfile.Profile()
    profile.enable()
    import ztriton  # noqa: F401
    import deepspeed
    from bench.bench_coldstart import _config
    from bench.models import LLMMix, llm_mix
    # Not ztriton.testing: it imports the kernels, hence triton, which a user's key-off process never imports
    # and a key-on one only where a copy needs a kernel; the cells' timed steps must pay that import themselves.
    from ztriton.integrations.deepspeed.worlds import simulated_world

    imported = time.perf_counter() - STARTED
    skipped = contextlib.ExitStack()  # open until the process ends
    if args.no_kernels:
        from bench.harness import kernel_launches_skipped

        skipped.enter_context(kernel_launches_skipped())
    cuda = torch.cuda.is_available()
    scale = 1 if cuda else args.scale
    shapes = [[d // scale for d in shape] for shape in llm_mix()]
    threshold = (1 << 30) // scale ** 2  # the default 1 GiB threshold, scaled as the embeddings are
    config = _config(args.backend, 2 if args.step == "zero2" else 3)
    if args.backend == "triton":
        config["ztriton"] = {"sharded_init_bytes": threshold}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = {"import": imported}
    with simulated_world(args.world, args.rank):
        if args.step == "zero2":
            model = LLMMix(shapes, 50, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            sync()
            start = time.perf_counter()
            deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            sync()
            times["initialize"] = time.perf_counter() - start
        else:
            sync()
            start = time.perf_counter()
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = LLMMix(shapes, 50)
            sync()
            times["build"] = time.perf_counter() - start
            print(f"after the build: torch._dynamo imported {'torch._dynamo' in sys.modules}", flush=True)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            start = time.perf_counter()
            deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            sync()
            times["initialize"] = time.perf_counter() - start
    profile.disable()
    print("STEPS " + ", ".join(f"{k} {v:.3f} s" for k, v in times.items()), flush=True)
    summary = _summary(pstats.Stats(profile))  # before strip_dirs: it matches on paths
    stats = pstats.Stats(profile).strip_dirs()
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    if args.out:
        profile.dump_stats(str(args.out))
    print("SUMMARY " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in summary.items()))
    return 0


def _summary(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of the places issue 15 names (0 where never called)."""
    def cumulative(file: str, function: str) -> float:
        return sum(row[3] for (path, _, name), row in stats.stats.items() if path.endswith(file) and name == function)

    return {"torch._dynamo import": cumulative("_dynamo/__init__.py", "<module>"),
            "triton import": cumulative("triton/__init__.py", "<module>"),
            "recorder torch_function": cumulative("recorder.py", "__torch_function__"),
            "recorder torch_dispatch": cumulative("recorder.py", "__torch_dispatch__"),
            "memory probe": cumulative("memory.py", "probe_memory"),
            "kernel launches": cumulative("plan.py", "_launch_all")}


if __name__ == "__main__":
    sys.exit(main())
