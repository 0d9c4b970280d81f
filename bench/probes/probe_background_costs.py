"""What each piece of the key's work from a config's parse costs, run in the foreground of a fresh process, one
after the other (the model already on the GPU): each compiled word copy's load, the pinned blocks, torch's cat
kernel (the preload's threads run these) and the step's import (on the caller's thread). Wall and CPU ms each
(CPU time in a thread is what a background thread can take from the main thread's Python, through the GIL, where
the part is not a C call that releases it), median over fresh processes, and the import's slowest modules
(``-X importtime``). One GPU.

    python bench/probes/probe_background_costs.py [--processes 5] [--out FILE.json]
    python bench/probes/probe_background_costs.py --gil [--processes 5]   # what each takes from the main thread
    python bench/probes/probe_background_costs.py --gil --main cuda         # ... from one launching small kernels
    python bench/probes/probe_background_costs.py --start                   # what starting the threads takes

``--gil``: each piece alone in a background thread (fresh process each), while the main thread runs pure Python;
the main thread's loss (the time its loop would have taken at its own rate before, against what it took) is the
GIL time the piece held, and the piece's own wall time beside it. ``--main cuda``: the main thread's loop launches
a tiny kernel per turn instead (as DeepSpeed's set-up of a model on the GPU does between its Python), so that its
loss also counts waits on the CUDA driver's locks that the piece's loads and pinned allocations hold. ``loads``:
the word classes bf16 params use; ``all``: the threads a ZeRO-2 config with the key and bf16 starts
(``config.start_preload``, after ``prepare_step``'s import on the caller's thread). ``import`` in a thread is a
comparison: the key imports on the caller's thread.

``--start``: how long ``config.start_preload`` (bf16) keeps the caller's thread, and when its threads are done.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _as_a_user_s_process() -> None:
    """What a user's process has before DeepSpeed reads the config: deepspeed, ztriton and its hooks' modules
    imported, a model on the GPU (the context exists)."""
    import torch

    import deepspeed  # noqa: F401
    import ztriton  # noqa: F401
    from ztriton.integrations.deepspeed import optimizers  # noqa: F401 -- the hooks' modules

    torch.nn.Linear(64, 64, device="cuda")
    torch.cuda.synchronize()


def child() -> dict:
    import torch

    _as_a_user_s_process()
    out: dict[str, list[float]] = {}

    def timed(name, work):
        wall, cpu = time.perf_counter(), time.thread_time()
        work()
        torch.cuda.synchronize()
        out[name] = [(time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3]

    from ztriton.integrations.deepspeed.config import rank_device

    timed("rank_device", rank_device)
    timed("import ztriton.kernels.warmup", lambda: __import__("ztriton.kernels.warmup"))
    from ztriton.kernels import compiled, warmup
    from ztriton.kernels.tuning import KERNELS_ONLY
    from ztriton.kernels.variants import WORD_COPY, word_meta

    device = torch.device("cuda", 0)
    timed("first torch.cuda.Stream", lambda: torch.cuda.Stream(device))  # what each thread's warm_up creates
    for unit in warmup._PRELOAD_UNITS:
        timed(f"load word copy {unit}", lambda: compiled.preload(0, WORD_COPY, word_meta(unit, KERNELS_ONLY)))
    timed("pinned blocks", lambda: warmup._fill_pinned_cache(device))
    timed("torch's cat", lambda: warmup._cat_once(device))
    timed("import ztriton.flatten", lambda: __import__("ztriton.flatten"))
    return out


def start_child() -> dict:
    """How long the caller's thread takes to start the preload's threads (``config.start_preload``, after the
    step's import, as ``prepare_step`` runs it) and how long until they end, in a fresh process."""
    _as_a_user_s_process()
    from ztriton.integrations.deepspeed.config import start_preload
    from ztriton.kernels import warmup

    import ztriton.flatten  # noqa: F401 -- imported first, as prepare_step does

    wall, cpu = time.perf_counter(), time.thread_time()
    start_preload(2)  # bf16 params, as bench_coldstart's config says
    started_ms, started_cpu_ms = (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3
    assert warmup._threads, "no preload thread started (several GPUs and no LOCAL_RANK?)"
    for thread in list(warmup._threads):
        thread.join()
    return {"start_preload_ms": started_ms, "start_preload_cpu_ms": started_cpu_ms,
            "threads_done_ms": (time.perf_counter() - wall) * 1e3}


def _pieces(device):
    """Each piece of the background work by name, as a callable."""
    from ztriton.integrations.deepspeed.config import start_preload
    from ztriton.kernels import warmup

    def all_threads():  # the key's own threads for a bf16 config, joined
        start_preload(2)
        for thread in list(warmup._threads):
            thread.join()

    return {"import": lambda: __import__("ztriton.flatten"),
            "loads": lambda: warmup.load_word_copies(device, warmup.word_units(2)),
            "pinned": lambda: warmup._fill_pinned_cache(device), "cat": lambda: warmup._cat_once(device),
            "all": all_threads}


def gil_child(piece: str, main: str = "python") -> dict:
    """The main thread's loss to ``piece`` running in a thread (ms), and the piece's wall ms; the main thread runs
    pure Python (``main="python"``) or launches a tiny kernel per turn of its loop (``"cuda"``)."""
    import threading

    import torch

    _as_a_user_s_process()
    from ztriton.kernels import warmup  # noqa: F401 -- imported before: its import is not a piece

    small = torch.zeros(16, device="cuda")
    small.add_(1)  # its kernel loaded before the rate is measured
    torch.cuda.synchronize()
    work = _pieces(torch.device("cuda", 0))[piece]
    inner = 200 if main == "python" else 1

    def spin(until) -> tuple[int, float]:
        count, start = 0, time.perf_counter()
        while not until():
            if main == "cuda":
                small.add_(1)
            for _ in range(inner):
                count += 1
        return count, time.perf_counter() - start

    deadline = time.perf_counter() + 0.2
    count, spent = spin(lambda: time.perf_counter() > deadline)
    rate = count / spent  # iterations a second, alone
    torch.cuda.synchronize()  # no backlog of the rate's kernels into the measured loop
    span = {}

    def run():
        start = time.perf_counter()
        work()
        span["wall_ms"] = (time.perf_counter() - start) * 1e3

    thread = threading.Thread(target=run)
    thread.start()
    count, spent = spin(lambda: not thread.is_alive())
    thread.join()
    return {"loss_ms": (spent - count / rate) * 1e3, "piece_wall_ms": span["wall_ms"], "main_ms": spent * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gil", action="store_true")
    parser.add_argument("--start", action="store_true",
                        help="how long starting the preload's threads takes the caller (fresh processes)")
    parser.add_argument("--start-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--main", choices=("python", "cuda"), default="python",
                        help="with --gil: what the main thread runs meanwhile")
    parser.add_argument("--gil-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.main != "python" and not (args.gil or args.gil_child):
        parser.error("--main goes with --gil")
    if args.child:
        print("RESULT " + json.dumps(child()), flush=True)
        return 0
    if args.gil_child:
        print("RESULT " + json.dumps(gil_child(args.gil_child, args.main)), flush=True)
        return 0
    if args.start_child:
        print("RESULT " + json.dumps(start_child()), flush=True)
        return 0
    if args.gil:
        return _gil(args)
    if args.start:
        return _start(args)
    runs, slowest = [], []
    for _ in range(args.processes):
        result, done = _child_result([sys.executable, "-X", "importtime", __file__, "--child"])
        if result is None:
            return 1
        runs.append(result)
        # the modules the flatten's import executed (self us), from the import-time lines after ztriton.kernels.warmup
        lines = done.stderr.splitlines()
        start = max((i for i, ln in enumerate(lines) if ln.rstrip().endswith("ztriton.kernels.warmup")), default=0)
        mods = [ln.split("|") for ln in lines[start + 1:] if ln.startswith("import time:") and "[us]" not in ln]
        slowest.append(sorted(((int(m[0].split(":")[1]), m[2].strip()) for m in mods), reverse=True)[:8])
    figures = {name: {"wall_ms": statistics.median(r[name][0] for r in runs),
                      "cpu_ms": statistics.median(r[name][1] for r in runs)} for name in runs[0]}
    for name, f in figures.items():
        print(f"{name:32s} wall {f['wall_ms']:7.2f} ms  cpu {f['cpu_ms']:7.2f} ms")
    print("slowest modules after the warm-up's import (self us), first process:", slowest[0])
    if args.out:
        args.out.write_text(json.dumps({"figures": figures, "runs": runs, "slowest_modules": slowest}, indent=1))
    return 0


def _child_result(command: list[str]):
    """Run one fresh process; its RESULT line's dict (None, with its output printed, if it printed none) and the
    finished process."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    found = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not found:
        print(done.stdout[-2000:], done.stderr[-3000:])
        return None, done
    return json.loads(found[-1][len("RESULT "):]), done


def _gil(args) -> int:
    """Each piece in its own fresh processes, pieces interleaved."""
    found: dict[str, list[dict]] = {}
    for _ in range(args.processes):
        for piece in ("import", "loads", "pinned", "cat", "all"):
            result, _ = _child_result([sys.executable, __file__, "--gil-child", piece, "--main", args.main])
            if result is None:
                return 1
            found.setdefault(piece, []).append(result)
    figures = {piece: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for piece, runs in found.items()}
    for piece, f in figures.items():
        each = ", ".join(f"{r['loss_ms']:.1f}" for r in found[piece])
        print(f"{piece:8s} main thread's loss {f['loss_ms']:6.2f} ms (median; each: {each}), "
              f"the piece's wall {f['piece_wall_ms']:6.2f} ms")
    if args.out:
        args.out.write_text(json.dumps({"gil": figures, "main": args.main, "runs": found}, indent=1))
    return 0


def _start(args) -> int:
    runs = []
    for _ in range(args.processes):
        result, _ = _child_result([sys.executable, __file__, "--start-child"])
        if result is None:
            return 1
        runs.append(result)
    figures = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("start_preload on the caller's thread %.2f ms (CPU %.2f ms; each: %s), its threads done after %.2f ms" % (
        figures["start_preload_ms"], figures["start_preload_cpu_ms"],
        ", ".join(f"{r['start_preload_ms']:.2f}" for r in runs), figures["threads_done_ms"]))
    if args.out:
        args.out.write_text(json.dumps({"start": figures, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
