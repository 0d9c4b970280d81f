"""A cost model of a copy in turns: which schedule keeps the device busy, given the host's costs.

    python bench/probes/model_turns.py [--start 1.0] [--fixed 0.8] [--per-piece-us 1.4] [--tbps 4.05]

Host: ``start`` ms before the first turn (reading and checking every source), then per turn ``fixed`` ms plus
``per-piece-us`` per piece; the device copies each turn (read and write) at ``tbps`` once the host has launched
it. Pieces go biggest first, as ``kernels/turns.py`` schedules them. Prints, for pack (b) and the LLM mix, the
whole call and its ratio to the copy alone under several schedules. Fitted to batch s9a (8.95 ms modelled
against 8.8-9.4 ms measured for pack (b) in turns of 32 doubling); it was too optimistic about torch's lead
turns (their fixed cost is a kernel turn's, not 0.15 ms: batch s9b). A model to choose what to measure, not a
measurement.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.models import llm_mix, log_uniform_mix  # noqa: E402
from ztriton.kernels.turns import turns  # noqa: E402


def whole_ms(nbytes: np.ndarray, sizes: list[int], start: float, fixed: float, per_piece_ms: float,
             bytes_per_ms: float) -> float:
    """The call's end: the later of the host's last launch and the device's last copy."""
    order = np.argsort(-nbytes, kind="stable")
    host, device, at = start, 0.0, 0
    for size in sizes:
        turn = order[at:at + size]
        at += size
        host += fixed + per_piece_ms * len(turn)
        device = max(device, host) + 2 * nbytes[turn].sum() / bytes_per_ms
    return max(host, device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=float, default=1.0)
    parser.add_argument("--fixed", type=float, default=0.8)
    parser.add_argument("--per-piece-us", type=float, default=1.4)
    parser.add_argument("--tbps", type=float, default=4.05)
    args = parser.parse_args(argv)
    bytes_per_ms = args.tbps * 1e9
    cases = {"pack (b)": [s[0] * 2 for s in log_uniform_mix()], "LLM mix": [int(np.prod(s)) * 2 for s in llm_mix()]}
    for name, sizes in cases.items():
        nbytes = np.array(sizes, dtype=np.float64)
        copy = 2 * nbytes.sum() / bytes_per_ms
        print(f"{name}: {len(sizes)} pieces, the copy alone {copy:.2f} ms")
        schedules = {"one plan": [len(sizes)]}
        schedules.update({f"{f} x{g} to {l}": [b - a for a, b in turns(len(sizes), f, g, l)]
                          for f, g, l in ((32, 2, 1024), (64, 4, 1024), (128, 2, 1024), (128, 8, 4096))})
        for label, turn_sizes in schedules.items():
            ms = whole_ms(nbytes, turn_sizes, args.start, args.fixed, args.per_piece_us / 1e3, bytes_per_ms)
            print(f"  {label:18s} {ms:6.2f} ms  {copy / ms:.3f}x  ({len(turn_sizes)} turns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
