"""Command line: ``python -m ztriton demo [--device cpu|cuda] [--world-size W] [--json PATH] [--verbose]`` and
``python -m ztriton compile`` (the compiled cache, :mod:`ztriton.compile`).

The demo builds a built-in MoE-shaped model and runs ZeRO's load-time data movements with the
DeepSpeed config key "partition_backend" off (DeepSpeed's own code) and on (ztriton): zero.Init, the
ZeRO-3 optimizer's flat partition buffer and the ZeRO-2 flatten, as one rank of a simulated world, on
the GPU if there is one and otherwise on the CPU (kernels under the Triton interpreter, with a much
smaller model). It checks that the bytes are identical and prints time and peak memory side by side.
"""
from __future__ import annotations

import argparse
import os
import sys


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m ztriton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="flatten and partition a built-in MoE-shaped model both ways")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    demo.add_argument("--world-size", type=int, default=8, help="simulated data-parallel world size (default 8)")
    demo.add_argument("--json", metavar="PATH", default=None,
                      help="also write the table, with the versions and device it ran on, to this JSON file")
    demo.add_argument("--verbose", action="store_true",
                      help="also print ztriton's per-call lines (path, tier, memory figures) as each step runs")
    from ztriton import compile as compile_command

    compile_command.add_parser(sub)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.command == "compile":
        from ztriton import compile as compile_command

        return compile_command.run(args)
    import torch

    if args.world_size < 1:
        print(f"python -m ztriton demo: --world-size must be at least 1, got {args.world_size}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"python -m ztriton demo: --device cuda, but this torch ({torch.__version__}) sees no CUDA device "
              f"(torch.version.cuda={torch.version.cuda}); run with --device cpu, or without --device to pick the "
              "GPU when there is one", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # Both are read once per process: before triton / DeepSpeed are first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ztriton.integrations.deepspeed import demo

    return demo.run(device, args.world_size, json_path=args.json, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
