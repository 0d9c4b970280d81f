"""The four ways to build one group's flat buffer (``docs/architecture.md``, "Vocabulary": tier).

Each tier returns a filled flat buffer on ``g.device``, or raises with every param still holding its
values: on ``g.device`` as before, or in host memory and listed in ``g.evicted`` (a later tier, or
``groups._restore``, copies them back). No param's values are ever only in a buffer that a failure
could free: a param's ``.data`` is replaced only once a complete copy of it exists elsewhere.

``torch.OutOfMemoryError`` from a tier means "try the next tier"; any other exception is raised to
the caller after the params are restored. The distributed tier takes every step on all ranks
together and agrees on each step's outcome (``comm.agree``) before the next collective, so that its
failures, whatever their class, fall through to the next tier on every rank at once.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from ztriton import memory, policy, staging
from ztriton.comm import World, agree, all_gather_bytes, same_on_all_ranks
from ztriton.kernels import copy_chunk, integer_view, pack, torch_pack
from ztriton.layout import FlatGroupLayout
from ztriton.memory import OutOfMemory, empty, format_bytes, kernels_run_on
from ztriton.policy import FlattenDecision, Options, Tier

logger = logging.getLogger("ztriton")

__all__ = ["Group", "TierInputs", "TIERS"]

# Bound of the per-group checksum (below 2**62, so that it and its negation fit an int64 all-reduce).
_CHECKSUM_MOD = (1 << 61) - 1


class Group:
    """One group's work, validated before anything moves.

    ``params``/``shapes``/``offsets`` are in flat order; shapes are kept apart from the params because
    a tier may point a param's ``.data`` at host memory. ``evicted`` holds the flat positions of
    params whose ``.data`` currently lives in host memory instead of on ``device``.

    A plain class, as :class:`TierInputs`: the key imports this module in a fresh process's config parse, where a
    dataclass's creation would be a large part of the import (``bench/NOTES.md``).
    """

    __slots__ = ("index", "params", "shapes", "layout", "dtype", "device", "evicted")

    def __init__(self, index: int, params: list[torch.Tensor], shapes: list[torch.Size], layout: FlatGroupLayout,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.index, self.params, self.shapes, self.layout = index, params, shapes, layout
        self.dtype, self.device = dtype, device
        self.evicted: set[int] = set()

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.layout.offsets

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.layout.total_numel * self.element_size

    def numel(self, k: int) -> int:
        return self.layout.numels[k]


class TierInputs:
    """What a tier needs besides the group: the decision, the world, the options, the (rank-agreed)
    free host memory, which the decision does not carry, and ``check_params``: the checks of the params
    themselves, which the device tier runs while its pack's first copies run (the caller runs them before any
    other tier)."""

    __slots__ = ("decision", "world", "options", "host_bytes", "check_params")

    def __init__(self, decision: FlattenDecision, world: World, options: Options, host_bytes: int,
                 check_params: Callable[[], None]) -> None:
        self.decision, self.world, self.options, self.host_bytes = decision, world, options, host_bytes
        self.check_params = check_params


def _device_tier(g: Group, inputs: TierInputs) -> torch.Tensor:
    flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    _pack(flat, g.params, g.offsets, meanwhile=inputs.check_params)
    return flat


def _distributed_tier(g: Group, inputs: TierInputs) -> torch.Tensor:
    """Pack this rank's window, gather every rank's window into the flat buffer (collective).

    Taken only if every rank holds the same values (a checksum, agreed): the gather gives each rank
    the other ranks' windows, which must equal its own for the result to be the device tier's (and
    DeepSpeed's, which flattens each rank's own params). Otherwise this tier steps aside and the
    next one keeps each rank's values.

    When the measured budget holds the flat buffer beside the params it is allocated before anything
    else changes. Otherwise the params must make room: first every param is copied to host memory
    (pageable, a backup: :func:`_host_copy`), then pointed there, which frees its device memory; only
    then is the flat buffer allocated. Every step's outcome is agreed across ranks; any failure
    leaves the params on the device or in that host copy, and falls through on every rank together.
    """
    world = inputs.world
    step = agree(world, lambda: _checksum(g))
    if not step.ok:
        raise OutOfMemory(f"distributed tier: the values' checksum failed ({step.describe()})")
    if not same_on_all_ranks([step.value], world):
        logger.warning("ztriton flatten group %d: the ranks hold different values; gathering windows would mix "
                       "them, so the group is built locally (each rank keeps its own values, as DeepSpeed does)",
                       g.index)
        raise OutOfMemory("distributed tier: the ranks hold different values (each rank builds its own buffer)")
    w0, w1 = g.layout.rank_window(world.rank)

    def pack_window() -> torch.Tensor:
        part = empty(w1 - w0, g.dtype, g.device, "partition buffer")
        _pack(part, g.params, g.offsets, window=(w0, w1))
        return part

    step = agree(world, pack_window)
    if not step.ok:
        raise OutOfMemory(f"distributed tier: the partition buffer ({step.describe()})")
    part = step.value

    def allocate_flat() -> torch.Tensor:
        return empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")

    flat = None
    decision = inputs.decision
    if decision.free_bytes - decision.headroom_bytes >= g.nbytes + part.numel() * g.element_size:
        flat = agree(world, allocate_flat).value
    if flat is None:
        if inputs.host_bytes < g.nbytes:
            raise OutOfMemory(f"the flat buffer does not fit beside the params and host memory "
                              f"({format_bytes(inputs.host_bytes)}) cannot hold a copy of them, so the params were kept")
        step = agree(world, lambda: _host_copy(g, inputs, pinned=False))
        if not step.ok:
            raise OutOfMemory(f"distributed tier: no host copy of the params ({step.describe()}); the params were kept")
        _point_at(g, step.value, range(len(g.params)))  # their device memory goes; the host copy holds the values
        step = agree(world, allocate_flat)
        if not step.ok:
            raise OutOfMemory(f"distributed tier: the flat buffer did not fit even with the params in host memory "
                              f"({step.describe()})")
        flat = step.value
    step = agree(world, lambda: all_gather_bytes(flat, part, world))
    if not step.ok:
        raise OutOfMemory(f"distributed tier: the all-gather failed ({step.describe()})")
    return flat


def _evict_tier(g: Group, inputs: TierInputs) -> torch.Tensor:
    """Move the fewest params that free enough device memory to host memory, then fill the flat buffer
    from the rest (one pack launch) and from host memory (one copy per evicted param)."""
    resident = [k for k in range(len(g.params)) if k not in g.evicted]
    need = inputs.decision.evict_bytes if inputs.decision.tier is Tier.EVICT else _evict_estimate(g, inputs.options)
    picked = policy.choose_evictions([g.numel(k) * g.element_size for k in resident], need)
    _evict(g, [resident[i] for i in picked], inputs)
    try:
        flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    except torch.OutOfMemoryError:  # the estimate was short (fragmentation, other processes): evict all
        logger.info("ztriton flatten group %d: flat buffer still does not fit, evicting every param", g.index)
        _evict(g, [k for k in range(len(g.params)) if k not in g.evicted], inputs)
        flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    on_device = [k for k in range(len(g.params)) if k not in g.evicted]
    # The pack zeroes every gap, the evicted params' slots too; the copies below overwrite those (queued
    # after the pack on the same stream).
    _pack(flat, [g.params[k].detach() for k in on_device], [g.offsets[k] for k in on_device])
    with staging.synchronized(g.device):
        for k in sorted(g.evicted):  # from the pinned spill: one asynchronous DMA each, no host copy
            flat.narrow(0, g.offsets[k], g.numel(k)).copy_(g.params[k].detach().reshape(-1), non_blocking=True)
    return flat


def _host_tier(g: Group, inputs: TierInputs) -> torch.Tensor:
    """Copy every param into one host buffer laid out as the flat buffer, point the params there
    (freeing their device memory), allocate the flat buffer and copy the host buffer into it at once."""
    host = _host_copy(g, inputs, layout=True)
    _point_at(g, host, range(len(g.params)), layout=True)
    flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    with staging.synchronized(g.device):
        flat.copy_(host, non_blocking=True)  # pinned: one DMA of the whole buffer
    return flat


TIERS = {Tier.DEVICE: _device_tier, Tier.DISTRIBUTED: _distributed_tier, Tier.EVICT: _evict_tier,
         Tier.HOST: _host_tier}


# --------------------------------------------------------------------------------------------
# Helpers of the tiers.


def _checksum(g: Group) -> int:
    """A checksum of the group's values, position-weighted per param (the same values on every rank
    give the same number; different random initialisations almost surely do not). Reads the params
    once, in place; one device synchronisation."""
    # Summed in the elements' own integer width (wrapping): asking for an int64 sum makes torch cast the whole
    # param to int64 first, a 4x temporary exactly when device memory is short.
    views = [integer_view(p.detach()) for p in g.params]
    sums = [view.sum(dtype=view.dtype).to(torch.int64) for view in views]
    total = 0
    for k, value in enumerate(torch.stack(sums).tolist() if sums else []):
        total = (total + (k + 1) * (value % _CHECKSUM_MOD)) % _CHECKSUM_MOD
    return total


def _evict_estimate(g: Group, options: Options) -> int:
    """Bytes to evict when the evict tier is a fallback: what a fresh probe says is missing."""
    free = memory.probe_memory(g.device).device_free
    return max(0, g.nbytes - max(0, free - options.headroom_bytes))


def _chunk_bytes(inputs: TierInputs) -> int:
    return policy.choose_chunk_bytes(inputs.decision.free_bytes, inputs.options.headroom_bytes, inputs.options.chunk_bytes)


def _evict(g: Group, positions: Sequence[int], inputs: TierInputs) -> None:
    """Copy these params into spill memory (:func:`_spill`) and point them there; their device memory is freed.

    The params are re-pointed only once every copy is complete: a failure on the way leaves them as
    they were (and the copies finished, so the spill can be lent again). One buffer for them all.
    """
    if not positions:
        return
    copies = staging.spill_copies([g.params[k].detach() for k in positions], g.device, "evicted params",
                                  copy=lambda out, src: _copy_to_host(out, src, inputs))
    for k, copy in zip(positions, copies):
        g.params[k].data = copy.view(g.shapes[k])
        g.evicted.add(k)
    logger.info("ztriton flatten group %d: evicted %d params (%s) to host memory", g.index, len(positions),
                format_bytes(sum(c.numel() for c in copies) * g.element_size))


def _host_copy(g: Group, inputs: TierInputs, layout: bool = False, pinned: bool = True) -> torch.Tensor:
    """Host memory holding every param's values: end to end, or (``layout``) at their offsets of the flat
    layout with its pads zeroed, so that it can be copied to the flat buffer as is. Returns once every copy
    has landed.

    ``pinned``: spill memory (:func:`_spill`), for a copy that goes back to the device. Otherwise pageable
    memory filled through the staging ring: a backup that goes back only on failure (the distributed
    tier's) is not worth pinning, which costs ~0.45 s per GiB on a process's first call (H200 host).
    """
    numel = g.layout.total_numel if layout else sum(g.layout.numels)
    if pinned:
        host = _spill(g, numel, "host copy of the params")
    else:
        host = memory.host_empty(numel, g.dtype, "host copy of the params", pin=False)
    at = 0
    with staging.synchronized(g.device):
        for k, p in enumerate(g.params):
            start = g.offsets[k] if layout else at
            _copy_to_host(host.narrow(0, start, g.numel(k)), p.detach(), inputs, pinned)
            if layout:  # host memory outside every copy's destination: zeroed while the copies run
                host.narrow(0, start + g.numel(k), g.layout.paddings[k]).zero_()
            at += g.numel(k)
        if layout:
            host.narrow(0, g.layout.packed_numel, g.layout.tail_padding).zero_()
    return host


def _spill(g: Group, numel: int, what: str) -> torch.Tensor:
    """``numel`` elements of host memory for this group's params, from the process's spill pool.

    Pinned (for a CUDA group), so that each param goes out and comes back with one DMA, and reused by the
    next call, so that only a process's first call pays for pinning. Params that point into it keep it
    lent (``staging.SpillPool``): after a failure, memory they still live in is never lent again; once they
    alias the flat buffer, it is free for the next borrower.
    """
    return staging.spill(numel * g.element_size, g.device, what).view(g.dtype)


def _point_at(g: Group, host: torch.Tensor, positions: Sequence[int], layout: bool = False) -> None:
    """Point the params at their copies in ``host`` (made by :func:`_host_copy`)."""
    at = 0
    for k in positions:
        start = g.offsets[k] if layout else at
        g.params[k].data = host.narrow(0, start, g.numel(k)).view(g.shapes[k])
        g.evicted.add(k)
        at += g.numel(k)


def _copy_to_host(dst: torch.Tensor, src: torch.Tensor, inputs: TierInputs, pinned: bool = True) -> None:
    """``src`` flattened row-major into the contiguous view ``dst`` of spill memory: queued, not waited for
    (the caller synchronises, ``staging.synchronized``).

    A contiguous source is one copy (from a device into pinned memory: one asynchronous DMA). torch would
    make a strided device source contiguous on the device first (as large as the param, when memory is
    short): such sources go through a device chunk with ``copy_chunk``; the chunk's kernel and its copy
    out run on one stream, so the next fill of the chunk waits for the copy that reads it.
    """
    if src.is_contiguous():
        if pinned:
            dst.copy_(src.reshape(-1), non_blocking=True)
        else:  # pageable: in chunks through the ring, the next chunk's DMA overlapping this one's host copy
            staging.copy_staged(dst, src.reshape(-1), _chunk_bytes(inputs))
        return
    if not kernels_run_on(src.device):
        dst.view(src.shape).copy_(src)
        return
    sizes = policy.staging_numels(_chunk_bytes(inputs), src.numel(), src.element_size())
    stage = memory.empty_first_fitting(sizes, src.dtype, src.device, "staging chunk")
    for start in range(0, src.numel(), stage.numel()):
        n = min(stage.numel(), src.numel() - start)
        copy_chunk(src, stage[:n], start, n)
        dst[start:start + n].copy_(stage[:n], non_blocking=True)


def _pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
          window: tuple[int, int] | None = None, meanwhile: Callable[[], None] | None = None) -> None:
    """``ztriton.kernels.pack``, or its torch reference where the kernels cannot run on dst's device. The
    sources are read in place (params as they are: neither path records autograd). ``dst`` is always a buffer
    just allocated for the result, dropped on an error: the pack checks and copies the params in turns.
    ``meanwhile``: as the pack's (before the torch reference)."""
    if kernels_run_on(dst.device):
        pack(dst, sources, offsets, window, fresh=True, meanwhile=meanwhile)
        return
    if meanwhile is not None:
        meanwhile()
    sources = [memory.unit_strided(src) for src in sources]
    logger.info("ztriton: CPU tensors without TRITON_INTERPRET=1, packing with torch instead of the kernels")
    torch_pack(dst, sources, offsets, window)
