"""Memory: how much is free (the probe), allocations that fail cleanly, aliasing, size formatting.

Shared by the entry points (partitioning, flatten, defragment, loading, sharded init). The probe reads
numbers; what to do with them is :mod:`ztriton.policy`'s job.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger("ztriton")

MiB = 1 << 20
GiB = 1 << 30

__all__ = ["GiB", "MiB", "MemoryInfo", "OutOfMemory", "alias", "check_kernels_take", "contiguous_strides", "empty",
           "empty_first_fitting", "flat_bytes", "format_bytes", "host_available_bytes", "host_empty", "kernels_run_on",
           "measure_peak", "probe_memory", "synchronize", "try_empty", "try_host_empty", "unit_strided"]


def kernels_run_on(device: torch.device) -> bool:
    """The Triton kernels run on CUDA tensors, and on CPU tensors only under the interpreter.

    triton decides when the kernels are first imported whether it interprets; TRITON_INTERPRET set since
    cannot make CPU tensors launchable, but unset (or "0") it still sends them to the plain-torch path.
    The variable is read first: asking the kernels while it reads "0" must not import them then."""
    from ztriton.kernels.plan import runs_on  # on first use (triton only for a launch)

    return (device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1") and runs_on(device)


def synchronize(device: torch.device | None = None) -> None:
    """Wait for ``device``'s queued work (non-blocking copies included); nothing to wait for on the CPU.

    ``None``: the current CUDA device, if there is one (where copies between pinned host memory and the
    device ran, whichever side the caller's buffer is on)."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def alias(storage: torch.UntypedStorage, offset: int, numel: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """A 1-D tensor of its own over ``storage[offset:offset + numel]``, not an autograd view.

    DeepSpeed re-points partitions (``ds_tensor.data = ...``); a view would keep its base, and so the
    whole old buffer, alive through ``_base`` after every partition had moved.
    """
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (numel,), (1,))


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides torch gives a new contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def unit_strided(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where torch calls it contiguous while its strides are not a new tensor's, the same
    elements of the same memory with a new tensor's strides.

    torch ignores the strides of size-1 dims (and every stride of a tensor of at most one element) when it
    decides contiguity, so a slice ``x[3::2][:1]`` is contiguous with stride 2; viewing it as 1-D or as
    bytes needs the strides a new tensor has. Every contiguous source handed to torch's copies goes through this;
    the kernels' packs need not (they read a contiguous source's elements from its address, whatever those strides)."""
    shape = tensor.shape
    if (1 not in shape and 0 not in shape) or not tensor.is_contiguous():
        return tensor
    strides = contiguous_strides(shape)
    if tensor.stride() == strides:
        return tensor
    return tensor.detach().as_strided(shape, strides, tensor.storage_offset())


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D ``uint8`` view (any strides on its size-1 dims, see
    :func:`unit_strided`)."""
    return unit_strided(tensor).reshape(-1).view(torch.uint8)


def format_bytes(nbytes: int) -> str:
    """Bytes for a log line or an error: GiB, MiB, KiB or B, whichever reads best."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes} B"


# --------------------------------------------------------------------------------------------
# The probe.


@dataclass(frozen=True)
class MemoryInfo:
    """Free bytes on one device and on the host, and where the device figure came from."""

    device: str
    device_free: int
    device_total: int
    host_available: int
    source: str  # "nvml", "torch" or "host" (a CPU device)


def host_available_bytes() -> int:
    """Memory the host can still hand out (``MemAvailable``), without psutil."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# (pid, pynvml module or None): NVML initialised once per process. nvmlInit costs 0.1 s to over a second on
# a multi-GPU host and every probe would pay it with an init/shutdown pair; a forked child initialises anew.
_NVML: list[tuple[int, Any]] = []
# NVML device handles by (pid, physical index): looked up once per process, not on every probe.
_NVML_HANDLES: dict[tuple[int, int], Any] = {}


def _nvml() -> Any:
    """pynvml, initialised for this process; None if NVML is not usable (not installed, no driver)."""
    if _NVML and _NVML[0][0] == os.getpid():
        return _NVML[0][1]
    try:
        import pynvml

        pynvml.nvmlInit()  # never shut down: the process's exit releases it, as torch's own NVML use does
    except Exception:
        pynvml = None
    _NVML[:] = [(os.getpid(), pynvml)]
    return pynvml


def _nvml_free(index: int) -> tuple[int, int] | None:
    """(free, total) of a CUDA device as the driver sees it, other processes included; None if NVML fails
    (not installed, or a device such as GB10 that refuses ``nvmlDeviceGetMemoryInfo``)."""
    pynvml = _nvml()
    if pynvml is None:
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = int(visible.split(",")[index]) if visible else index
        handle = _NVML_HANDLES.get((os.getpid(), physical))
        if handle is None:
            handle = _NVML_HANDLES[(os.getpid(), physical)] = pynvml.nvmlDeviceGetHandleByIndex(physical)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)
    except Exception:
        return None


def probe_memory(device: torch.device | str) -> MemoryInfo:
    """Free memory on ``device`` and the host.

    On CUDA, NVML's figure (which sees other processes) with ``torch.cuda.mem_get_info`` as the
    fallback; either way the caching allocator's reserved-but-unused bytes count as free, since this
    process can reuse them.
    """
    device = torch.device(device)
    host = host_available_bytes()
    if device.type != "cuda":
        return MemoryInfo(str(device), host, host, host, "host")
    index = device.index if device.index is not None else torch.cuda.current_device()
    cached = _cached_bytes(index)
    nvml = _nvml_free(index)
    if nvml is not None:
        free, total = nvml
        source = "nvml"
    else:
        free, total = torch.cuda.mem_get_info(index)
        source = "torch"
    return MemoryInfo(str(device), free + cached, total, host, source)


def _cached_bytes(index: int) -> int:
    """The caching allocator's reserved-but-unallocated bytes on a CUDA device. From one nested stats dict:
    memory_reserved and memory_allocated each flatten the whole dict first (~0.1 ms apiece per probe)."""
    stats = torch.cuda.memory_stats_as_nested_dict(index)  # {} where CUDA is not initialised: nothing reserved
    return _stat(stats, "reserved_bytes") - _stat(stats, "allocated_bytes")


def _stat(stats: dict, name: str, which: str = "current") -> int:
    """One all-pools figure of a nested CUDA allocator stats dict (0 where it is missing)."""
    return stats.get(name, {}).get("all", {}).get(which, 0)


def measure_peak(fn: Callable[[], Any], *, synchronize: bool = True) -> tuple[Any, float, int]:
    """Run ``fn`` once: its result, wall seconds (device synchronised before and after; with
    ``synchronize=False`` the host's seconds, the device's work possibly still queued), and the peak device
    bytes allocated above what was allocated before the call (0 without CUDA). The peak needs no
    synchronisation: the allocator counts on the host, when an allocation is asked for."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start, 0
    # The allocator's figures from its nested stats dict: memory_allocated and max_memory_allocated each
    # flatten the whole dict first (~0.1 ms apiece, a fifth of a small zero.Init step's own work).
    if synchronize:
        torch.cuda.synchronize()
    base = _stat(torch.cuda.memory_stats_as_nested_dict(), "allocated_bytes")
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if synchronize:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return out, seconds, _stat(torch.cuda.memory_stats_as_nested_dict(), "allocated_bytes", "peak") - base


# --------------------------------------------------------------------------------------------
# Allocations: every failure to allocate is a torch.OutOfMemoryError, on the device and on the host.


class OutOfMemory(torch.OutOfMemoryError):
    """An allocation that failed. Carries only a message, so that no traceback keeps the caller's
    buffers alive while it recovers (a flatten tier falls through to the next one)."""


# Fault injection for the tests (``tests/test_faults.py``): when set, called with the buffer's name
# before every allocation made through this module (and the staging ring); raising fails it.
fault_hook: Callable[[str], None] | None = None


def _before_allocation(what: str) -> None:
    if fault_hook is not None:
        fault_hook(what)


def empty(numel: int, dtype: torch.dtype, device: torch.device | str, what: str) -> torch.Tensor:
    """``torch.empty``, with the CPU allocator's failure (a plain RuntimeError) raised as an OOM too.

    ``what`` names the buffer in the error (and lets tests fail one kind of allocation).
    """
    _before_allocation(what)
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except RuntimeError as exc:
        if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc):
            raise OutOfMemory(f"could not allocate the {what} ({format_bytes(numel * dtype.itemsize)}) "
                              f"on {device}") from None
        raise


def empty_first_fitting(numels, dtype: torch.dtype, device: torch.device | str, what: str) -> torch.Tensor:
    """A staging chunk: the first of ``numels`` (largest first) elements that can be allocated. A smaller chunk
    only costs more copies, so running out of memory at one size tries the next; the last failure is raised."""
    for k, numel in enumerate(numels):
        try:
            return empty(numel, dtype, device, what)
        except torch.OutOfMemoryError:
            if k == len(numels) - 1:
                raise
            logger.warning("ztriton: the %s of %s did not fit on %s; trying %s", what,
                           format_bytes(numel * dtype.itemsize), device, format_bytes(numels[k + 1] * dtype.itemsize))
    raise ValueError(f"no size to try for the {what}")


def try_empty(numel: int, dtype: torch.dtype, device: torch.device | str, what: str) -> torch.Tensor | None:
    """:func:`empty`, or None where it runs out of memory."""
    try:
        return empty(numel, dtype, device, what)
    except torch.OutOfMemoryError:
        return None


def host_empty(numel: int, dtype: torch.dtype, what: str, *, pin: bool | None = None) -> torch.Tensor:
    """A host buffer: pinned if ``pin`` (default: when there is a GPU), pageable if pinning fails.

    Large buffers that outlive one copy should not come from here pinned: pinning costs seconds per GiB
    and torch rounds pinned blocks up to a power of two. Params moved out of the device go to the
    staging spill (:func:`ztriton.staging.spill`: pinned once, exactly sized, reused); other large host
    buffers are pageable (``pin=False``), copied through the staging ring (:func:`ztriton.staging.copy_staged`).
    """
    if torch.cuda.is_available() if pin is None else pin:
        _before_allocation(what)
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            logger.warning("ztriton: could not pin %s of host memory for the %s (%s); using pageable memory",
                           format_bytes(numel * dtype.itemsize), what, exc)
    return empty(numel, dtype, "cpu", what)


def try_host_empty(numel: int, dtype: torch.dtype, what: str, *, pin: bool | None = None) -> torch.Tensor | None:
    """:func:`host_empty`, or None where it runs out of memory."""
    try:
        return host_empty(numel, dtype, what, pin=pin)
    except torch.OutOfMemoryError:
        return None


def check_kernels_take(tensor: torch.Tensor, name: str) -> None:
    """Raise now, naming ``name``, if the copy kernels would refuse ``tensor`` as a source.

    An entry point calls this for every source before anything moves, so that a refusal cannot come
    after some params were already re-pointed or moved to host memory. Only strided sources can be
    refused (dense ones are copied as bytes); the kernels' own planning decides, on a one-element
    copy into a scratch buffer, so that their rules stay in one place.
    """
    if tensor.is_contiguous() or tensor.numel() == 0 or not kernels_run_on(tensor.device):
        return
    from ztriton.kernels import Piece, make_plan  # on first use (triton only for a launch)

    scratch = empty(1, tensor.dtype, tensor.device, "kernel check scratch")
    try:
        make_plan(scratch, [Piece(tensor, 0, 1, 0)])
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} cannot be copied by the kernels: {exc}; make it contiguous first "
                        "(p.data = p.data.contiguous())") from None
    except Exception as exc:  # noqa: BLE001 -- any refusal of the planner, named, before anything moves
        raise TypeError(f"{name} (dtype {tensor.dtype}, shape {tuple(tensor.shape)}, strides {tensor.stride()}) "
                        f"cannot be copied by the kernels ({type(exc).__name__}: {exc}); make it contiguous "
                        "(p.data = p.data.contiguous()) before calling") from None
