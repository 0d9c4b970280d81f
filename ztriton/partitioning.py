"""ZeRO-3 partitioning, the bytes: every rank's slices of many parameters into per-rank buffers.

:func:`partition_params` fills one preallocated per-rank buffer per dtype straight from the sources,
strided or not, on the device or in host memory, and returns each parameter's partition as a tensor
of its own over that buffer. It changes no parameter: the caller turns the partitions into ZeRO-3
parameters (``ztriton.integrations.deepspeed.zero3_param`` for ``ztriton.partition`` and ``zero.Init``).
No rank ever holds a full-size copy of a parameter: the device holds the per-rank buffers plus, at
most, staging chunks of a size the policy picks (see ``docs/architecture.md``, "Vocabulary").

Values are rank 0's, as with ``zero.Init``. How they travel:

* **local** (a world of one, or torch's fake process group, where collectives do nothing): each rank
  cuts its slices from its own tensors, as ``zero.Init`` does in such a world.
* **scatter** (a real world of W > 1): group rank 0 cuts every rank's slices of one staging chunk of
  the per-rank buffer at a time into a [W, chunk] staging buffer and scatters it; each rank receives
  its row straight into its buffer. Rank 0 sends each byte once (a broadcast would send every
  parameter to every rank) and holds W chunks extra, the others nothing.

Failures: every check and allocation comes before the first write, and in a real world every step a
rank could fail alone (the checks, each allocation, rank 0's filling of each staging chunk) is agreed
by all ranks (:func:`ztriton.comm.agree`, whatever the exception), so either all ranks go on or all
raise: no rank waits forever in a collective that another rank left.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from ztriton import memory, policy
from ztriton.comm import World, agreed, min_over_ranks
from ztriton.kernels import Piece, copy_chunk, pack_slices, torch_pack_slices
from ztriton.kernels.plan import runs_on
from ztriton.layout import Zero3Slice, zero3_slice
from ztriton.memory import alias, format_bytes, synchronize

logger = logging.getLogger("ztriton")

__all__ = ["Partition", "Partitioned", "Transfer", "partition_params", "staging_chunk_bytes"]


@dataclass(frozen=True)
class Partition:
    """One parameter's partition: this rank's slice, a tensor of its own over a per-rank buffer
    (padding zeroed), and the parameter's numel padded to a multiple of the world size."""

    name: str
    param: torch.nn.Parameter
    data: torch.Tensor
    aligned_numel: int


class Transfer(str, enum.Enum):
    """How rank 0's values reach each rank's partitions (see the module's docstring)."""

    LOCAL = "local"
    SCATTER = "scatter"


@dataclass
class Partitioned:
    """What a partitioning did: the per-rank buffers (one per dtype), how it moved the data, and each
    parameter's :class:`Partition` (in the order the parameters were given)."""

    buffers: dict[torch.dtype, torch.Tensor]
    names: list[str]
    world_size: int
    rank: int
    path: Transfer
    chunk_bytes: int
    notes: list[str] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)


@dataclass(frozen=True)
class _Entry:
    """One parameter's place: its source tensor, its ZeRO-3 slice, its offset in the per-rank buffer."""

    name: str
    param: torch.nn.Parameter
    slice: Zero3Slice
    offset: int
    source: torch.Tensor  # the param's values, with a new tensor's strides where it is contiguous


def partition_params(named: list[tuple[str, torch.nn.Parameter]], world: World, *, home: torch.device,
                     probe_device: torch.device, pin_memory: bool, options: policy.Options,
                     log_level: int = logging.INFO) -> Partitioned:
    """Fill this rank's partitions of ``named`` over ``world``; no parameter changes.

    ``home`` is where the per-rank buffers live (the accelerator, or the host for offloaded
    partitions, pinned if ``pin_memory`` and CUDA is present); ``probe_device`` the device whose free
    memory sizes the staging chunk unless ``options.chunk_bytes`` is set.
    """
    path = Transfer.SCATTER if world.size > 1 and not world.simulated else Transfer.LOCAL

    def checks():
        _check_params(named)
        return _entries_by_dtype(named, world.size), staging_chunk_bytes(probe_device, world.size, options)

    by_dtype, (chunk, figures) = _agreed(world, path, checks, "checking the parameters")
    result = Partitioned({}, [n for n, _ in named], world.size, world.rank, path, chunk)
    logger.log(log_level, "ztriton partition: %d params in %d dtype(s) over %d ranks (rank %d), partitions on %s, "
               "path=%s (%s), staging chunk %s [%s]", len(named), len(by_dtype), world.size, world.rank, home, path.value,
               "rank 0's values scattered" if path is Transfer.SCATTER else "each rank slices its own values",
               format_bytes(chunk), figures)

    if path is Transfer.LOCAL and not runs_on(home):
        logger.log(log_level, "ztriton partition: the Triton kernels do not run on %s here (CPU tensors need "
                   "TRITON_INTERPRET=1); copying with torch", home)
    for dtype, entries in by_dtype.items():
        total = sum(e.slice.partition_numel for e in entries)
        buffer = _agreed(world, path, lambda: _allocate(total, dtype, home, pin_memory),
                         f"allocating the per-rank {dtype} buffer")
        if path is Transfer.LOCAL:
            _fill_local(buffer, entries, world.rank, chunk)
        else:
            _fill_scattered(buffer, entries, world, chunk)
        result.buffers[dtype] = buffer
        result.partitions += [Partition(e.name, e.param, _alias(buffer, e.offset, e.slice.partition_numel),
                                        e.slice.aligned_numel) for e in entries]
    order = {id(p): i for i, (_, p) in enumerate(named)}
    result.partitions.sort(key=lambda part: order[id(part.param)])
    return result


def _agreed(world: World, path: Transfer, step, what: str):
    """``step()``, agreed by every rank when the ranks exchange data (:func:`ztriton.comm.agreed`)."""
    if path is Transfer.LOCAL:
        return step()
    return agreed(world, step, f"ztriton partition: {what}", "no parameter was changed")


def _alias(buffer: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """``buffer[offset:offset + numel]`` as a tensor of its own (see :func:`ztriton.memory.alias`)."""
    return alias(buffer.untyped_storage(), buffer.storage_offset() + offset, numel, buffer.dtype, buffer.device)


def staging_chunk_bytes(device: torch.device, world_size: int, options: policy.Options) -> tuple[int, str]:
    """The staging chunk size (``options.chunk_bytes``, else the policy's pick from ``device``'s free
    memory with W + 1 chunks in flight) and the figures it came from, for the log."""
    if options.chunk_bytes is not None:
        return options.chunk_bytes, "chunk size given by the caller (at most the per-rank buffer)"
    free = memory.probe_memory(device)
    chunk = policy.choose_chunk_bytes(free.device_free, options.headroom_bytes, buffers=world_size + 1)
    return chunk, f"free {format_bytes(free.device_free)} on {free.device} via {free.source}"


# --------------------------------------------------------------------------------------------
# Checks and layout.


def _check_params(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Every parameter is one whose values can be copied (``policy.check_tensors``) and that ZeRO-3 can hold."""
    policy.check_tensors([p for _, p in named], lambda i: f"parameter {named[i][0]!r}",
                         hint=" or keep it out of the partitioned module")
    for name, p in named:
        if p.dim() == 0:
            raise ValueError(f"parameter {name!r} is 0-dimensional; DeepSpeed ZeRO-3 cannot hold scalars "
                             "(its broadcast views parameters as bytes): make it shape [1]")


def _entries_by_dtype(named, world: int) -> dict[torch.dtype, list[_Entry]]:
    """Parameters grouped by dtype, each with its offset in its dtype's per-rank buffer."""
    groups: dict[torch.dtype, list[_Entry]] = {}
    offsets: dict[torch.dtype, int] = {}
    for name, p in named:
        sl = zero3_slice(p.numel(), world)
        offset = offsets.get(p.dtype, 0)
        groups.setdefault(p.dtype, []).append(_Entry(name, p, sl, offset, memory.unit_strided(p.data)))
        offsets[p.dtype] = offset + sl.partition_numel
    return groups


def _allocate(numel: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> torch.Tensor:
    what = f"per-rank {dtype} buffer"
    try:
        if device.type == "cpu" and pin_memory and torch.cuda.is_available():
            return memory.host_empty(numel, dtype, what, pin=True)
        return memory.empty(numel, dtype, device, what)
    except torch.OutOfMemoryError as exc:
        raise RuntimeError(f"cannot allocate the per-rank {dtype} buffer of {numel} elements on {device}; "
                           "free device memory or pass remote_device='cpu'") from exc


def _chunk_pieces(entries: list[_Entry], rank: int, begin: int, end: int) -> list[Piece]:
    """Pieces that write ``rank``'s elements ``[begin, end)`` of the per-rank buffer, offsets relative
    to ``begin``. The rest of the chunk (each partition's padding) is left for zero-filling."""
    pieces = []
    for e in entries:
        lo, hi = max(begin, e.offset), min(end, e.offset + e.slice.valid_numel(rank))
        if lo < hi:
            pieces.append(Piece(e.source, e.slice.rank_start(rank) + lo - e.offset, hi - lo, lo - begin))
    return pieces


def _chunks(total: int, chunk_elems: int) -> Iterator[tuple[int, int]]:
    """``[begin, end)`` of each staging chunk of ``total`` elements."""
    for begin in range(0, total, chunk_elems):
        yield begin, min(total, begin + chunk_elems)


# --------------------------------------------------------------------------------------------
# Moving the data.


def _fill(dst: torch.Tensor, pieces: list[Piece], chunk_elems: int) -> None:
    """Write ``pieces`` into ``dst`` and zeros everywhere else.

    One kernel launch when every source is on dst's device; otherwise piece by piece, through
    ``copy_`` (host <-> device) and staging chunks for strided device sources.
    """
    slices = [(p.src, p.start, p.count, p.offset) for p in pieces]
    if runs_on(dst.device) and all(p.src.device == dst.device for p in pieces):
        pack_slices(dst, slices)
        return
    # The reference would make a strided device source contiguous where it is: those go in chunks.
    strided = [not p.src.is_contiguous() and runs_on(p.src.device) for p in pieces]
    torch_pack_slices(dst, [s for s, staged in zip(slices, strided) if not staged])
    for p, staged in zip(pieces, strided):
        if staged:
            _copy_strided(p.src, p.start, p.count, dst.narrow(0, p.offset, p.count), chunk_elems)


def _copy_strided(src: torch.Tensor, start: int, count: int, out: torch.Tensor, chunk_elems: int) -> None:
    """``out[:] = src.flatten()[start:start + count]`` for a strided source on another device than
    ``out``, through staging chunks next to ``src``: never a full-size copy on its device."""
    sizes = policy.staging_numels(chunk_elems * src.element_size(), count, src.element_size())
    stage = memory.empty_first_fitting(sizes, src.dtype, src.device, "strided-source staging")
    chunk_elems = stage.numel()
    for begin, end in _chunks(count, chunk_elems):
        copy_chunk(src, stage[:end - begin], start + begin, end - begin)
        out[begin:end].copy_(stage[:end - begin])


def _fill_local(buffer: torch.Tensor, entries: list[_Entry], rank: int, chunk_bytes: int) -> None:
    """This rank's slices of its own tensors, straight into its buffer."""
    if len(entries) <= policy.PER_PARAM_COPIES and all(
            e.source.device == buffer.device and e.source.is_contiguous() for e in entries):
        _copy_per_param(buffer, entries, rank)
        return
    chunk_elems = max(1, chunk_bytes // buffer.element_size())
    pieces = _chunk_pieces(entries, rank, 0, buffer.numel())
    _fill(buffer, pieces, chunk_elems)
    if any(p.src.device != buffer.device for p in pieces):
        synchronize()  # a non-blocking host copy may still read its source


def _copy_per_param(buffer: torch.Tensor, entries: list[_Entry], rank: int) -> None:
    """Each param's valid slice by one copy, its padding zeroed (see ``policy.PER_PARAM_COPIES``). The
    places are this module's own (``_entries_by_dtype``): disjoint and in range by construction, so no
    plan validates them. Bytes move as bytes, as the kernels move them (a bool's other byte values too)."""
    width = buffer.element_size()
    out = buffer.view(torch.uint8)
    for e in entries:
        valid, size = e.slice.valid_numel(rank), e.slice.partition_numel
        if valid:
            src = memory.flat_bytes(e.source)
            out.narrow(0, e.offset * width, valid * width).copy_(src.narrow(0, e.slice.rank_start(rank) * width,
                                                                             valid * width))
        if valid < size:
            out.narrow(0, (e.offset + valid) * width, (size - valid) * width).zero_()


def _staging(world: World, chunk_bytes: int, buffer: torch.Tensor):
    """Rank 0's [W, chunk] scatter staging and, where the buffer is not on the comm device, a receive
    chunk. Every rank must use the same chunk, yet each may have picked its own size (from its own
    free memory): one all-reduce agrees on the smallest, or, if any rank's allocation failed (with any
    exception: the CPU allocator raises a plain RuntimeError), on the next smaller size
    (``policy.staging_numels``: halves, down to one element), and every rank takes the same branch. Only
    when one element does not fit does every rank fail."""
    comm = world.comm_device
    itemsize = buffer.element_size()
    chunk_elems = policy.staging_numels(chunk_bytes, buffer.numel(), itemsize)[0]
    while True:
        failure = None
        try:
            recv = None if buffer.device == comm else memory.empty(chunk_elems, buffer.dtype, comm, "receive chunk")
            rows = memory.empty(world.size * chunk_elems, buffer.dtype, comm, "scatter staging").view(
                world.size, chunk_elems) if world.rank == 0 else None
        except Exception as exc:  # noqa: BLE001 -- whatever failed here, every rank must hear of it below
            recv = rows = None
            failure = exc
        # [smallest size among ranks whose allocation worked (0 if any failed), smallest size asked]
        fitted, smallest = min_over_ranks([chunk_elems if failure is None else 0, chunk_elems], world)
        if fitted > 0:  # every rank allocated at least `smallest`: use that much of what it holds
            return smallest, rows, recv
        if smallest <= 1:
            here = f" (here: {type(failure).__name__}: {failure})" if failure is not None else " (on another rank)"
            raise RuntimeError(f"ztriton partition: cannot allocate even one element of staging on {comm} on every "
                               f"rank{here}; free memory and retry; no parameter was changed")
        smaller = policy.staging_numels(smallest * itemsize, smallest, itemsize)[1]
        logger.warning("ztriton partition: staging of %s did not fit on every rank%s; trying %s",
                       format_bytes(smallest * itemsize),
                       f" ({type(failure).__name__}: {failure})" if failure is not None else "",
                       format_bytes(smaller * itemsize))
        recv = rows = None
        chunk_elems = smaller


def _fill_scattered(buffer: torch.Tensor, entries: list[_Entry], world: World, chunk_bytes: int) -> None:
    """Rank 0 scatters every rank's slices, one staging chunk of the per-rank buffer at a time; each
    chunk's filling is agreed before its scatter, so a failure on rank 0 stops every rank."""
    itemsize = buffer.element_size()
    chunk_elems, staging, recv_stage = _staging(world, chunk_bytes, buffer)
    for done, (begin, end) in enumerate(_chunks(buffer.numel(), chunk_elems)):
        n = end - begin

        def fill_rows():
            if world.rank != 0:
                return None
            rows = [staging[r, :n] for r in range(world.size)]
            for r, row in enumerate(rows):
                _fill(row, _chunk_pieces(entries, r, begin, end), chunk_elems)
            return rows

        rows = _agreed(world, Transfer.SCATTER, fill_rows, f"rank 0 filling staging chunk {done}")
        recv = buffer[begin:end] if recv_stage is None else recv_stage[:n]
        dist.scatter(recv, scatter_list=rows, src=world.global_rank(0), group=world.group)
        if recv_stage is not None:
            buffer[begin:end].copy_(recv)
        _progress(done, buffer.numel(), chunk_elems, itemsize)
    synchronize()


def _progress(chunk: int, total: int, chunk_elems: int, itemsize: int) -> None:
    chunks = -(-total // chunk_elems)
    if chunks >= 20 and (chunk + 1) % (chunks // 10) == 0:
        logger.info("ztriton partition: %d%% of %s", 100 * (chunk + 1) // chunks, format_bytes(total * itemsize))
