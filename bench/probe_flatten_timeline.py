"""Where one flatten call's wall time goes, step by step: a host timeline with the device's copy beside it.

    python bench/probe_flatten_timeline.py [--case llm|demo] [--repeats 7] [--kernels-loaded] [--out FILE.json]

``--case llm``: the LLM mix (602 params, 8.6 GiB; on a machine without CUDA scaled down 16x per dimension);
``--case demo``: the demo's MoE model (13 params, 1.7 GiB; its CPU shape without CUDA). Device tier,
simulated W = 8 rank 3, a warm process. Each step of ``flatten_groups`` is wrapped to record its host start and
end (ms from the call's start); on CUDA, events recorded at the call's start and after each pack launch give
when the device finished the lead and each turn. Printed per step: median start and end over ``--repeats`` calls, so that
what runs before the device starts (and what the host still does after it finished) shows.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (module, attribute, label): the steps of one flatten call, in the order they run.
STEPS = [
    # DeepSpeed's ZeRO-1/2 hook around the flatten (bench_coldstart's cells; the probe's own calls skip it).
    ("ztriton.integrations.deepspeed.optimizers", "_zero12_layout_mismatch", "layout agreement (hook)"),
    ("ztriton.integrations.deepspeed.report", "measure_peak", "peak-measured flatten (hook)"),
    ("ztriton.flatten.groups", "world_of", "world of the group"),
    ("ztriton.flatten.groups", "agreed", "checks, agreed over ranks"),
    ("ztriton.flatten.groups", "_param_lists", "param lists"),
    ("ztriton.flatten.groups", "_prepare", "prepare (layout)"),
    ("ztriton.flatten.groups", "_check_params", "param checks"),
    ("ztriton.memory", "probe_memory", "memory probe"),
    ("ztriton.flatten.groups", "min_over_ranks", "min over ranks"),
    ("ztriton.policy", "choose_flatten_tier", "choose tier"),
    ("ztriton.policy", "log_decision", "log decision"),
    ("ztriton.flatten.tiers", "empty", "allocate flat"),
    ("ztriton.kernels.turns", "_first_turn_by_room", "first turn by room"),
    ("ztriton.kernels.turns", "_first_by_room", "lead or first turn chosen by room"),
    ("ztriton.kernels.turns", "pack_pieces", "pack_pieces"),
    ("ztriton.kernels.turns", "_copy_lead", "lead copies"),
    ("ztriton.kernels.turns", "make_plan", "plan a turn"),
    ("ztriton.kernels.plan", "make_plan", "plan (one)"),
    ("ztriton.flatten.groups", "_check_no_shared_memory", "no shared memory"),
    ("ztriton.flatten.groups", "_alias", "re-point params"),
    # Inside the plans and launches above (their times are part of those steps'; no label starts with "plan").
    ("ztriton.kernels.turns", "_check_destinations", "job's destination check"),
    ("ztriton.kernels.turns", "schedule", "schedule"),
    ("ztriton.kernels.plan", "validate", "validate"),
    ("ztriton.kernels.plan", "kernel_plan", "kernel tables"),
    ("ztriton.kernels.tables", "_host_buffer", "pinned buffer"),
    ("ztriton.kernels.tables", "_to_device", "upload tables"),
    ("ztriton.kernels.compiled", "launch", "launch (one kernel)"),
    ("ztriton.kernels.compiled", "_load", "load a binary"),
]


@contextlib.contextmanager
def steps_wrapped(after: Callable[[str, float, float, Any], Any]) -> Iterator[None]:
    """Wrap each of STEPS for the block: after each call, ``after(label, start, end, result)`` (host
    ``perf_counter`` seconds) returns what the caller gets in place of ``result``. Imports the steps' modules."""
    import importlib

    patched = []
    for module, name, label in STEPS:
        owner = importlib.import_module(module)
        real = getattr(owner, name)

        def timed(*args, _real=real, _label=label, **kwargs):
            start = time.perf_counter()
            result = _real(*args, **kwargs)
            return after(_label, start, time.perf_counter(), result)

        setattr(owner, name, timed)
        patched.append((owner, name, real))
    try:
        yield
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


class Timeline:
    """The rows of one call's steps (label, host start, host end: ms from :meth:`start`) as ``steps_wrapped``'s
    ``after``, and on CUDA an event after the lead's copies and after each turn's launch, whose times are when
    the device finished them."""

    def __init__(self, cuda: bool):
        self.cuda, self.rows, self.events, self.t0, self.begin = cuda, [], [], 0.0, None

    def start(self) -> None:
        self.rows.clear()
        self.events.clear()
        self.t0 = time.perf_counter()
        if self.cuda:
            import torch

            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()

    def now_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def record(self, label, start, end, result):
        self.rows.append((label, (start - self.t0) * 1e3, (end - self.t0) * 1e3))
        if self.cuda and label.startswith("plan"):
            return _Launch(result, label, self)
        if self.cuda and label == "lead copies":  # issued: the device's end of them is an event away
            self._event()
        return result

    def _event(self) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def result(self) -> dict:
        """The rows and (synchronise first) the device's end of each recorded launch, ms from the start."""
        return {"rows": list(self.rows),
                "device_ends_ms": [self.begin.elapsed_time(e) for e in self.events] if self.cuda else []}


class _Launch:
    """A plan whose launch is followed by an event and a "launched" row."""

    def __init__(self, plan, label, timeline: Timeline):
        self.plan, self.label, self.timeline = plan, label, timeline

    def launch(self):
        self.plan.launch()
        self.timeline._event()
        now = self.timeline.now_ms()
        self.timeline.rows.append((self.label.replace("plan", "launched"), now, now))

    def __getattr__(self, name):
        return getattr(self.plan, name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["llm", "demo"], default="llm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels-loaded", action="store_true", help="load the kernels before timing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    from bench.harness import cpu_fallback, sync

    cuda = not cpu_fallback(threads=1)
    import ztriton
    from bench.models import llm_mix
    from ztriton.testing import simulated_world

    device = "cuda" if cuda else "cpu"
    if args.case == "demo":
        from ztriton.integrations.deepspeed.demo import CPU_SHAPE, GPU_SHAPE, MoEModel

        with torch.device("meta"):
            shapes = [list(p.shape) for p in MoEModel(GPU_SHAPE if cuda else CPU_SHAPE).parameters()]
    else:
        shapes = llm_mix() if cuda else [[max(1, d // 16) for d in s] for s in llm_mix()]
    if args.kernels_loaded and cuda:
        from ztriton.kernels.warmup import warm_up

        warm_up(torch.device("cuda", torch.cuda.current_device()))

    timeline = Timeline(cuda)

    def params():
        made = [torch.nn.Parameter(torch.empty(*s, dtype=torch.bfloat16, device=device)) for s in shapes]
        sync()
        return made

    def once() -> dict:
        group = params()
        timeline.start()
        flat = ztriton.flatten_groups([group])
        returned = timeline.now_ms()
        sync()
        whole = timeline.now_ms()
        del flat, group
        return {**timeline.result(), "returned_ms": returned, "whole_ms": whole}

    with steps_wrapped(timeline.record), simulated_world(8, 3):
        once()
        runs = [once() for _ in range(args.repeats)]

    print(f"[probe_flatten_timeline] {len(shapes)} params on {device}"
          f"{', kernels loaded' if args.kernels_loaded else ''}; median of {len(runs)} calls, ms from the call's start")
    labels = []
    for label, _, _ in runs[0]["rows"]:
        if label not in labels:
            labels.append(label)
    summary = {}
    for label in labels:
        starts = [min(s for l, s, _ in r["rows"] if l == label) for r in runs if any(l == label for l, _, _ in r["rows"])]
        ends = [max(e for l, _, e in r["rows"] if l == label) for r in runs if any(l == label for l, _, _ in r["rows"])]
        own = [sum(e - s for l, s, e in r["rows"] if l == label) for r in runs if any(l == label for l, _, _ in r["rows"])]
        summary[label] = {"start": statistics.median(starts), "end": statistics.median(ends),
                          "own": statistics.median(own)}
        print(f"  {label:28s} {summary[label]['start']:7.2f} -> {summary[label]['end']:7.2f}  "
              f"(own {summary[label]['own']:.2f})")
    for key in ("returned_ms", "whole_ms"):
        summary[key] = statistics.median(r[key] for r in runs)
    if cuda and runs[0]["device_ends_ms"]:
        summary["device_ends_ms"] = [statistics.median(r["device_ends_ms"][k] for r in runs)
                                     for k in range(len(runs[0]["device_ends_ms"]))]
        print(f"  device done with each launch at {', '.join(f'{v:.2f}' for v in summary['device_ends_ms'])}")
    print(f"  returned {summary['returned_ms']:.2f}, device done (synchronised) {summary['whole_ms']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
