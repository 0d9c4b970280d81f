"""Benchmark plumbing shared by every bench script: timing, same-run torch baselines, JSON, plots.

Every figure a benchmark reports is a ratio to torch measured in the same run on the same device, so
results from different machines and days compare by their ratios, not their absolute numbers.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ztriton.memory import measure_peak  # noqa: F401  (re-exported: every bench script times with it)

RESULTS = Path(__file__).resolve().parent / "results"
CUDA = torch.cuda.is_available()


def cpu_fallback(threads: int | None = None) -> bool:
    """Without CUDA: the kernels under Triton's interpreter and DeepSpeed on its CPU accelerator (both read
    once, when the kernels module or deepspeed is first imported: call this before), ``threads`` intra-op
    threads if given (on a shared CPU, threads waiting on each other skew every figure). True if on CPU."""
    if CUDA:
        return False
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if threads is not None:
        torch.set_num_threads(threads)
    return True


def time_ms(fn: Callable[[], object], warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds of ``fn`` on the device (``triton.testing.do_bench``), or wall clock on CPU."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def best_host_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    """The best of ``repeats`` wall-clock milliseconds of ``fn`` after one untimed call: host time alone."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def gbps(nbytes: int, ms: float) -> float:
    """Bytes moved (read plus written) over milliseconds, in GB/s (1e9 bytes)."""
    return nbytes / ms / 1e6


def torch_copy_gbps(nbytes: int) -> float:
    """Bandwidth of torch's device-to-device ``copy_`` of ``nbytes``, counting read plus write."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    return gbps(2 * nbytes, ms)


def environment() -> dict:
    """Device and library versions, recorded with every result."""
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # a benchmark without DeepSpeed still records why it is missing
        env["deepspeed"] = f"unavailable: {type(exc).__name__}"
    return env


def write_result(name: str, figures: dict, out_dir: Path | None = None) -> Path:
    """Write ``{environment, figures}`` as ``<out_dir or bench/results>/<name>.json``."""
    out = Path(out_dir or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), "figures": figures}, indent=2, default=str))
    return path


def plot_ratios(path: Path, title: str, labels: list[str], series: dict[str, list[float]],
                ylabel: str = "ratio to torch copy bandwidth", target: float | None = None) -> Path:
    """Grouped bar chart (one group per label, one bar per series) saved as a PNG; skipped, with a line
    saying so, where matplotlib is not installed (the JSON holds every figure)."""
    try:
        import matplotlib
    except ImportError:
        print(f"(matplotlib is not installed: no {path.name})", flush=True)
        return path

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels)), 4))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@contextlib.contextmanager
def kernel_launches_skipped():
    """Inside: plans are made (checks, tables, uploads) but nothing is launched, so only host time is
    left to measure; the buffers' contents are then garbage."""
    from ztriton.kernels.launch import Plan

    original = Plan._launch_all
    Plan._launch_all = lambda self, stream: None
    try:
        yield
    finally:
        Plan._launch_all = original


def free_device_memory() -> None:
    """Give cached device and pinned host memory back, so that one case's cache does not crowd the next."""
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()


# --------------------------------------------------------------------------------------------- probes


def release() -> None:
    """Free what the last case left: Python garbage, the device cache, torch's pinned host cache."""
    gc.collect()
    free_device_memory()


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


@contextlib.contextmanager
def ztriton_log():
    """The ztriton logger's lines during the block (which tier ran, what went to the host)."""
    logger, handler = logging.getLogger("ztriton"), _Lines()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def probe(owner: Any, name: str, calls: list[dict]):
    """Wrap ``owner.name`` (whatever is installed there now, ztriton's hook included) for the block:
    each call's seconds (synchronised) and peak device bytes above what was allocated at its start.

    The peak counter is reset for the call; the peak before it is kept in ``peak_before_abs``, so the
    caller can still report the peak of the whole enclosing call."""
    own = name in vars(owner)
    current = getattr(owner, name)

    @functools.wraps(current)
    def wrapped(*args, **kwargs):
        sync()
        entry = {"peak_before_abs": torch.cuda.max_memory_allocated() if CUDA else 0}
        base = allocated()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = current(*args, **kwargs)
        sync()
        entry["seconds"] = time.perf_counter() - start
        entry["peak_bytes"] = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
        calls.append(entry)
        return out

    setattr(owner, name, wrapped)
    try:
        yield calls
    finally:
        if own:
            setattr(owner, name, current)
        else:
            delattr(owner, name)


def measure_with_probe(fn: Callable[[], Any], owner: Any, name: str) -> tuple[Any, float, int, list[dict]]:
    """``measure_peak(fn)`` with ``owner.name`` probed; the peak is the whole call's despite the probe's reset."""
    sync()
    base = allocated()
    calls: list[dict] = []
    with probe(owner, name, calls):
        out, secs, peak = measure_peak(fn)
    if CUDA and calls:
        peak = max(peak, max(c["peak_before_abs"] for c in calls) - base)
    for c in calls:
        c.pop("peak_before_abs")
    return out, secs, peak, calls
