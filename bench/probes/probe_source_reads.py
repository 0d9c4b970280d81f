"""The host's floor for one plan of many sources: the time to read what every source must be checked for before
its first byte is written (address, size, dtype, device, layout), nothing else.

    python bench/probes/probe_source_reads.py [--sources 2000] [--device cuda]

Prints the best of 50 passes over ``--sources`` tensors: all five reads, and the address alone.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import best_host_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sizes = torch.randint(1, 2000, (args.sources,), generator=torch.Generator().manual_seed(0)).tolist()
    sources = [torch.empty(n, device=args.device) for n in sizes]
    def read_every_check():
        return [(t.data_ptr(), t.numel(), t.dtype, t.device, t.is_contiguous()) for t in sources]

    def read_address():
        return [t.data_ptr() for t in sources]

    every_check, address = best_host_ms(read_every_check, 50), best_host_ms(read_address, 50)
    print(f"{args.sources} sources on {args.device}: the five reads {every_check:.3f} ms, the address alone "
          f"{address:.3f} ms")


if __name__ == "__main__":
    main()
