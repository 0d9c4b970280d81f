"""``python -m ztriton compile``: fill the compiled kernels' cache, so that a fresh process's first kernel launch
loads a binary instead of paying Triton's JIT (``ztriton.kernels.compiled``).

By default the common variants (every word class; the aligned and unaligned gathers of each element size) for
this machine's GPU; ``--arch`` names architectures instead (compute capability as major*10+minor, 90 for H100 and
H200), which needs no GPU: Triton compiles with its bundled ptxas. ``--all`` compiles every variant the launch
tables can produce (about 1,800: minutes). ``--background`` is the library's own fill (low priority, few
workers, quiet). Entries go under ``$ZTRITON_CACHE_DIR`` (default ``~/.cache/ztriton/kernels``), in a folder per
triton version, architecture and kernel source.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ztriton.environment import environment


def add_parser(sub) -> None:
    """The ``compile`` sub-command's arguments, on ``python -m ztriton``'s sub-parsers."""
    parser = sub.add_parser("compile", help="fill the compiled kernels' cache (fresh processes skip Triton's JIT)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, action="append", default=None, metavar="NN",
                        help="GPU architecture as major*10+minor (90: H100/H200); repeat for several. "
                             "Default: this machine's GPU")
    parser.add_argument("--all", action="store_true", help="every variant the tables can produce, not only the "
                                                           "common ones (minutes)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per core, up to 16)")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $ZTRITON_CACHE_DIR or "
                                                          "~/.cache/ztriton/kernels)")
    parser.add_argument("--background", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def run(args) -> int:
    """Run ``python -m ztriton compile`` with parsed ``args``; returns the exit status."""
    prog = "python -m ztriton compile"
    if args.jobs is not None and args.jobs < 1:
        print(f"{prog}: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    bad = [a for a in args.arch or [] if not 30 <= a <= 199]
    if bad:
        print(f"{prog}: --arch takes a compute capability as major*10+minor (e.g. 80, 90), got {bad[0]}",
              file=sys.stderr)
        return 2
    # The compile needs the real compiler (not the interpreter) and the cache folder asked for; both only for
    # this command: a caller's process (a test's) keeps its own environment.
    with environment({"ZTRITON_CACHE_DIR": args.cache_dir or os.environ.get("ZTRITON_CACHE_DIR"),
                      "TRITON_INTERPRET": None}):
        return _compile(args, prog)


def _compile(args, prog: str) -> int:
    archs = args.arch or _this_gpu(prog)
    if archs is None:
        return 2
    if args.background:
        os.nice(10)
    from ztriton.kernels import build, cache, variants

    if cache.triton_version() is None:
        print(f"{prog}: triton is not installed", file=sys.stderr)
        return 2
    chosen = list(variants.every_variant() if args.all else variants.common_variants())
    jobs = args.jobs or (max(1, (os.cpu_count() or 2) // 4) if args.background else None)
    for arch in archs:
        folder = cache.key_dir(arch)
        start = time.perf_counter()
        outcomes = build.compile_into(arch, chosen, folder, jobs=jobs)
        if not args.quiet and not args.background:
            counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("compiled", "cached", "unsupported")}
            print(f"sm{arch}: {counts['compiled']} compiled, {counts['cached']} already cached, "
                  f"{counts['unsupported']} left to Triton's launcher, in {time.perf_counter() - start:.1f} s "
                  f"-> {folder}")
    return 0


def _this_gpu(prog: str) -> list[int] | None:
    import torch

    if not torch.cuda.is_available():
        print(f"{prog}: this machine has no CUDA device torch can see; name the architecture with --arch "
              "(e.g. --arch 90 for H100/H200)", file=sys.stderr)
        return None
    archs = set()
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        archs.add(major * 10 + minor)
    return sorted(archs)
