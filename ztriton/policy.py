"""The tiered memory policy: how much memory is free, which path a copy takes, in what chunk sizes.

Decisions are pure functions of numbers (:func:`choose_flatten_tier`, :func:`choose_chunk_bytes`),
so they are tested without a GPU; :func:`probe_memory` reads the numbers. Every decision carries the
figures it was made from and is logged with them, so a user can see which tier ran and why.
"""
from __future__ import annotations

import bisect
import enum
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import torch

logger = logging.getLogger("ztriton")

MiB = 1 << 20
GiB = 1 << 30
# Memory kept free on the device for everything else (the caching allocator's fragmentation,
# NCCL buffers, kernels' workspaces), unless the caller says otherwise.
DEFAULT_HEADROOM_BYTES = 1 * GiB
MIN_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 256 * MiB


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


def _nvml_free(index: int) -> tuple[int, int] | None:
    """(free, total) of a CUDA device as the driver sees it, other processes included; None if NVML fails
    (not installed, or a device such as GB10 that refuses ``nvmlDeviceGetMemoryInfo``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            physical = int(visible.split(",")[index]) if visible else index
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(physical))
            return int(info.free), int(info.total)
        finally:
            pynvml.nvmlShutdown()
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
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    nvml = _nvml_free(index)
    if nvml is not None:
        free, total = nvml
        source = "nvml"
    else:
        free, total = torch.cuda.mem_get_info(index)
        source = "torch"
    return MemoryInfo(str(device), free + cached, total, host, source)


class Tier(str, enum.Enum):
    """How a ZeRO-1/2 group is flattened (DESIGN.md, "The tiered memory policy")."""

    DEVICE = "device"
    DISTRIBUTED = "distributed"
    EVICT = "evict"
    HOST = "host"


@dataclass(frozen=True)
class FlattenDecision:
    tier: Tier
    reason: str
    group_bytes: int
    world_size: int
    free_bytes: int
    headroom_bytes: int
    evict_bytes: int = 0  # bytes of params the evict tier moves to pinned host memory


def choose_flatten_tier(group_bytes: int, world_size: int, free_bytes: int, host_bytes: int,
                        headroom_bytes: int = DEFAULT_HEADROOM_BYTES, forced: Tier | str | None = None) -> FlattenDecision:
    """The cheapest tier whose extra device memory fits in ``free_bytes - headroom_bytes``.

    The group's params (``group_bytes``, replicated on every rank) are already resident. Extra
    device memory each tier needs: device M (the flat buffer beside the params); distributed M/W
    (this rank's window, then the flat buffer once the params are freed); evict: none beyond what
    it frees by moving ``evict_bytes`` of params to pinned host memory; host: none on the device.
    """
    for name, value in (("group_bytes", group_bytes), ("free_bytes", free_bytes), ("host_bytes", host_bytes),
                        ("headroom_bytes", headroom_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    budget = free_bytes - headroom_bytes
    window = -(-group_bytes // world_size)
    facts = dict(group_bytes=group_bytes, world_size=world_size, free_bytes=free_bytes, headroom_bytes=headroom_bytes)
    evict = max(0, group_bytes - max(budget, 0))

    if forced is not None:
        tier = Tier(forced)
        if tier is Tier.DISTRIBUTED and world_size == 1:
            raise ValueError("tier 'distributed' needs a world of more than one rank (world_size=1)")
        return FlattenDecision(tier, f"forced by the caller (tier={tier.value!r})", **facts,
                               evict_bytes=evict if tier is Tier.EVICT else 0)
    if budget >= group_bytes:
        return FlattenDecision(Tier.DEVICE, f"free {_gib(budget)} after headroom holds the flat buffer "
                               f"({_gib(group_bytes)})", **facts)
    if world_size > 1 and budget >= window:
        return FlattenDecision(Tier.DISTRIBUTED, f"free {_gib(budget)} after headroom is below the flat buffer "
                               f"({_gib(group_bytes)}) but holds this rank's 1/{world_size} window ({_gib(window)})",
                               **facts)
    if host_bytes >= evict:
        return FlattenDecision(Tier.EVICT, f"free {_gib(budget)} after headroom: moving {_gib(evict)} of params "
                               f"to pinned host memory makes room for the flat buffer ({_gib(group_bytes)})",
                               **facts, evict_bytes=evict)
    return FlattenDecision(Tier.HOST, f"neither the device ({_gib(budget)} free after headroom) nor pinned host "
                           f"memory ({_gib(host_bytes)}) holds what the other tiers need", **facts)


def choose_chunk_bytes(free_bytes: int, headroom_bytes: int = DEFAULT_HEADROOM_BYTES, requested: int | None = None,
                       buffers: int = 2) -> int:
    """Bytes of one staging chunk when ``buffers`` chunks are in flight at once.

    A requested size wins (it must be >= 1 MiB); otherwise a quarter of what is free after the
    headroom, shared between the buffers, rounded down to whole MiB and kept in [1 MiB, 256 MiB]:
    big enough to run at copy bandwidth, small enough to leave the device usable.
    """
    if requested is not None:
        if requested < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={requested} is below the minimum of {MIN_CHUNK_BYTES} (1 MiB)")
        return int(requested)
    share = max(0, free_bytes - headroom_bytes) // (4 * buffers)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, share // MiB * MiB))


def log_decision(what: str, decision, memory: MemoryInfo | None = None) -> None:
    """One INFO line: what was decided, why, and the figures it came from."""
    figures = f" [free {_gib(memory.device_free)} of {_gib(memory.device_total)} on {memory.device} " \
              f"({memory.source}), host {_gib(memory.host_available)}]" if memory else ""
    tier = getattr(decision, "tier", None)
    label = tier.value if isinstance(tier, Tier) else str(decision)
    logger.info("ztriton %s: %s -- %s%s", what, label, getattr(decision, "reason", ""), figures)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def flatten_fallbacks(tier: Tier | str) -> tuple[Tier, ...]:
    """The tiers a ZeRO-1/2 flatten tries, in order, starting from ``tier``: each next one after an
    allocation failure in the one before.

    ``distributed`` is never a fallback: it is collective, so every rank must enter it together, and
    only the choice made up front (from memory figures all ranks agreed on) is the same everywhere; a
    fallback follows one rank's own allocation failure.
    """
    chain = {Tier.DEVICE: (Tier.DEVICE, Tier.EVICT, Tier.HOST),
             Tier.DISTRIBUTED: (Tier.DISTRIBUTED, Tier.EVICT, Tier.HOST),
             Tier.EVICT: (Tier.EVICT, Tier.HOST),
             Tier.HOST: (Tier.HOST,)}
    return chain[Tier(tier)]


def choose_evictions(sizes: Sequence[int], evict_bytes: int) -> list[int]:
    """Indices (ascending) of the tensors of ``sizes`` bytes to move to host memory to free ``evict_bytes``.

    Few tensors and little overshoot: while bytes are still needed, take the smallest tensor that
    covers the rest if there is one, else the largest and go on. The result covers ``evict_bytes``
    (all tensors if together they are smaller), and leaving out its smallest tensor would not.
    """
    if evict_bytes < 0:
        raise ValueError(f"evict_bytes must be >= 0, got {evict_bytes}")
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sizes[{i}] must be >= 0, got {size}")
    remaining = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))  # ascending by size
    chosen, need = [], evict_bytes
    while need > 0 and remaining:
        k = bisect.bisect_left(remaining, need, key=lambda i: sizes[i])
        if k < len(remaining):  # one tensor covers the rest: the smallest such
            chosen.append(remaining.pop(k))
            break
        largest = remaining.pop()
        chosen.append(largest)
        need -= sizes[largest]
    return sorted(chosen)


# A parameter created inside ``zero.Init`` at least this large starts in host memory (under
# ``"partition_backend": "triton"``): the whole tensor never lands on the device, only its slices.
MAX_HOST_INIT_BYTES = 1 * GiB


def choose_host_init_bytes(device_free: int, configured: int | None = None) -> int:
    """Size from which a parameter created inside ``zero.Init`` is allocated in host memory.

    A configured size wins (``"ztriton": {"host_init_bytes": N}``; 0 sends every parameter to the
    host). Otherwise 1 GiB, or an eighth of the free device memory when that is smaller: creating a
    tensor on the device is fast (device RNG), but its full size is a transient the partition does
    not need, and on a tight device even a few of those fail.
    """
    if configured is not None:
        if not isinstance(configured, int) or configured < 0:
            raise ValueError(f"host_init_bytes must be an int >= 0, got {configured!r}")
        return configured
    if device_free < 0:
        raise ValueError(f"device_free must be >= 0, got {device_free}")
    return max(MIN_CHUNK_BYTES, min(MAX_HOST_INIT_BYTES, device_free // 8))


@dataclass(frozen=True)
class DefragmentDecision:
    """How the ZeRO-3 optimizer's flat partition buffer (``lp_param_buffer``) is built."""

    tier: Tier  # DEVICE (pack beside the partitions) or EVICT (move some partitions to pinned host first)
    reason: str
    buffer_bytes: int
    free_bytes: int
    headroom_bytes: int
    evict: tuple[int, ...] = ()  # indices of the storages to move to pinned host memory


def choose_defragment(storage_bytes: Sequence[int], buffer_bytes: int, free_bytes: int,
                      headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> DefragmentDecision:
    """Pack on the device if the new buffer fits beside the partitions; else evict whole storages.

    ``storage_bytes``: the device allocations the partitions now live in (a storage is freed only when
    every partition in it has moved, so eviction counts whole storages). The evicted ones travel
    device -> pinned host -> device once; the rest are packed device to device.
    """
    if buffer_bytes < 0 or free_bytes < 0 or headroom_bytes < 0:
        raise ValueError(f"sizes must be >= 0, got buffer_bytes={buffer_bytes}, free_bytes={free_bytes}, "
                         f"headroom_bytes={headroom_bytes}")
    budget = free_bytes - headroom_bytes
    facts = dict(buffer_bytes=buffer_bytes, free_bytes=free_bytes, headroom_bytes=headroom_bytes)
    if budget >= buffer_bytes:
        return DefragmentDecision(Tier.DEVICE, f"free {_gib(budget)} after headroom holds the flat buffer "
                                  f"({_gib(buffer_bytes)}) beside the partitions", **facts)
    evict = choose_evictions(storage_bytes, buffer_bytes - max(budget, 0))
    moved = sum(storage_bytes[i] for i in evict)
    return DefragmentDecision(Tier.EVICT, f"free {_gib(budget)} after headroom is below the flat buffer "
                              f"({_gib(buffer_bytes)}): {len(evict)} partition storage(s), {_gib(moved)}, go through "
                              "pinned host memory", **facts, evict=tuple(evict))
