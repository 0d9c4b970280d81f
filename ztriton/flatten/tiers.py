"""The four ways to build one group's flat buffer (``docs/architecture.md``, "Vocabulary": tier).

Each tier returns a filled flat buffer on ``g.device``, or raises ``torch.OutOfMemoryError`` with
every param still holding its values (on ``g.device``, or in host memory and listed in ``g.evicted``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ztriton import memory, policy
from ztriton.comm import World, all_gather_bytes, all_ranks
from ztriton.kernels import copy_chunk, pack, torch_pack
from ztriton.layout import FlatGroupLayout
from ztriton.memory import OutOfMemory, empty, format_bytes, host_empty, kernels_run_on, synchronize, try_empty, try_host_empty
from ztriton.policy import FlattenDecision, Options, Tier

logger = logging.getLogger("ztriton")

__all__ = ["Group", "Run", "TIERS"]


@dataclass
class Group:
    """One group's work, validated before anything moves.

    ``params``/``shapes``/``offsets`` are in flat order; shapes are kept apart from the params because
    a tier may replace a param's ``.data`` with a placeholder. ``evicted`` holds the flat positions of
    params whose ``.data`` currently lives in host memory instead of on ``device``.
    """

    index: int
    params: list[torch.Tensor]
    shapes: list[torch.Size]
    layout: FlatGroupLayout
    dtype: torch.dtype
    device: torch.device
    evicted: set[int] = field(default_factory=set)

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


@dataclass(frozen=True)
class Run:
    """What a tier needs besides the group: the decision, the world, the options and the (rank-agreed)
    free host memory, which the decision does not carry."""

    decision: FlattenDecision
    world: World
    options: Options
    host_bytes: int


def _device_tier(g: Group, run: Run) -> torch.Tensor:
    flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    _pack(flat, _sources(g), g.offsets)
    return flat


def _distributed_tier(g: Group, run: Run) -> torch.Tensor:
    """Pack this rank's window, free the params, gather every rank's window into the flat buffer.

    Every allocation's outcome is agreed across ranks before the next collective step, so all ranks
    take the same path and fall through together. When the measured budget holds the flat buffer
    beside the params, it is allocated before the params are freed (nothing then ever lives only in
    the partitions). Otherwise the params are freed first, and only if host memory could hold the
    group: should the flat buffer still not fit, the partitions are gathered in small chunks into
    host memory and the params point there (nothing is lost; the next tier copies them back).
    """
    world, decision = run.world, run.decision
    w0, w1 = g.layout.rank_window(world.rank)
    try:
        part = empty(w1 - w0, g.dtype, g.device, "partition buffer")
        _pack(part, _sources(g), g.offsets, window=(w0, w1))
    except torch.OutOfMemoryError:
        part = None
    if not all_ranks(part is not None, world):
        raise OutOfMemory("a rank could not allocate its partition buffer")

    flat = None
    if decision.free_bytes - decision.headroom_bytes >= g.nbytes + part.numel() * g.element_size:
        flat = try_empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
        if not all_ranks(flat is not None, world):
            flat = None
    if flat is None:
        if run.host_bytes < g.nbytes:
            raise OutOfMemory(f"the flat buffer does not fit beside the params and host memory "
                              f"({format_bytes(run.host_bytes)}) could not hold a recovery copy, so the params were kept")
        _free_params(g)
        flat = try_empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
        if not all_ranks(flat is not None, world):
            flat = None  # the recovery below needs the memory back
            _recover_from_partitions(g, part, run)
            raise OutOfMemory("the flat buffer did not fit on every rank even with the params freed; the params "
                              "were rebuilt from the ranks' partitions in host memory")
    all_gather_bytes(flat, part, world)
    return flat


def _evict_tier(g: Group, run: Run) -> torch.Tensor:
    """Move the fewest params that free enough device memory to host memory, then fill the flat buffer
    from the rest (one pack launch) and from host memory (copies in chunks)."""
    chunk = _chunk_numel(g, run.decision.free_bytes, run.options)
    resident = [k for k in range(len(g.params)) if k not in g.evicted]
    need = run.decision.evict_bytes if run.decision.tier is Tier.EVICT else _evict_estimate(g, run.options)
    picked = policy.choose_evictions([g.numel(k) * g.element_size for k in resident], need)
    _evict(g, [resident[i] for i in picked], chunk)
    try:
        flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    except torch.OutOfMemoryError:  # the estimate was short (fragmentation, other processes): evict all
        logger.info("ztriton flatten group %d: flat buffer still does not fit, evicting every param", g.index)
        _evict(g, [k for k in range(len(g.params)) if k not in g.evicted], chunk)
        flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    on_device = [k for k in range(len(g.params)) if k not in g.evicted]
    # The pack zeroes every gap, the evicted params' slots too; the copies below overwrite those.
    _pack(flat, [g.params[k].detach() for k in on_device], [g.offsets[k] for k in on_device])
    for k in sorted(g.evicted):
        _copy_in_chunks(flat, g.offsets[k], g.params[k].detach(), chunk)
    synchronize(g.device)
    return flat


def _host_tier(g: Group, run: Run) -> torch.Tensor:
    """Pack into one host buffer, free the params (they point into it meanwhile), copy it to the device once."""
    staging = host_empty(g.layout.total_numel, g.dtype, "host flat buffer")
    chunk = _chunk_numel(g, run.decision.free_bytes, run.options)
    for k, (p, offset, pad) in enumerate(zip(g.params, g.offsets, g.layout.paddings)):
        _copy_to_host(staging.narrow(0, offset, g.numel(k)), p.detach(), chunk)
        staging.narrow(0, offset + g.numel(k), pad).zero_()
    staging.narrow(0, g.layout.packed_numel, g.layout.tail_padding).zero_()
    for k, (p, shape, offset) in enumerate(zip(g.params, g.shapes, g.offsets)):
        p.data = staging.narrow(0, offset, g.numel(k)).view(shape)
        g.evicted.add(k)
    flat = empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    flat.copy_(staging, non_blocking=staging.is_pinned())
    synchronize(g.device)
    return flat


TIERS = {Tier.DEVICE: _device_tier, Tier.DISTRIBUTED: _distributed_tier, Tier.EVICT: _evict_tier,
          Tier.HOST: _host_tier}


# --------------------------------------------------------------------------------------------
# Helpers of the tiers.


def _sources(g: Group) -> list[torch.Tensor]:
    return [p.detach() for p in g.params]


def _evict_estimate(g: Group, options: Options) -> int:
    """Bytes to evict when the evict tier is a fallback: what a fresh probe says is missing."""
    free = memory.probe_memory(g.device).device_free
    return max(0, g.nbytes - max(0, free - options.headroom_bytes))


def _evict(g: Group, positions: Sequence[int], chunk_numel: int) -> None:
    """Copy these params into one (pinned) host buffer and point them there; their device memory is freed.

    One buffer rather than one per param: pinned allocations are slow, and rounded up in size.
    """
    if not positions:
        return
    host = host_empty(sum(g.numel(k) for k in positions), g.dtype, "evicted params")
    offset = 0
    for k in positions:
        p, numel = g.params[k], g.numel(k)
        view = host.narrow(0, offset, numel)
        _copy_to_host(view, p.detach(), chunk_numel)
        p.data = view.view(g.shapes[k])
        g.evicted.add(k)
        offset += numel
    logger.info("ztriton flatten group %d: evicted %d params (%s) to host memory", g.index, len(positions),
                format_bytes(host.numel() * g.element_size))


def _copy_to_host(dst: torch.Tensor, src: torch.Tensor, chunk_numel: int) -> None:
    """``src`` flattened row-major into the contiguous host view ``dst``, without a full-size device copy.

    torch would make a strided device source contiguous on the device first (as large as the
    param, when memory is short): such sources go through a device chunk with ``copy_chunk``.
    """
    if src.is_contiguous() or src.device.type != "cuda":
        dst.view(src.shape).copy_(src)
        return
    stage = empty(min(chunk_numel, src.numel()), src.dtype, src.device, "staging chunk")
    for start in range(0, src.numel(), stage.numel()):
        n = min(stage.numel(), src.numel() - start)
        copy_chunk(src, stage[:n], start, n)
        dst[start:start + n].copy_(stage[:n])


def _free_params(g: Group) -> None:
    """Point every param at an empty placeholder, releasing its device memory (shapes are kept in g)."""
    for p in g.params:
        p.data = torch.empty(0, dtype=g.dtype, device=g.device)


def _recover_from_partitions(g: Group, part: torch.Tensor, run: Run) -> None:
    """Rebuild the whole flat buffer in host memory from every rank's partition and point the params into it.

    All ranks take part. The gather goes through a small device buffer, W chunks at a time, so it
    needs next to no device memory (and works with backends that cannot gather host tensors). If even
    that cannot be allocated on every rank, the values live only in the ranks' partitions: that is
    raised as a RuntimeError (not an out-of-memory error, which would fall through to the next tier).
    """
    world = run.world
    size = part.numel()
    chunk = max(1, _chunk_numel(g, run.decision.free_bytes, run.options) // world.size)
    host = try_host_empty(g.layout.total_numel, g.dtype, "host flat buffer")
    staging = try_empty(world.size * min(chunk, size), g.dtype, g.device, "gather staging buffer")
    if not all_ranks(host is not None and staging is not None, world):
        raise RuntimeError(f"flatten group {g.index}: the params were freed and neither the flat buffer nor a host "
                           f"copy ({format_bytes(g.nbytes)}) could be allocated on every rank; their values now exist only in "
                           "the ranks' partitions and are lost. Free memory, rebuild the model and call again "
                           "(with tier='evict' or 'host' to keep the params until the buffer exists)")
    for start in range(0, size, chunk):
        n = min(chunk, size - start)
        out = staging[:world.size * n]
        all_gather_bytes(out, part[start:start + n], world)
        for r in range(world.size):
            host[r * size + start:r * size + start + n].copy_(out[r * n:(r + 1) * n])
    for k, (p, shape, offset) in enumerate(zip(g.params, g.shapes, g.offsets)):
        p.data = host.narrow(0, offset, g.numel(k)).view(shape)
        g.evicted.add(k)
    logger.warning("ztriton flatten group %d: recovered the params from the ranks' partitions into host memory",
                   g.index)


def _chunk_numel(g: Group, free_bytes: int, options: Options) -> int:
    """Elements per host-to-device copy (or per rank in one recovery gather)."""
    nbytes = policy.choose_chunk_bytes(free_bytes, options.headroom_bytes, options.chunk_bytes)
    return max(1, nbytes // g.element_size)


def _copy_in_chunks(flat: torch.Tensor, offset: int, src: torch.Tensor, chunk_numel: int) -> None:
    """``src`` (host memory, contiguous) into ``flat[offset:]``, ``chunk_numel`` elements per copy.

    Pinned sources copy asynchronously; the caller synchronises before the sources may go.
    """
    src = src.reshape(-1)
    pinned = src.is_pinned()
    for start in range(0, src.numel(), chunk_numel):
        n = min(chunk_numel, src.numel() - start)
        flat.narrow(0, offset + start, n).copy_(src.narrow(0, start, n), non_blocking=pinned)


def _pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
          window: tuple[int, int] | None = None) -> None:
    """``ztriton.kernels.pack``, or its torch reference where the kernels cannot run on dst's device."""
    if kernels_run_on(dst.device):
        pack(dst, sources, offsets, window)
        return
    logger.info("ztriton: CPU tensors without TRITON_INTERPRET=1, packing with torch instead of the kernels")
    torch_pack(dst, sources, offsets, window)
