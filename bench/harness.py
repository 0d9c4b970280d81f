"""Benchmark plumbing shared by every bench script: timing, same-run torch baselines, JSON, plots.

Every figure a benchmark reports is a ratio to torch measured in the same run on the same device, so
results from different machines and days compare by their ratios, not their absolute numbers.
"""
from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_ms(fn: Callable[[], object], warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds of ``fn`` on the device (``triton.testing.do_bench``), or wall clock on CPU."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    import time

    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def measure_peak(fn: Callable[[], object]) -> tuple[object, float, int]:
    """Run ``fn`` once: its result, wall seconds (device synchronised), and the peak device bytes
    allocated above what was allocated before the call (0 without CUDA)."""
    import time

    if not torch.cuda.is_available():
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start, 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start, torch.cuda.max_memory_allocated() - base


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
    """Grouped bar chart (one group per label, one bar per series) saved as a PNG."""
    import matplotlib

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
