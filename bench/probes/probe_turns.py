"""Does a copy in turns overlap the host's checks with the device's copying? One GPU.

    python bench/probes/probe_turns.py [--out FILE.json]

For pack (b) (2,000 tensors) and the LLM mix (602), on torch's route (before the kernels are loaded) and then the
kernels' (after): the whole call as one plan against ``fresh=True`` without and with the lead (median of 10, the three
interleaved); the lead's and each turn's host start and end and the device's end of that copy (a CUDA event), relative to the call's start, so a device idling between turns
shows; torch.profiler's CUDA runtime calls of one call in turns against one plan (a cudaHostAlloc or a
synchronize inside the call would serialise the turns); then the flatten's device tier of the LLM mix under
cProfile (where its host time goes beside the pack).
"""
import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bench_kernels import group_layout, make_params  # noqa: E402
from bench.models import llm_mix, log_uniform_mix  # noqa: E402
from ztriton.kernels import KERNELS_ONLY, make_plan, pack, pack_plan  # noqa: E402
from ztriton.kernels.pieces import pack_pieces  # noqa: E402
from ztriton.kernels import turns as turns_module  # noqa: E402


def timeline(flat, params, offsets) -> list[dict]:
    """Host start/end and device end (ms from the call's start) of the lead and each turn of one ``pack(fresh=True)``."""
    rows, real = [], turns_module.make_plan
    start = [0.0]

    class Timed:
        def __init__(self, plan):
            self.plan = plan

        def launch(self):
            self.plan.launch()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            rows[-1]["event"] = event
            rows[-1]["host_end_ms"] = (time.perf_counter() - start[0]) * 1e3

    def make_plan(dst, pieces, *args, **kwargs):
        rows.append({"pieces": len(pieces), "host_start_ms": (time.perf_counter() - start[0]) * 1e3})
        return Timed(real(dst, pieces, *args, **kwargs))

    real_lead = turns_module._copy_lead

    def copy_lead(dst, pieces, first):
        rows.append({"lead": len(first), "host_start_ms": (time.perf_counter() - start[0]) * 1e3})
        real_lead(dst, pieces, first)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        rows[-1]["event"] = event
        rows[-1]["host_end_ms"] = (time.perf_counter() - start[0]) * 1e3

    turns_module.make_plan = make_plan
    turns_module._copy_lead = copy_lead
    try:
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        start[0] = time.perf_counter()
        begin.record()
        pack(flat, params, offsets, fresh=True)
        torch.cuda.synchronize()
        whole = (time.perf_counter() - start[0]) * 1e3
    finally:
        turns_module.make_plan = real
        turns_module._copy_lead = real_lead
    for row in rows:
        row["device_end_ms"] = begin.elapsed_time(row.pop("event"))
    rows.append({"whole_ms": whole})
    return rows


def runtime_calls(fn) -> list[tuple[str, int, float]]:
    """(name, count, CPU ms) of the CUDA runtime and allocator calls torch.profiler sees in one ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.cpu_time_total / 1e3) for e in prof.key_averages()
            if e.key.startswith("cuda") or "pin" in e.key or "Host" in e.key]
    return sorted(rows, key=lambda r: -r[2])


# (first turn, growth): the schedules compared in one process, each the whole call's median. Batch s9c also
# compared three lead turns of 16 pieces as torch's copies (since removed): 8.79 / 5.26 / 4.66 ms against
# 8.54 / 5.25 / 3.88 ms for 64 growing fourfold, for pack (b), the LLM mix and pack (a).
SCHEDULES = [(32, 2), (32, 4), (64, 4), (128, 2), (128, 8)]


def schedules(cases: dict) -> dict:
    """pack(fresh=True)'s whole call under each schedule of turns (kernels loaded), interleaved, median of 10;
    one plan beside them."""
    times: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
    ways = [("one plan", {"MIN_PIECES": 1 << 62})] + [
        (f"first {first}, x{growth}", {"FIRST_TURN": first, "GROWTH": growth}) for first, growth in SCHEDULES]
    for _ in range(10):
        for name, (params, offsets, flat) in cases.items():
            for label, settings in ways:
                with mock.patch.multiple(turns_module, **settings):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    pack(flat, params, offsets, fresh=True)
                    torch.cuda.synchronize()
                times[name].setdefault(label, []).append((time.perf_counter() - start) * 1e3)
    medians = {name: {label: sorted(t)[len(t) // 2] for label, t in found.items()} for name, found in times.items()}
    for name, found in medians.items():
        print(f"schedules {name}: " + "; ".join(f"{label} {ms:.2f} ms" for label, ms in found.items()), flush=True)
    return medians


def turn_cost(case) -> dict:
    """Where one kernel turn's fixed cost goes: cProfile of 50 plans of 64 pieces (the biggest of pack (b))."""
    params, offsets, flat = case
    pieces, _ = pack_pieces(flat, params, offsets)
    first = pieces.take(turns_module.schedule(pieces)[0])  # FIRST_TURN (64) pieces, the biggest
    none = np.zeros((0, 2), dtype=np.int64)
    for _ in range(5):
        make_plan(flat, first, none, tuning=KERNELS_ONLY, run_now=True).launch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        make_plan(flat, first, none, tuning=KERNELS_ONLY, run_now=True).launch()
    host_ms = (time.perf_counter() - start) * 1e3 / 50
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        make_plan(flat, first, none, tuning=KERNELS_ONLY, run_now=True).launch()
    profile.disable()
    torch.cuda.synchronize()
    print(f"one kernel turn of 64 pieces: {host_ms:.3f} ms of host (no profiler); cProfile of 50:", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return {"host_ms": host_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    figures = {}
    cases = {}
    for name, shapes in (("b_2000", log_uniform_mix()), ("llm_602", llm_mix()), ("a_200", [[16 << 20]] * 200)):
        params = make_params(shapes)
        layout, offsets = group_layout(params)
        cases[name] = (params, offsets, torch.empty(layout.total_numel, dtype=params[0].dtype, device="cuda"))
    # Torch's copies first (a process that has not loaded the kernels), then the kernels (loaded here).
    for route in ("torch", "kernels"):
        if route == "kernels":
            params, offsets, flat = cases["llm_602"]
            pack_plan(flat, params, offsets, tuning=KERNELS_ONLY).launch()
            torch.cuda.synchronize()
        for name, (params, offsets, flat) in cases.items():
            for _ in range(3):  # compile and cache every variant, both ways
                pack(flat, params, offsets, fresh=True)
                pack_plan(flat, params, offsets).launch()
            one_plan, no_lead, fresh = [], [], []
            lead_bytes = turns_module.LEAD_BYTES
            for _ in range(10):  # the whole call, as a user makes it: one plan against pack(fresh=True)
                for way, times, lead in ((False, one_plan, lead_bytes), (True, no_lead, 1 << 62),
                                         (True, fresh, lead_bytes)):
                    with mock.patch.object(turns_module, "LEAD_BYTES", lead):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        pack(flat, params, offsets, fresh=way)
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - start) * 1e3)
            medians = {"one_plan_ms": sorted(one_plan)[5], "fresh_no_lead_ms": sorted(no_lead)[5],
                       "fresh_ms": sorted(fresh)[5]}
            print(f"{route} {name} whole call, median of 10: one plan {medians['one_plan_ms']:.2f} ms, "
                  f"fresh=True without the lead {medians['fresh_no_lead_ms']:.2f} ms, "
                  f"fresh=True {medians['fresh_ms']:.2f} ms", flush=True)
            rows = [timeline(flat, params, offsets) for _ in range(3)][-1]
            for row in rows[:-1]:
                what = f"lead of {row['lead']:4d}" if "lead" in row else f"turn of {row['pieces']:4d}"
                print(f"{route} {name} {what}: host {row['host_start_ms']:6.2f} -> "
                      f"{row['host_end_ms']:6.2f} ms, device done {row['device_end_ms']:6.2f} ms", flush=True)
            print(f"{route} {name} whole call {rows[-1]['whole_ms']:.2f} ms", flush=True)
            calls = {"turns": runtime_calls(lambda: pack(flat, params, offsets, fresh=True)),
                     "plan": runtime_calls(lambda: pack_plan(flat, params, offsets).launch())}
            for way, found in calls.items():
                print(f"{route} {name} {way}: " + "; ".join(f"{k} x{c} {ms:.2f} ms" for k, c, ms in found[:10]),
                      flush=True)
            figures[f"{route}_{name}"] = {"turns": rows, "runtime_calls": calls, **medians}
    figures["schedules"] = schedules(cases)
    figures["turn_cost"] = turn_cost(cases["b_2000"])
    del cases, params, flat
    torch.cuda.empty_cache()

    import ztriton

    shapes = llm_mix()
    batches = [make_params(shapes) for _ in range(2)]
    ztriton.flatten_groups([[torch.nn.Parameter(p) for p in batches[0]]], parameter_alignment=True, tier="device")
    del batches[0]
    params = [torch.nn.Parameter(p) for p in batches[0]]
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    ztriton.flatten_groups([params], parameter_alignment=True, tier="device")
    profile.disable()
    torch.cuda.synchronize()
    print(f"flatten device tier, 602 params, under cProfile: {(time.perf_counter() - start) * 1e3:.2f} ms", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
