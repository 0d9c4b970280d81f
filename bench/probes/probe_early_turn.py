"""A fresh pack's early turn, on and off in the same process: ``python bench/probes/probe_early_turn.py [--out DIR]``.

``--host`` (no GPU needed): the host side only, on the CPU, launches stubbed: the time from the call to its first
launch and to its end, for pack (b)'s shapes as ``torch.empty`` CPU tensors (never touched, so never resident).

On a GPU:
One call from an idle device to its end (``pack(..., fresh=True)``, the flatten's call), alternately with
``turns.EARLY_TURN`` off (the first turn waits for every source's piece) and on, for pack (b) (2,000 log-uniform
tensors) and the LLM mix, in rounds; each result checked bit for bit against one plan's. Ratios are to torch's
``copy_`` bandwidth measured in the same run (bytes read plus written, as ``bench_kernels.py`` counts them).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
if "--host" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernels' route (whose launches are stubbed)
from bench.bench_kernels import DTYPE, group_layout, make_params, single_call_ms  # noqa: E402
from bench.harness import gbps, time_ms, torch_copy_gbps, write_result  # noqa: E402
from bench.models import llm_mix, log_uniform_mix  # noqa: E402
from ztriton.kernels import bits, pack, pack_plan  # noqa: E402
from ztriton.kernels import turns  # noqa: E402


def host_only(rounds: int) -> None:
    """Median host milliseconds to the first launch and to the end of ``pack(fresh=True)``, early turn off / on."""
    from ztriton.kernels import launch

    marks = []
    launch.Plan._launch_all = lambda self: marks.append(time.perf_counter())  # nothing moves
    params = [torch.empty(shape, dtype=DTYPE) for shape in log_uniform_mix()]
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel() + (-p.numel()) % 16
    flat = torch.empty(at, dtype=DTYPE)
    for _ in range(rounds):
        for early in (False, True):
            turns.EARLY_TURN = early
            first, whole = [], []
            for _ in range(25):
                marks.clear()
                start = time.perf_counter()
                pack(flat, params, offsets, fresh=True)
                whole.append((time.perf_counter() - start) * 1e3)
                first.append((marks[0] - start) * 1e3)
            print(f"early turn {'on ' if early else 'off'}: to the first launch {sorted(first)[12]:.3f} ms, "
                  f"the whole call {sorted(whole)[12]:.3f} ms, {len(marks)} plans launched", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host", action="store_true", help="the host side only, on the CPU (launches stubbed)")
    args = parser.parse_args()
    if args.host:
        host_only(args.rounds)
        return
    copy_bw = torch_copy_gbps(1 << 30)
    figures = {"copy_gbps": copy_bw}
    for name, shapes in (("pack_b_2000_loguniform", log_uniform_mix()), ("pack_c_llm_mix", llm_mix())):
        params = make_params(shapes)
        layout, offsets = group_layout(params)
        flat = torch.empty(layout.total_numel, dtype=DTYPE, device="cuda")
        plan = pack_plan(flat, params, offsets)
        plan.launch()
        expected = bits(flat).clone()
        nbytes = 2 * sum(p.numel() * 2 for p in params) + 2 * (layout.total_numel - sum(p.numel() for p in params))
        entry = {"kernel_ms": time_ms(plan.launch), "off_ms": [], "on_ms": []}
        for _ in range(args.rounds):
            for early in (False, True):
                turns.EARLY_TURN = early
                flat.zero_()
                pack(flat, params, offsets, fresh=True)
                assert torch.equal(bits(flat), expected), f"{name}: fresh pack (early turn {early}) differs"
                entry["on_ms" if early else "off_ms"].append(single_call_ms(lambda: pack(flat, params, offsets,
                                                                                              fresh=True)))
        turns.EARLY_TURN = True
        for key in ("off", "on"):
            ms = sorted(entry[f"{key}_ms"])[len(entry[f"{key}_ms"]) // 2]
            entry[f"{key}_median_ms"] = ms
            entry[f"{key}_ratio_to_copy"] = gbps(nbytes, ms) / copy_bw
        entry["kernel_ratio_to_copy"] = gbps(nbytes, entry["kernel_ms"]) / copy_bw
        figures[name] = entry
        print(f"{name}: kernel {entry['kernel_ms']:.2f} ms ({entry['kernel_ratio_to_copy']:.3f}x); one call in turns, "
              f"early turn off {entry['off_median_ms']:.2f} ms ({entry['off_ratio_to_copy']:.3f}x) "
              f"{[round(x, 2) for x in entry['off_ms']]}, on {entry['on_median_ms']:.2f} ms "
              f"({entry['on_ratio_to_copy']:.3f}x) {[round(x, 2) for x in entry['on_ms']]}", flush=True)
        del params, flat, plan, expected
        torch.cuda.empty_cache()
    print("wrote", write_result("early_turn", figures, args.out))


if __name__ == "__main__":
    main()
