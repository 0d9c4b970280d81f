"""What a user's run pays end to end: each step in a fresh process, Triton cache empty ("cold") and then
filled by the previous process ("warm"), key off vs on.

    python bench/bench_coldstart.py [--world 8 --rank 3] [--out bench/results/coldstart_h200.json]
    python bench/bench_coldstart.py --smoke      # tiny mix on the CPU (kernels under the interpreter)
    python bench/bench_coldstart.py --steps zero2 --backends triton --flatten-steps   # where the flatten's time goes
    python bench/bench_coldstart.py --steps zero2 --warm-repeats 10 --ab-tree DIR      # this tree against DIR's
    python bench/bench_coldstart.py --steps zero2 --warm-repeats 10 --trace-deepspeed  # where initialize's time goes
    python bench/probes/compare_traces.py bench/results/coldstart.json                  # ... key on against key off

Cells (the 8.6 GiB LLM mix of ``bench.models.llm_mix``, bf16, simulated rank ``--rank`` of ``--world``):

* ``zero2``: the model built on the device (not timed), then ZeRO-2 ``deepspeed.initialize`` with
  ``round_robin_gradients`` (timed): DeepSpeed's ``torch.cat`` flatten against ``ztriton.flatten_groups``.
* ``zero3``: the model built under ``zero.Init`` (timed: "build"), then ZeRO-3 ``deepspeed.initialize``
  (timed: "initialize"; its ``lp_param_buffer`` is DeepSpeed's host round trip against ``ztriton.defragment``).

Every cell is its own process (``python bench/bench_coldstart.py --cell STEP BACKEND``): the seconds of each
step as the user's script sees them (first call, compile or cache load included), the process's import
seconds, and its whole wall time. Cold: ``TRITON_CACHE_DIR`` is a new empty folder; warm: the folder the
cold process of the same step and backend just filled. Ratios key on / key off are from the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# Backends a cell can run: key off, key on, and key on with the background kernel warm-up ("ztriton":
# {"warm_up_kernels": true}; the default until session 5, whose cells named the key on without it
# "triton-nowarmup").
BACKENDS = ("torch", "triton", "triton-warmup")
# The key on, run from another checkout (``--ab-tree``): two trees' cells interleaved in one run, so that a code
# change is compared on one host at one time (the host's speed drifts between batches by more than the change).
AB_BACKEND = "triton@ab"


def _config(backend: str, stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 2:
        zero["round_robin_gradients"] = True
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": zero, "bf16": {"enabled": True}}
    if backend.startswith("triton"):
        config["partition_backend"] = "triton"
    if backend == "triton-warmup":
        config["ztriton"] = {"warm_up_kernels": True}
    return config


def _flatten_steps(spent: dict[str, float], timeline):
    """Add up each step of a flatten call's host milliseconds into ``spent``, and record the call's timeline (each
    step's host start and end, the device's end of the lead and of each turn: ``probe_flatten_timeline.Timeline``,
    started by :func:`_timed_flattens`), for the block (``probe_flatten_timeline.steps_wrapped``). Imports the
    flatten's modules before the timed step, which a plain cell leaves to the step itself: hence opt-in
    (``--flatten-steps``), for finding where a fresh process's flatten spends its time."""
    from bench.probe_flatten_timeline import steps_wrapped

    def add(label, start, end, result):
        spent[label] = spent.get(label, 0.0) + (end - start) * 1e3
        return timeline.record(label, start, end, result)

    return steps_wrapped(add)


@contextlib.contextmanager
def _collections(out: dict, key: str):
    """Add the seconds the garbage collector spent in the block, per generation, to ``out[key]``: a full
    collection of a process holding torch's and DeepSpeed's objects takes ~0.1-0.2 s, and it lands on whichever
    step crosses the collector's threshold (session 11)."""
    import gc

    spent = out.setdefault(key, {})
    started: list[float] = []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            name = f"gen{info['generation']}"
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started.pop()
            spent[name + "_count"] = spent.get(name + "_count", 0) + 1

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


@contextlib.contextmanager
def _timed_flattens(out: dict, sync, timeline=None):
    """Add each ``flatten_dense_tensors_aligned`` call's seconds (synchronised on both sides) to
    ``out["flatten_seconds"]``: the one step the key changes at ZeRO-2, DeepSpeed's ``torch.cat`` or ztriton's
    flatten, as the fresh process pays it (first calls and the flat buffer's allocation included). With a
    ``timeline`` (``--flatten-steps``), the first call's timeline goes to ``out["flatten_timeline"]``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    installed = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned  # ztriton's wrapper when the key's hooks are in
    out["flatten_seconds"] = 0.0
    out["flatten_imports"] = []  # the modules the flatten imported (a fresh process pays their import there)

    def timed_flatten(self, *args, **kwargs):
        sync()
        before = set(sys.modules)
        first = timeline is not None and "flatten_timeline" not in out
        if first:
            timeline.start()
        start = time.perf_counter()
        try:
            with _collections(out, "flatten_gc"):
                return installed(self, *args, **kwargs)
        finally:
            returned = timeline.now_ms() if first else None
            sync()
            out["flatten_seconds"] += time.perf_counter() - start
            out["flatten_imports"] += sorted(set(sys.modules) - before)
            if first:
                out["flatten_timeline"] = {**timeline.result(), "returned_ms": returned, "whole_ms": timeline.now_ms()}

    DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = timed_flatten
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = installed


# What ``--trace`` follows: every module a ZeRO-2 flatten or a ZeRO-3 defragment passes through (not
# ztriton.kernels.copy: importing it imports triton, which changes what a fresh process's step pays).
TRACED_MODULES = ["ztriton.integrations.deepspeed.optimizers", "ztriton.integrations.deepspeed.report",
                  "ztriton.flatten.groups", "ztriton.flatten.tiers", "ztriton.defragmenting", "ztriton.comm",
                  "ztriton.memory", "ztriton.policy", "ztriton.layout", "ztriton.staging", "ztriton.kernels",
                  "ztriton.kernels.ops", "ztriton.kernels.turns", "ztriton.kernels.plan", "ztriton.kernels.checks",
                  "ztriton.kernels.pieces", "ztriton.kernels.validation", "ztriton.kernels.state",
                  "ztriton.kernels.launch", "ztriton.kernels.tables", "ztriton.kernels.torch_route",
                  "ztriton.kernels.words"]
# torch's calls the flatten's torch route makes, each the first in a fresh process (kernel loading, first dispatch).
TRACED_TORCH = ("torch._foreach_copy_", "torch._foreach_zero_", "torch.Tensor.copy_", "torch.Tensor.zero_",
                "torch.Tensor.split", "torch.Tensor.view", "torch.Tensor.as_strided", "torch.Tensor.narrow",
                "torch.empty", "torch.zeros")
# What ``--trace-deepspeed`` follows, key off and on alike: DeepSpeed's initialize down to the ZeRO-1/2 optimizer's
# methods, the config's parse and the collectives, so that the key's cost outside its own steps shows by phase.
TRACED_DEEPSPEED = ["deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
                    "deepspeed.runtime.config", "deepspeed.runtime.utils", "deepspeed.comm.comm",
                    "deepspeed.comm"]  # (the package's own names for comm.comm's functions: what DeepSpeed calls)


@contextlib.contextmanager
def _threads_recorded(out: dict, origin: float):
    """Each thread that runs in the block: its name, start and end (seconds from ``origin``, the process's start)
    and CPU seconds, in ``out["threads"]``: what of the key's background work (the preload, torch's cat kernel)
    overlaps the main thread's."""
    import threading

    found = out.setdefault("threads", [])
    run = threading.Thread.run

    def recorded(self):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            run(self)
        finally:
            found.append({"name": self.name, "start": start - origin, "end": time.perf_counter() - origin,
                          "cpu_seconds": time.thread_time() - cpu})

    threading.Thread.run = recorded
    try:
        yield
    finally:
        threading.Thread.run = run


def run_cell(step: str, backend: str, world: int, rank: int, smoke: bool, flatten_steps: bool = False,
             trace: bool = False, preimport: tuple[str, ...] = (), trace_deepspeed: bool = False) -> dict:
    import importlib

    import torch

    from bench.harness import cpu_fallback
    from bench.trace_calls import traced  # (bench's own: imports nothing of ztriton or DeepSpeed)

    cpu_fallback()
    import ztriton  # noqa: F401
    import deepspeed
    from bench.models import LLMMix, llm_mix
    # Not ztriton.testing: it imports the kernels, hence triton, which a user's key-off process never imports
    # and a key-on one only where a copy needs a kernel; the cells' timed steps must pay that import themselves.
    from ztriton.integrations.deepspeed.worlds import simulated_world

    for name in preimport:  # --preimport: what the step would import, paid before it (an experiment)
        importlib.import_module(name)
    imported = time.perf_counter() - STARTED
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shapes = [[64, 64]] * 6 + [[64]] * 12 + [[1000, 8]] * 2 if smoke else llm_mix()
    layers = 2 if smoke else 50

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - start

    out = {"step": step, "backend": backend, "import_seconds": imported}
    # ztriton's INFO lines (each step's tier and its own seconds: what of the cell's time is ours); a handful per
    # process, the same lines DeepSpeed's logger shows the user.
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ztriton").addHandler(handler)
    logging.getLogger("ztriton").setLevel(logging.INFO)
    key_on = backend.startswith("triton")  # only ztriton's steps are wrapped or traced
    spent = {} if flatten_steps and key_on else None
    timeline = None
    if spent is not None:
        from bench.probe_flatten_timeline import Timeline

        timeline = Timeline(torch.cuda.is_available())
    calls = deepspeed_calls = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulated_world(world, rank))
        if spent is not None:
            stack.enter_context(_flatten_steps(spent, timeline))
        if trace and key_on:
            calls = stack.enter_context(traced(TRACED_MODULES, TRACED_TORCH))
        if trace_deepspeed:
            deepspeed_calls = stack.enter_context(traced(TRACED_DEEPSPEED))
            stack.enter_context(_threads_recorded(out, STARTED))
        if step == "zero2":
            model = LLMMix(shapes, layers, dtype=torch.bfloat16, device=device)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            cpu, out["initialize_start"] = time.thread_time(), time.perf_counter() - STARTED  # (threads' clock)
            with _timed_flattens(out, sync, timeline), _collections(out, "initialize_gc"):
                _, out["initialize_seconds"] = timed(lambda: deepspeed.initialize(
                    model=model, optimizer=optimizer, config=_config(backend, 2)))
            out["initialize_cpu_seconds"] = time.thread_time() - cpu  # the main thread's own CPU time in it
        else:
            config = _config(backend, 3)

            def build():
                with deepspeed.zero.Init(config_dict_or_path=config):
                    return LLMMix(shapes, layers)

            model, out["build_seconds"] = timed(build)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            _, out["initialize_seconds"] = timed(lambda: deepspeed.initialize(
                model=model, optimizer=optimizer, config=config))
    out["process_seconds"] = time.perf_counter() - STARTED
    out["ztriton_lines"] = lines
    import ztriton.kernels  # (after the timed steps) which checkout this cell ran: --ab-tree's check
    from ztriton.kernels import state

    out["launches"] = state.launches()  # the kernels' launches in this process's steps (0: torch's copies only)

    out["ztriton_from"] = [str(Path(m.__file__).resolve().parent.parent) for m in (ztriton, ztriton.kernels)]
    if spent is not None:
        out["flatten_steps_ms"] = spent
    if calls is not None:
        out["trace"] = calls.lines(min_ms=0.5)
    if deepspeed_calls is not None:
        out["deepspeed_trace"] = deepspeed_calls.as_dict(min_ms=0.05)
    return out


def _child(step: str, backend: str, cache: str, args) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    script = __file__
    if backend == AB_BACKEND:  # the other tree's own cell, its ztriton first on the path
        tree = Path(args.ab_tree).resolve()
        script, backend = str(tree / "bench" / "bench_coldstart.py"), "triton"
        keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *keep])
    cmd = [sys.executable, script, "--cell", step, backend, "--world", str(args.world), "--rank", str(args.rank)]
    if args.smoke:
        cmd.append("--smoke")
    if args.flatten_steps:
        cmd.append("--flatten-steps")
    if args.trace:
        cmd.append("--trace")
    if args.trace_deepspeed:
        cmd.append("--trace-deepspeed")
    if args.preimport:
        cmd += ["--preimport", *args.preimport]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:], "wall_seconds": wall}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_seconds"] = wall
    ran = {Path(p) for p in result.get("ztriton_from", [])}  # (a tree older than this check does not say)
    if ran and ran != {Path(script).resolve().parent.parent}:
        return {"error": f"the cell ran ztriton from {sorted(map(str, ran))}, not {Path(script).parent.parent}: an "
                         "editable install or start-up hook of another checkout shadows it (run where PYTHONPATH "
                         "alone names the tree, as on the lent GPU machine)", "tail": "", "wall_seconds": wall}
    if proc.returncode != 0:  # the step finished and printed its figures, then the process died at exit: keep both
        result["exit_code"] = proc.returncode
        result["exit_tail"] = (proc.stdout + proc.stderr)[-1500:]
    return result


def _median(runs: list[dict]) -> dict:
    """One cell from its processes: each figure's median (the first run's error if any failed), the runs kept."""
    import statistics

    if len(runs) == 1 or any("error" in r for r in runs):
        return runs[-1] if len(runs) == 1 else next(r for r in runs if "error" in r)
    keys = [k for k in runs[0] if k.endswith("_seconds")]
    aborted = [r["exit_code"] for r in runs if "exit_code" in r]
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in keys}, "runs": runs,
            "processes_that_died_at_exit": len(aborted)}


def _paired(off: dict, on: dict, fields: tuple) -> dict:
    """The median of key on minus key off over the rounds (one process of each, run one after the other), and
    how many rounds key on was the faster: less exposed to the host's drift than the difference of medians."""
    import statistics

    pairs = [(sum(a[f] for f in fields), sum(b[f] for f in fields))
             for a, b in zip(off.get("runs", []), on.get("runs", []))]
    if not pairs:
        return {}
    return {"paired_median_on_minus_off": statistics.median(b - a for a, b in pairs),
            "rounds_key_on_faster": sum(b < a for a, b in pairs), "rounds": len(pairs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", nargs=2, metavar=("STEP", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rank", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--flatten-steps", action="store_true",
                        help="key-on cells add up each flatten step's host ms (imports its modules before the step)")
    parser.add_argument("--trace", action="store_true",
                        help="key-on cells keep a wall-clock call tree of ztriton's functions (bench/trace_calls.py; "
                             "imports them before the step)")
    parser.add_argument("--trace-deepspeed", action="store_true",
                        help="every cell keeps a wall-clock call tree of DeepSpeed's initialize (engine, ZeRO-1/2 "
                             "optimizer, config, collectives; main thread) and its threads' spans "
                             "(bench/probes/compare_traces.py compares key on with key off)")
    parser.add_argument("--preimport", nargs="+", default=[], metavar="MODULE",
                        help="cells import these before the timed step (to learn what a first import costs it)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--warm-repeats", type=int, default=1,
                        help="warm processes per step and backend; each warm figure is their median")
    parser.add_argument("--steps", nargs="+", default=["zero2", "zero3"], choices=["zero2", "zero3"])
    parser.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=BACKENDS)
    parser.add_argument("--ab-tree", type=Path, default=None, metavar="DIR",
                        help="another checkout (e.g. git archive REV | tar -x -C DIR): its key-on cells run in every "
                             "round beside this tree's; ratios gain '<step>/<temperature>/ab', this tree's key on "
                             "minus that tree's, paired per round. Needs a set-up where PYTHONPATH alone names the "
                             "tree (no editable install of either: the lent GPU machine's)")
    args = parser.parse_args(argv)
    if args.ab_tree is not None:
        if not (args.ab_tree / "bench" / "bench_coldstart.py").is_file():
            parser.error(f"--ab-tree {args.ab_tree} holds no bench/bench_coldstart.py")
        args.backends = [*args.backends, AB_BACKEND]
    if args.cell:
        print("RESULT " + json.dumps(run_cell(*args.cell, args.world, args.rank, args.smoke, args.flatten_steps,
                                                 args.trace, tuple(args.preimport), args.trace_deepspeed)),
              flush=True)
        return 0

    cells: dict[str, dict] = {}
    for step in args.steps:
        caches = {backend: tempfile.mkdtemp(prefix=f"triton_cache_{step}_{backend}_") for backend in args.backends}
        runs: dict[str, list[dict]] = {f"{step}/{backend}/{t}": [] for backend in args.backends for t in ("cold", "warm")}
        # Each backend's cold process first (it fills that backend's cache), then the warm ones in rounds of one
        # process per backend: the host's speed drifts over minutes (session 8's warm cells read key off 1.33-1.91 s),
        # and back-to-back repeats of one backend would carry that drift into the ratio.
        order = [(backend, "cold") for backend in args.backends]
        order += [(backend, "warm") for _ in range(args.warm_repeats) for backend in args.backends]
        for backend, temperature in order:
            key = f"{step}/{backend}/{temperature}"
            if runs[key] and "error" in runs[key][-1]:
                continue
            result = _child(step, backend, caches[backend], args)
            runs[key].append(result)
            if "error" in result:
                print(f"[coldstart] {key}: FAILED ({result['error']})\n{result['tail']}", flush=True)
                continue
            steps = ", ".join(f"{k[:-8]} {v:.2f} s" for k, v in result.items()
                              if k.endswith("_seconds") and k not in ("wall_seconds",))
            print(f"[coldstart] {key}: {steps}, launches {result.get('launches')}, wall {result['wall_seconds']:.1f} s",
                  flush=True)
            if "exit_code" in result:
                print(f"[coldstart] {key}: the process died at exit (code {result['exit_code']}) after its "
                      f"step finished:\n{result['exit_tail'][-400:]}", flush=True)
        cells.update({key: _median(found) for key, found in runs.items() if found})
    ratios = {}
    for name, step, fields in (("zero2", "zero2", ("initialize_seconds",)),
                               ("zero2-flatten", "zero2", ("flatten_seconds",)),
                               ("zero3", "zero3", ("build_seconds", "initialize_seconds"))):
        for temperature in ("cold", "warm"):
            off = cells.get(f"{step}/torch/{temperature}", {})
            for backend in [b for b in args.backends if b != "torch"] if "torch" in args.backends else ():
                on = cells.get(f"{step}/{backend}/{temperature}", {})
                if not off or not on or "error" in off or "error" in on:
                    continue
                total_off = sum(off[f] for f in fields)
                total_on = sum(on[f] for f in fields)
                suffix = "" if backend == "triton" else f"/{backend}"
                ratios[f"{name}/{temperature}{suffix}"] = {
                    "key_off_seconds": total_off, "key_on_seconds": total_on,
                    "on_over_off": total_on / total_off, "on_minus_off": total_on - total_off,
                    **_paired(off, on, fields)}
            this, other = (cells.get(f"{step}/{b}/{temperature}", {}) for b in ("triton", AB_BACKEND))
            if this and other and "error" not in this and "error" not in other:
                paired = _paired(other, this, fields)  # as "on minus off": this tree minus the other
                ratios[f"{name}/{temperature}/ab"] = {
                    "other_tree_seconds": sum(other[f] for f in fields),
                    "this_tree_seconds": sum(this[f] for f in fields),
                    **({"paired_median_this_minus_other": paired["paired_median_on_minus_off"],
                        "rounds_this_tree_faster": paired["rounds_key_on_faster"], "rounds": paired["rounds"]}
                       if paired else {})}
    print(json.dumps(ratios, indent=1), flush=True)
    from bench.harness import write_result

    out = args.out or (ROOT / "bench" / "results" / ("coldstart_smoke.json" if args.smoke else "coldstart.json"))
    print(f"[coldstart] wrote {write_result(out.stem, {'world': args.world, 'rank': args.rank, 'cells': cells, 'ratios': ratios}, out.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
