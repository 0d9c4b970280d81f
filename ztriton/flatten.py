"""ZeRO-1/2 flatten: each optimizer group's params into one aligned flat buffer, as DeepSpeed 0.19.8 lays it out.

:func:`flatten_groups` does what ``DeepSpeedZeroOptimizer.__init__`` does to each param group (see
``DESIGN.md``, "Layouts"): the trainable, non-empty params, optionally in round-robin order, end to
end with optional 16-byte alignment pads and a zero tail up to a multiple of ``2 * W`` elements; then
every param's ``.data`` becomes its view of that buffer. The bytes equal DeepSpeed's
``bit16_groups_flat``; how they get there depends on memory (``DESIGN.md``, "The tiered memory policy"):

* ``device``: allocate the flat buffer beside the params, one pack launch (pads zeroed in the same
  pass). Device peak: params + buffer, 2M for a group of M bytes.
* ``distributed`` (W > 1): pack only this rank's 1/W window into a partition buffer, free the params,
  allocate the flat buffer and all-gather the partitions into it. Peak M + M/W. Collective: every
  rank of ``group`` takes it together.
* ``evict``: move just enough params to (pinned) host memory for the flat buffer to fit, pack the
  rest device to device and copy the evicted ones host to device in chunks. Peak at most what is free.
* ``host``: copy every param into one (pinned) host buffer, free them, allocate the flat buffer and
  copy once. Device peak M.

An allocation failure in a tier falls through to the next (``policy.flatten_fallbacks``); params keep
their values at every step (some may then live in host memory until a later tier re-points them).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ztriton import policy
from ztriton.memory import synchronize
from ztriton.layout import FlatGroupLayout, zero12_group_layout
from ztriton.policy import FlattenDecision, Tier

__all__ = ["FlatGroup", "flatten_groups"]

logger = logging.getLogger("ztriton")


@dataclass(frozen=True, eq=False)
class FlatGroup:
    """One optimizer group after :func:`flatten_groups`.

    ``flat`` is the detached 1-D flat buffer (DeepSpeed's ``bit16_groups_flat[i]``); ``params`` are
    the group's participating params (trainable, non-empty) in flat order, each now a view of
    ``flat``; ``layout.order[k]`` is the index, in the group as handed in, of ``params[k]``. ``tier``
    is the tier that built the buffer (``None`` for a group with nothing to flatten, whose ``flat``
    is empty) and ``decision`` the policy's choice with the figures it was made from.
    """

    flat: torch.Tensor
    params: tuple[torch.Tensor, ...]
    layout: FlatGroupLayout
    tier: Tier | None
    rank: int
    decision: FlattenDecision | None = None

    @property
    def order(self) -> tuple[int, ...]:
        return self.layout.order

    @property
    def offsets(self) -> tuple[int, ...]:
        """Element offset in ``flat`` of each of ``params`` (DeepSpeed's ``round_robin_bit16_offsets``)."""
        return self.layout.offsets

    @property
    def paddings(self) -> tuple[int, ...]:
        """Zeros after each of ``params`` (DeepSpeed's ``round_robin_bit16_padding``)."""
        return self.layout.paddings

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def partition(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s partition: a view of ``flat`` of ``layout.partition_numel`` elements."""
        start, end = self.layout.rank_window(rank)
        return self.flat.narrow(0, start, end - start)


@dataclass
class _Group:
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
class _World:
    rank: int
    world_size: int
    group: Any  # a ProcessGroup, or None for the default one


@dataclass(frozen=True)
class _Options:
    headroom_bytes: int
    chunk_bytes: int | None


@dataclass(frozen=True)
class _Run:
    """What a tier needs besides the group: the decision, the world, the options and the (rank-agreed)
    free host memory, which the decision does not carry."""

    decision: FlattenDecision
    world: _World
    options: _Options
    host_bytes: int


class _FlattenOOM(torch.OutOfMemoryError):
    """An allocation failure inside a tier: the next tier takes over. Carries only a message, so that
    no traceback keeps a tier's buffers alive while the next tier runs."""


# --------------------------------------------------------------------------------------------
# The entry point.


def flatten_groups(param_groups: Sequence[Any], group: Any = None, *, round_robin: bool = False,
                   parameter_alignment: bool = False, tier: Tier | str | None = None,
                   headroom_bytes: int | None = None, chunk_bytes: int | None = None) -> list[FlatGroup]:
    """Flatten every param group into one flat buffer laid out as DeepSpeed 0.19.8's ZeRO-1/2 optimizer does.

    ``param_groups``: torch-optimizer style dicts with a ``"params"`` entry (e.g. ``optimizer.param_groups``)
    or lists of tensors; one :class:`FlatGroup` comes back per group, in order. A param takes part if
    it requires grad and has elements (DeepSpeed's ``is_optimized_parameter``); the others are left
    as they are. A group with no such param gets a :class:`FlatGroup` with an empty ``flat`` and
    ``tier=None`` (DeepSpeed itself fails on such a group).

    ``group``: the data-parallel ``torch.distributed`` process group whose size is W (default: the
    default group if torch.distributed is initialised, else a world of one). With W > 1 the call is
    collective: every rank calls it with the same groups. ``round_robin`` and
    ``parameter_alignment`` are DeepSpeed's ``round_robin_gradients`` and ``parameter_alignment``.

    ``tier`` forces a tier ("device", "distributed", "evict", "host"); by default each group's tier
    is chosen from measured free memory minus ``headroom_bytes`` (default 1 GiB) and logged.
    ``chunk_bytes`` sizes host-to-device copies (default: from free memory).

    Raises ``TypeError``/``ValueError`` before anything moves on bad input: mixed dtypes or devices
    within a group's participating params, params that share memory (tied weights listed twice,
    views of one tensor), non-tensors. Raises ``torch.OutOfMemoryError`` if every tier runs out of
    memory; the params then still hold their values (moved back to their device where memory allows,
    else left in host memory, as the message says).
    """
    forced = _parse_tier(tier)
    world = _resolve_world(group)
    if forced is Tier.DISTRIBUTED and world.world_size == 1:
        raise ValueError("tier='distributed' needs a process group of more than one rank (world_size=1); "
                         "initialise torch.distributed or pass group=, or use tier='device'")
    headroom = policy.DEFAULT_HEADROOM_BYTES if headroom_bytes is None else headroom_bytes
    if not isinstance(headroom, int) or headroom < 0:
        raise ValueError(f"headroom_bytes must be an int >= 0, got {headroom_bytes!r}")
    if chunk_bytes is not None:
        policy.choose_chunk_bytes(0, requested=chunk_bytes)  # validates (>= 1 MiB)
    options = _Options(headroom, chunk_bytes)

    lists = _param_lists(param_groups)
    groups = [_prepare(i, params, world.world_size, round_robin, parameter_alignment) for i, params in enumerate(lists)]
    _check_no_shared_memory(groups, lists)
    return [_flatten_group(g, world, forced, options) for g in groups]


def _parse_tier(tier: Tier | str | None) -> Tier | None:
    if tier is None:
        return None
    try:
        return Tier(tier)
    except ValueError:
        raise ValueError(f"tier must be one of {[t.value for t in Tier]} or None, got {tier!r}") from None


def _resolve_world(group: Any) -> _World:
    initialised = dist.is_available() and dist.is_initialized()
    if group is None and not initialised:
        return _World(0, 1, None)
    if not initialised:
        raise ValueError("group= was given but torch.distributed is not initialised; "
                         "call torch.distributed.init_process_group first, or pass group=None")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group=; pass the data-parallel group it belongs to")
    return _World(rank, dist.get_world_size(group), group)


# --------------------------------------------------------------------------------------------
# Input checks: everything is validated before any param moves.


def _param_lists(param_groups: Sequence[Any]) -> list[list[torch.Tensor]]:
    """The params of each group as lists, from dicts with "params" or from lists of tensors."""
    if isinstance(param_groups, (torch.Tensor, dict)) or not hasattr(param_groups, "__iter__"):
        raise TypeError("param_groups must be a list of groups (dicts with 'params', or lists of tensors), got "
                        f"{type(param_groups).__name__}; for one group of params pass [list(params)]")
    lists = []
    for i, entry in enumerate(param_groups):
        if isinstance(entry, torch.Tensor):
            raise TypeError(f"param_groups[{i}] is a tensor, not a group; for one group of params pass "
                            "[list(params)] (or optimizer.param_groups)")
        if isinstance(entry, dict):
            if "params" not in entry:
                raise TypeError(f"param_groups[{i}] is a dict without 'params'")
            entry = entry["params"]
        params = [entry] if isinstance(entry, torch.Tensor) else list(entry)
        for j, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"param_groups[{i}] params[{j}] is a {type(param).__name__}, not a tensor")
        lists.append(params)
    return lists


def _prepare(index: int, params: list[torch.Tensor], world_size: int, round_robin: bool,
             parameter_alignment: bool) -> _Group:
    """Check one group's participating params and compute its layout.

    A param takes part if it requires grad and has elements (DeepSpeed's ``is_optimized_parameter``).
    """
    numels = [p.numel() for p in params]
    trainable = [p.requires_grad for p in params]
    members = [params[j] for j in range(len(params)) if trainable[j] and numels[j] > 0]
    # One pass over thousands of params in the common case; the loop below only names the culprit.
    if members and ({(p.dtype, p.device, p.layout) for p in members} != {(members[0].dtype, members[0].device,
                                                                          torch.strided)}
                    or members[0].device.type == "meta"):
        _name_bad_param(index, params, [j for j in range(len(params)) if trainable[j] and numels[j] > 0])
    first = members[0] if members else (params[0] if params else None)
    dtype = first.dtype if first is not None else torch.get_default_dtype()
    device = first.device if first is not None else torch.device("cpu")
    layout = zero12_group_layout(numels, world_size, element_size=torch.empty((), dtype=dtype).element_size(),
                                 trainable=trainable, round_robin=round_robin, parameter_alignment=parameter_alignment)
    ordered = [params[j] for j in layout.order]
    return _Group(index, ordered, [p.shape for p in ordered], layout, dtype, device)


def _name_bad_param(index: int, params: list[torch.Tensor], members: list[int]) -> None:
    """Raise for the first participating param that cannot share a flat buffer with the first one."""
    where = f"param_groups[{index}]"
    first = members[0]
    for j in members:
        p = params[j]
        if p.layout != torch.strided:
            raise TypeError(f"{where} params[{j}] has layout {p.layout}; only dense (strided) params can be "
                            "flattened: make it dense (.to_dense()) or freeze it (requires_grad=False)")
        if p.dtype != params[first].dtype:
            raise TypeError(f"{where} mixes dtypes: params[{first}] is {params[first].dtype}, params[{j}] is "
                            f"{p.dtype}; a flat buffer holds one dtype: cast the model to one dtype "
                            "(e.g. model.bfloat16()) or put the params of each dtype in their own group")
        if p.device != params[first].device:
            raise ValueError(f"{where} mixes devices: params[{first}] is on {params[first].device}, params[{j}] "
                             f"on {p.device}; move the model to one device first (model.to(device))")
        if p.device.type == "meta":
            raise ValueError(f"{where} params[{j}] is on the meta device and holds no values; materialise the "
                             "model (e.g. model.to_empty(device=...) and initialise it) before flattening")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes that a non-empty view touches."""
    lo = t.data_ptr()
    if t.is_contiguous():
        return lo, lo + t.numel() * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return lo, lo + span * t.element_size()


def _check_no_shared_memory(groups: list[_Group], lists: list[list[torch.Tensor]]) -> None:
    """Participating params (of all groups) must not overlap in memory: each gets its own slot of a
    flat buffer, so tied weights, one param listed twice or views of one tensor would come apart."""
    extents = []
    for g, params in zip(groups, lists):
        device = str(g.device)  # one device per group, checked by _prepare
        for j in g.layout.order:
            lo, hi = _byte_range(params[j])
            extents.append((device, lo, hi, g.index, j))
    extents.sort()
    reach: dict[str, tuple] = {}  # per device, the extent reaching furthest so far
    for extent in extents:
        device, lo, hi, i, j = extent
        before = reach.get(device)
        if before is not None and lo < before[2]:
            _, _, _, i0, j0 = before
            same = lists[i0][j0] is lists[i][j]
            what = "are the same tensor (listed twice)" if same else \
                "share memory (tied weights, or views of one tensor)"
            raise ValueError(f"param_groups[{i0}] params[{j0}] and param_groups[{i}] params[{j}] {what}; each "
                             "param gets its own slot of a flat buffer, so they would come apart: pass a shared "
                             "param once (model.parameters() does) or untie it (clone one of them)")
        if before is None or hi > before[2]:
            reach[device] = extent


# --------------------------------------------------------------------------------------------
# One group: decide, try tiers in order, re-point the params.


def _flatten_group(g: _Group, world: _World, forced: Tier | None, options: _Options) -> FlatGroup:
    if not g.params:
        logger.info("ztriton flatten group %d: no trainable non-empty params, empty flat buffer", g.index)
        flat = torch.empty(0, dtype=g.dtype, device=g.device)
        return FlatGroup(flat, (), g.layout, None, world.rank)

    start = time.perf_counter()
    memory = policy.probe_memory(g.device)
    free, host = memory.device_free, memory.host_available
    if world.world_size > 1:  # every rank must choose the same tier: decide on the smallest figures
        free, host = _min_over_ranks([free, host], g.device, world)
    decision = policy.choose_flatten_tier(g.nbytes, world.world_size, free, host, options.headroom_bytes, forced)
    policy.log_decision(f"flatten group {g.index}", decision, memory)
    run = _Run(decision, world, options, host)

    failures = []
    for tier in policy.flatten_fallbacks(decision.tier):
        try:
            flat = _TIERS[tier](g, run)
        except torch.OutOfMemoryError as exc:
            failures.append(f"{tier.value}: {exc}")
            logger.warning("ztriton flatten group %d: tier %s ran out of memory (%s); trying the next tier",
                           g.index, tier.value, exc)
            continue
        _alias(g, flat)
        logger.info("ztriton flatten group %d: %d params, %s flattened by tier %s in %.2f s", g.index,
                    len(g.params), _gib(g.nbytes), tier.value, time.perf_counter() - start)
        return FlatGroup(flat, tuple(g.params), g.layout, tier, world.rank, decision)

    where = _restore(g)
    raise torch.OutOfMemoryError(
        f"flatten group {g.index} ({_gib(g.nbytes)}): every tier ran out of memory "
        f"({'; '.join(failures)}). The params keep their values: {where}. Free device or host memory "
        "(or lower headroom_bytes) and call again")


def _alias(g: _Group, flat: torch.Tensor) -> None:
    """Each param's ``.data`` becomes its view of ``flat`` (DeepSpeed's ``_update_model_bit16_weights``)."""
    base = flat.storage_offset()
    for p, shape, offset in zip(g.params, g.shapes, g.offsets):
        # as_strided: one call per param instead of narrow + view (3x faster, for thousands of params)
        p.data = flat.as_strided(shape, _contiguous_strides(shape), base + offset)
    g.evicted.clear()


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _restore(g: _Group) -> str:
    """After every tier failed: move params that live in host memory back to their device, as far as
    memory allows. Returns where they are now, for the error message."""
    for k in sorted(g.evicted):
        try:
            g.params[k].data = g.params[k].data.to(g.device)
        except RuntimeError:  # out of memory: leave this one and the rest in host memory
            break
        g.evicted.discard(k)
    if not g.evicted:
        return f"all are on {g.device} as before"
    return (f"{len(g.evicted)} of {len(g.params)} now live in host memory (their .data is a CPU tensor; "
            f"move them back with p.data = p.data.to('{g.device}'))")


# --------------------------------------------------------------------------------------------
# The tiers. Each returns a filled flat buffer on g.device, or raises torch.OutOfMemoryError with
# every param still holding its values (on g.device, or in host memory and listed in g.evicted).


def _device_tier(g: _Group, run: _Run) -> torch.Tensor:
    flat = _empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    _pack(flat, _sources(g), g.offsets)
    return flat


def _distributed_tier(g: _Group, run: _Run) -> torch.Tensor:
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
        part = _empty(w1 - w0, g.dtype, g.device, "partition buffer")
        _pack(part, _sources(g), g.offsets, window=(w0, w1))
    except torch.OutOfMemoryError:
        part = None
    if not _all_ranks(part is not None, g.device, world):
        raise _FlattenOOM("a rank could not allocate its partition buffer")

    flat = None
    if decision.free_bytes - decision.headroom_bytes >= g.nbytes + part.numel() * g.element_size:
        flat = _try_empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
        if not _all_ranks(flat is not None, g.device, world):
            flat = None
    if flat is None:
        if run.host_bytes < g.nbytes:
            raise _FlattenOOM(f"the flat buffer does not fit beside the params and host memory "
                              f"({_gib(run.host_bytes)}) could not hold a recovery copy, so the params were kept")
        _free_params(g)
        flat = _try_empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
        if not _all_ranks(flat is not None, g.device, world):
            flat = None  # the recovery below needs the memory back
            _recover_from_partitions(g, part, run)
            raise _FlattenOOM("the flat buffer did not fit on every rank even with the params freed; the params "
                              "were rebuilt from the ranks' partitions in host memory")
    _all_gather(flat, part, world)
    return flat


def _evict_tier(g: _Group, run: _Run) -> torch.Tensor:
    """Move the fewest params that free enough device memory to host memory, then fill the flat buffer
    from the rest (one pack launch) and from host memory (copies in chunks)."""
    chunk = _chunk_numel(g, run.decision.free_bytes, run.options)
    resident = [k for k in range(len(g.params)) if k not in g.evicted]
    need = run.decision.evict_bytes if run.decision.tier is Tier.EVICT else _evict_estimate(g, run.options)
    picked = policy.choose_evictions([g.numel(k) * g.element_size for k in resident], need)
    _evict(g, [resident[i] for i in picked], chunk)
    try:
        flat = _empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    except torch.OutOfMemoryError:  # the estimate was short (fragmentation, other processes): evict all
        logger.info("ztriton flatten group %d: flat buffer still does not fit, evicting every param", g.index)
        _evict(g, [k for k in range(len(g.params)) if k not in g.evicted], chunk)
        flat = _empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    on_device = [k for k in range(len(g.params)) if k not in g.evicted]
    # The pack zeroes every gap, the evicted params' slots too; the copies below overwrite those.
    _pack(flat, [g.params[k].detach() for k in on_device], [g.offsets[k] for k in on_device])
    for k in sorted(g.evicted):
        _copy_in_chunks(flat, g.offsets[k], g.params[k].detach(), chunk)
    synchronize(g.device)
    return flat


def _host_tier(g: _Group, run: _Run) -> torch.Tensor:
    """Pack into one host buffer, free the params (they point into it meanwhile), copy it to the device once."""
    staging = _host_empty(g.layout.total_numel, g.dtype, "host flat buffer")
    chunk = _chunk_numel(g, run.decision.free_bytes, run.options)
    for k, (p, offset, pad) in enumerate(zip(g.params, g.offsets, g.layout.paddings)):
        _copy_to_host(staging.narrow(0, offset, g.numel(k)), p.detach(), chunk)
        staging.narrow(0, offset + g.numel(k), pad).zero_()
    staging.narrow(0, g.layout.packed_numel, g.layout.tail_padding).zero_()
    for k, (p, shape, offset) in enumerate(zip(g.params, g.shapes, g.offsets)):
        p.data = staging.narrow(0, offset, g.numel(k)).view(shape)
        g.evicted.add(k)
    flat = _empty(g.layout.total_numel, g.dtype, g.device, "flat buffer")
    flat.copy_(staging, non_blocking=staging.is_pinned())
    synchronize(g.device)
    return flat


_TIERS = {Tier.DEVICE: _device_tier, Tier.DISTRIBUTED: _distributed_tier, Tier.EVICT: _evict_tier,
          Tier.HOST: _host_tier}


# --------------------------------------------------------------------------------------------
# Helpers of the tiers.


def _sources(g: _Group) -> list[torch.Tensor]:
    return [p.detach() for p in g.params]


def _evict_estimate(g: _Group, options: _Options) -> int:
    """Bytes to evict when the evict tier is a fallback: what a fresh probe says is missing."""
    memory = policy.probe_memory(g.device)
    return max(0, g.nbytes - max(0, memory.device_free - options.headroom_bytes))


def _evict(g: _Group, positions: Sequence[int], chunk_numel: int) -> None:
    """Copy these params into one (pinned) host buffer and point them there; their device memory is freed.

    One buffer rather than one per param: pinned allocations are slow, and rounded up in size.
    """
    if not positions:
        return
    host = _host_empty(sum(g.numel(k) for k in positions), g.dtype, "evicted params")
    offset = 0
    for k in positions:
        p, numel = g.params[k], g.numel(k)
        view = host.narrow(0, offset, numel)
        _copy_to_host(view, p.detach(), chunk_numel)
        p.data = view.view(g.shapes[k])
        g.evicted.add(k)
        offset += numel
    logger.info("ztriton flatten group %d: evicted %d params (%s) to host memory", g.index, len(positions),
                _gib(host.numel() * g.element_size))


def _copy_to_host(dst: torch.Tensor, src: torch.Tensor, chunk_numel: int) -> None:
    """``src`` flattened row-major into the contiguous host view ``dst``, without a full-size device copy.

    torch would make a strided device source contiguous on the device first (as large as the
    param, when memory is short): such sources go through a device chunk with ``copy_chunk``.
    """
    if src.is_contiguous() or src.device.type != "cuda":
        dst.view(src.shape).copy_(src)
        return
    from ztriton.kernels import copy_chunk

    stage = _empty(min(chunk_numel, src.numel()), src.dtype, src.device, "staging chunk")
    for start in range(0, src.numel(), stage.numel()):
        n = min(stage.numel(), src.numel() - start)
        copy_chunk(src, stage[:n], start, n)
        dst[start:start + n].copy_(stage[:n])


def _free_params(g: _Group) -> None:
    """Point every param at an empty placeholder, releasing its device memory (shapes are kept in g)."""
    for p in g.params:
        p.data = torch.empty(0, dtype=g.dtype, device=g.device)


def _recover_from_partitions(g: _Group, part: torch.Tensor, run: _Run) -> None:
    """Rebuild the whole flat buffer in host memory from every rank's partition and point the params into it.

    All ranks take part. The gather goes through a small device buffer, W chunks at a time, so it
    needs next to no device memory (and works with backends that cannot gather host tensors). If even
    that cannot be allocated on every rank, the values live only in the ranks' partitions: that is
    raised as a RuntimeError (not an out-of-memory error, which would fall through to the next tier).
    """
    world = run.world
    size = part.numel()
    chunk = max(1, _chunk_numel(g, run.decision.free_bytes, run.options) // world.world_size)
    host = _try_empty_host(g.layout.total_numel, g.dtype, "host flat buffer")
    staging = _try_empty(world.world_size * min(chunk, size), g.dtype, g.device, "gather staging buffer")
    if not _all_ranks(host is not None and staging is not None, g.device, world):
        raise RuntimeError(f"flatten group {g.index}: the params were freed and neither the flat buffer nor a host "
                           f"copy ({_gib(g.nbytes)}) could be allocated on every rank; their values now exist only in "
                           "the ranks' partitions and are lost. Free memory, rebuild the model and call again "
                           "(with tier='evict' or 'host' to keep the params until the buffer exists)")
    for start in range(0, size, chunk):
        n = min(chunk, size - start)
        out = staging[:world.world_size * n]
        _all_gather(out, part[start:start + n], world)
        for r in range(world.world_size):
            host[r * size + start:r * size + start + n].copy_(out[r * n:(r + 1) * n])
    for k, (p, shape, offset) in enumerate(zip(g.params, g.shapes, g.offsets)):
        p.data = host.narrow(0, offset, g.numel(k)).view(shape)
        g.evicted.add(k)
    logger.warning("ztriton flatten group %d: recovered the params from the ranks' partitions into host memory",
                   g.index)


def _chunk_numel(g: _Group, free_bytes: int, options: _Options) -> int:
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


# --------------------------------------------------------------------------------------------
# Memory: allocations that fail as torch.OutOfMemoryError, on the device and on the host.


def _empty(numel: int, dtype: torch.dtype, device: torch.device | str, what: str) -> torch.Tensor:
    """``torch.empty``, with the CPU allocator's failure (a plain RuntimeError) raised as an OOM too.

    ``what`` names the buffer in the error (and lets tests fail one kind of allocation).
    """
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except RuntimeError as exc:
        if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc):
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            raise _FlattenOOM(f"could not allocate the {what} ({_gib(nbytes)}) on {device}") from None
        raise


def _try_empty(numel: int, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor | None:
    """:func:`_empty`, or None where it runs out of memory."""
    try:
        return _empty(numel, dtype, device, what)
    except torch.OutOfMemoryError:
        return None


def _try_empty_host(numel: int, dtype: torch.dtype, what: str) -> torch.Tensor | None:
    """:func:`_host_empty`, or None where it runs out of memory."""
    try:
        return _host_empty(numel, dtype, what)
    except torch.OutOfMemoryError:
        return None


def _host_empty(numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A host buffer: pinned when there is a GPU (fast, asynchronous copies), pageable if pinning fails."""
    if torch.cuda.is_available():
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            logger.warning("ztriton: could not pin %s of host memory for the %s (%s); using pageable memory",
                           _gib(numel * torch.empty((), dtype=dtype).element_size()), what, exc)
    return _empty(numel, dtype, "cpu", what)


# --------------------------------------------------------------------------------------------
# Packing: the kernels, or plain torch where they cannot run.


def _pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
          window: tuple[int, int] | None = None) -> None:
    """``ztriton.kernels.pack``; on CPU tensors without the Triton interpreter, :func:`_torch_pack`."""
    if dst.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        logger.info("ztriton: CPU tensors without TRITON_INTERPRET=1, packing with torch instead of the kernels")
        _torch_pack(dst, sources, offsets, window)
        return
    from ztriton.kernels import pack  # imported here: importing ztriton must not import triton

    pack(dst, sources, offsets, window)


def _torch_pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
                window: tuple[int, int] | None = None) -> None:
    """What ``kernels.pack`` does, in torch: sources at their offsets (within ``window``), zeros elsewhere.

    Sources may sit on another device than ``dst`` (the host tier packs device params into host memory).
    """
    w0, w1 = (0, dst.numel()) if window is None else window
    covered = []
    for i, (src, offset) in enumerate(zip(sources, offsets)):
        if src.dtype != dst.dtype:
            raise TypeError(f"sources[{i}] has dtype {src.dtype} but dst has {dst.dtype}")
        lo, hi = max(offset, w0), min(offset + src.numel(), w1)
        if lo < hi:
            dst[lo - w0:hi - w0].copy_(src.reshape(-1)[lo - offset:hi - offset])
            covered.append((lo - w0, hi - w0))
    cursor = 0
    for lo, hi in sorted(covered) + [(w1 - w0, w1 - w0)]:
        if lo > cursor:
            dst[cursor:lo].zero_()
        cursor = max(cursor, hi)


# --------------------------------------------------------------------------------------------
# Collectives.


def _comm_device(device: torch.device, world: _World) -> torch.device:
    """Where small agreement tensors live: NCCL only moves device tensors, the others take host ones."""
    return device if dist.get_backend(world.group) == "nccl" else torch.device("cpu")


def _min_over_ranks(values: list[int], device: torch.device, world: _World) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=_comm_device(device, world))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.group)
    return [int(v) for v in t.tolist()]


def _all_ranks(ok: bool, device: torch.device, world: _World) -> bool:
    """Whether ``ok`` holds on every rank (a collective; trivially ``ok`` in a world of one)."""
    if world.world_size == 1:
        return ok
    return bool(_min_over_ranks([int(ok)], device, world)[0])


def _all_gather(out: torch.Tensor, part: torch.Tensor, world: _World) -> None:
    """Every rank's ``part`` end to end into ``out``, as bytes (any dtype, any backend that moves uint8)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(torch.uint8), part.view(torch.uint8), group=world.group)


def _gib(nbytes: int) -> str:
    """Bytes for a log line: GiB, or MiB below one GiB."""
    return f"{nbytes / policy.GiB:.2f} GiB" if nbytes >= policy.GiB else f"{nbytes / policy.MiB:.2f} MiB"
