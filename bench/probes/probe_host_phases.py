"""Where the host's time goes in one fresh pack of pack (b) (2,000 log-uniform bf16 tensors), phase by phase, with
the device's copies beside it. One GPU.

    python bench/probes/probe_host_phases.py [--tree DIR] [--out FILE.json]

Each phase's host end (ms from the call's start; median of 40 calls) for: the first turn chosen by room, its
plan's validation, word-copy tables, upload and each launch, ``pack_pieces`` over every source, the whole job's
checks, and each later turn's plan; beside each turn's launches, a CUDA event's time, so that the device idling
between two turns shows as a device end before the next turn's launch. ``--tree DIR``: import ztriton from
another checkout (phases that tree lacks are simply not reported).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (module, function) whose end is marked; each is wrapped where the caller looks it up.
PHASES = [("turns", "_first_turn_by_room"), ("turns", "_first_by_room"), ("plan", "validate"),
          ("tables", "_word_copy_calls"), ("tables", "_upload"), ("turns", "pack_pieces"),
          ("turns", "_check_destinations"), ("turns", "make_plan")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    import ztriton.kernels  # the tree's
    from ztriton.kernels import compiled, pack
    from ztriton.kernels import plan as plan_module
    from ztriton.kernels import tables as tables_module
    from ztriton.kernels import turns as turns_module

    assert Path(ztriton.kernels.__file__).resolve().is_relative_to(args.tree.resolve()), ztriton.kernels.__file__
    sys.path.insert(0, str(ROOT))
    from bench.bench_kernels import group_layout, make_params
    from bench.models import log_uniform_mix

    modules = {"turns": turns_module, "plan": plan_module, "tables": tables_module}
    marks: list[tuple[str, float, object]] = []
    start = [0.0]

    def mark(name: str, event=None) -> None:
        marks.append((name, (time.perf_counter() - start[0]) * 1e3, event))

    def wrapped(name, fn):
        def call(*a, **k):
            result = fn(*a, **k)
            mark(name)
            return result
        return call

    for module, name in PHASES:
        if hasattr(modules[module], name):
            setattr(modules[module], name, wrapped(name, getattr(modules[module], name)))
    real_launch = compiled.launch

    def launch(*a, **k):
        real_launch(*a, **k)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        mark("launch", event)

    compiled.launch = launch
    params = make_params(log_uniform_mix())
    layout, offsets = group_layout(params)
    flat = torch.empty(layout.total_numel, dtype=params[0].dtype, device="cuda")
    runs = []
    for call in range(args.calls + 5):
        marks.clear()
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        start[0] = time.perf_counter()
        begin.record()
        pack(flat, params, offsets, fresh=True)
        mark("returned")
        torch.cuda.synchronize()
        mark("synchronized")
        if call >= 5:
            runs.append([(name, ms, None if event is None else begin.elapsed_time(event)) for name, ms, event in marks])
    # Phases in order of the first run; a run whose phases differ in number is reported apart (none expected).
    shape = [name for name, _, _ in runs[0]]
    same = [run for run in runs if [name for name, _, _ in run] == shape]
    rows = []
    for k, name in enumerate(shape):
        host = statistics.median(run[k][1] for run in same)
        devices = [run[k][2] for run in same if run[k][2] is not None]
        rows.append({"phase": name, "host_ms": host, "device_ms": statistics.median(devices) if devices else None})
        device = "" if not devices else f"  device done {rows[-1]['device_ms']:6.3f} ms"
        print(f"{k:3d} {name:22s} host {host:6.3f} ms{device}", flush=True)
    print(f"{len(same)} of {len(runs)} calls in the same phases; {torch.cuda.get_device_name()}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "tree": str(args.tree),
                                        "phases": rows, "calls": len(same)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
