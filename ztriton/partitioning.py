"""ZeRO-3 partitioning: ``ztriton.partition(module, group)``.

Every parameter of the module becomes a DeepSpeed ZeRO-3 parameter whose partition (``ds_tensor``)
is a view of one preallocated per-rank buffer per dtype, filled by the kernels straight from the
source, strided or not, on the device or in host memory. No rank ever holds a full-size copy of a
parameter: the device holds the per-rank buffers plus, at most, staging chunks of a size the policy
picks.

Values are rank 0's, as with ``zero.Init``. How they travel:

* **local** (a world of one, or torch's fake process group, where collectives do nothing): each rank
  cuts its slices from its own tensors, as ``zero.Init`` does in such a world.
* **scatter** (a real world of W > 1): group rank 0 cuts every rank's slices of one window of the
  per-rank buffer at a time into a [W, chunk] staging buffer and scatters it; each rank receives its
  row straight into its buffer. Rank 0 sends each byte once (a broadcast would send every parameter
  to every rank) and holds W chunks extra, the others nothing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from ztriton import deepspeed as ds_adapter
from ztriton import policy
from ztriton.memory import alias
from ztriton.memory import kernels_run_on as _kernels_run_on  # a module name: tests replace it
from ztriton.kernels import Piece, copy_chunk, pack_slices
from ztriton.kernels.pack import uncovered
from ztriton.layout import Zero3Slice, zero3_slice

logger = logging.getLogger("ztriton")

__all__ = ["Partitioned", "partition", "partition_params"]


@dataclass
class Partitioned:
    """What :func:`partition` did: the per-rank buffers (one per dtype) and how it moved the data."""

    buffers: dict[torch.dtype, torch.Tensor]
    names: list[str]
    world_size: int
    rank: int
    path: str  # "local" or "scatter"
    chunk_bytes: int
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Entry:
    """One parameter's place: its source tensor, its ZeRO-3 slice, its offset in the per-rank buffer."""

    name: str
    param: torch.nn.Parameter
    slice: Zero3Slice
    offset: int


def partition(module: torch.nn.Module, group: dist.ProcessGroup | None = None, *, remote_device: str | None = None,
              pin_memory: bool = True, chunk_bytes: int | None = None, headroom_bytes: int | None = None,
              config: dict | None = None) -> Partitioned:
    """Partition every not-yet-partitioned parameter of ``module`` over ``group`` as ZeRO-3 does.

    Afterwards ``deepspeed.zero.GatheredParameters(list(module.parameters()))`` gives back the full
    tensors and ``deepspeed.initialize(model=module, config=<stage 3>)`` accepts the module.

    Args:
        group: the partition group (default: the whole world). torch.distributed must be initialised.
        remote_device: ``"cpu"`` keeps partitions in host memory (pinned if ``pin_memory`` and CUDA is
            present), as DeepSpeed's ``offload_param``; default: the accelerator.
        chunk_bytes: staging chunk size; default: the policy's pick from free device memory.
        headroom_bytes: device memory the policy leaves free (default 1 GiB).
        config: a DeepSpeed config dict for the ZeRO-3 machinery (default: stage 3, its defaults).

    On any error before the partitions are installed, the parameters are left as they were.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if remote_device not in (None, "cpu"):
        raise ValueError(f"remote_device must be None (the accelerator) or 'cpu', got {remote_device!r}; "
                         "for NVMe offload use deepspeed.zero.Init")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call deepspeed.init_distributed() first "
                           "(a single process can use a world of one, or torch's fake process group)")
    named = [(n, p) for n, p in module.named_parameters() if not ds_adapter.is_zero3_param(p)]
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of the given group; pass a group it belongs to")
    context = ds_adapter.zero3_context(group, remote_device, pin_memory, config)
    reason = ds_adapter.unsupported_reason(context)
    if reason is not None:
        raise NotImplementedError(f"ztriton.partition does not build partitions for {reason}; "
                                  "use deepspeed.zero.Init for this mode")
    return partition_params(context, named, group, offload=remote_device == "cpu", pin_memory=pin_memory,
                            chunk_bytes=chunk_bytes, headroom_bytes=headroom_bytes)


def partition_params(context, named: list[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup | None, *,
                     offload: bool, pin_memory: bool, chunk_bytes: int | None = None,
                     headroom_bytes: int | None = None, log_level: int = logging.INFO) -> Partitioned:
    """Partition ``named`` (not yet ZeRO-3 params) over ``group`` with ``context``'s ZeRO-3 machinery.

    ``context`` is a ``deepspeed.zero.Init`` object (see :mod:`ztriton.deepspeed`): the converted params'
    methods use its process group and devices. ``offload`` keeps the partitions in host memory. This
    is :func:`partition` after its checks, and what ``zero.Init`` runs under ``"partition_backend": "triton"``.
    """
    _check_params(named)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = ds_adapter.local_device(context)
    home = torch.device("cpu") if offload else local
    path = "scatter" if world > 1 and dist.get_backend(group) != "fake" else "local"

    by_dtype = _entries_by_dtype(named, world)
    chunk, figures = staging_chunk_bytes(local, world, headroom_bytes, chunk_bytes)
    result = Partitioned({}, [n for n, _ in named], world, rank, path, chunk)
    logger.log(log_level, "ztriton partition: %d params in %d dtype(s) over %d ranks (rank %d), partitions on %s, "
               "path=%s (%s), staging chunk %.1f MiB [%s]", len(named), len(by_dtype), world, rank, home, path,
               "rank 0's values scattered" if path == "scatter" else "each rank slices its own values",
               chunk / policy.MiB, figures)

    for dtype, entries in by_dtype.items():
        total = sum(e.slice.partition_numel for e in entries)
        buffer = _allocate(total, dtype, home, pin_memory)
        if path == "local":
            _fill_local(buffer, entries, rank, chunk)
        else:
            _fill_scattered(buffer, entries, rank, world, group, chunk)
        result.buffers[dtype] = buffer

    # Only now, with every partition written, do the parameters change.
    for entries in by_dtype.values():
        buffer = result.buffers[entries[0].param.dtype]
        for e in entries:
            ds_adapter.convert(context, e.param)
            ds_adapter.install_partition(e.param, _alias(buffer, e.offset, e.slice.partition_numel),
                                         e.slice.aligned_numel, local)
    return result


def _alias(buffer: torch.Tensor, offset: int, numel: int) -> torch.Tensor:
    """``buffer[offset:offset + numel]`` as a tensor of its own (see :func:`ztriton.buffers.alias`)."""
    return alias(buffer.untyped_storage(), buffer.storage_offset() + offset, numel, buffer.dtype, buffer.device)


def staging_chunk_bytes(device: torch.device, world: int, headroom_bytes: int | None = None,
                        requested: int | None = None) -> tuple[int, str]:
    """The staging chunk size (the policy's pick from ``device``'s free memory, with W + 1 chunks in
    flight, unless ``requested``) and the figures it came from, for the log."""
    headroom = policy.DEFAULT_HEADROOM_BYTES if headroom_bytes is None else headroom_bytes
    if requested is not None:
        return policy.choose_chunk_bytes(0, headroom, requested), "chunk size given by the caller"
    memory = policy.probe_memory(device)
    chunk = policy.choose_chunk_bytes(memory.device_free, headroom, None, buffers=world + 1)
    return chunk, f"free {memory.device_free / policy.GiB:.2f} GiB on {memory.device} via {memory.source}"


# --------------------------------------------------------------------------------------------
# Checks and layout.


def _check_params(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    for name, p in named:
        if p.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device and holds no values: materialise the module "
                             "first (e.g. module.to_empty(device='cpu') and load its weights)")
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
        groups.setdefault(p.dtype, []).append(_Entry(name, p, sl, offset))
        offsets[p.dtype] = offset + sl.partition_numel
    return groups


def _allocate(numel: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> torch.Tensor:
    pin = device.type == "cpu" and pin_memory and torch.cuda.is_available()
    try:
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
    except torch.OutOfMemoryError as exc:
        raise RuntimeError(f"cannot allocate the per-rank {dtype} buffer of {numel} elements on {device}; "
                           "free device memory or pass remote_device='cpu'") from exc


def _window_pieces(entries: list[_Entry], rank: int, begin: int, end: int) -> list[Piece]:
    """Pieces that write ``rank``'s elements ``[begin, end)`` of the per-rank buffer, offsets relative
    to ``begin``. The rest of the window (each partition's padding) is left for zero-filling."""
    pieces = []
    for e in entries:
        lo, hi = max(begin, e.offset), min(end, e.offset + e.slice.valid_numel(rank))
        if lo < hi:
            pieces.append(Piece(e.param.data, e.slice.rank_start(rank) + lo - e.offset, hi - lo, lo - begin))
    return pieces


def _windows(total: int, chunk_elems: int) -> Iterator[tuple[int, int]]:
    for begin in range(0, total, chunk_elems):
        yield begin, min(total, begin + chunk_elems)


# --------------------------------------------------------------------------------------------
# Moving the data.


def _fill(dst: torch.Tensor, pieces: list[Piece], chunk_elems: int) -> None:
    """Write ``pieces`` into ``dst`` and zeros everywhere else.

    One kernel launch when every source is on dst's device; otherwise piece by piece, through
    ``copy_`` (host <-> device) and staging chunks for strided device sources.
    """
    if _kernels_run_on(dst.device) and all(p.src.device == dst.device for p in pieces):
        pack_slices(dst, [(p.src, p.start, p.count, p.offset) for p in pieces])
        return
    for offset, count in uncovered([(p.offset, p.offset + p.count) for p in pieces], 0, dst.numel()):
        dst.narrow(0, offset, count).zero_()
    for p in pieces:
        _copy_range(p.src, p.start, p.count, dst.narrow(0, p.offset, p.count), chunk_elems)


def _copy_range(src: torch.Tensor, start: int, count: int, out: torch.Tensor, chunk_elems: int) -> None:
    """``out[:] = src.flatten()[start:start + count]`` across devices, never a full copy on the device."""
    if src.is_contiguous():
        out.copy_(src.reshape(-1).narrow(0, start, count), non_blocking=src.is_pinned() or out.is_pinned())
    elif _kernels_run_on(src.device):
        stage = torch.empty(min(count, chunk_elems), dtype=src.dtype, device=src.device)
        for begin, end in _windows(count, chunk_elems):
            copy_chunk(src, stage[:end - begin], start + begin, end - begin)
            out[begin:end].copy_(stage[:end - begin])
    else:  # a strided host source: torch makes it contiguous on the host, never on the device
        out.copy_(src.reshape(-1).narrow(0, start, count))


def _fill_local(buffer: torch.Tensor, entries: list[_Entry], rank: int, chunk_bytes: int) -> None:
    """This rank's slices of its own tensors, straight into its buffer."""
    chunk_elems = max(1, chunk_bytes // buffer.element_size())
    pieces = _window_pieces(entries, rank, 0, buffer.numel())
    _fill(buffer, pieces, chunk_elems)
    if any(p.src.device != buffer.device for p in pieces):
        _synchronize(buffer)  # a non-blocking host copy may still read its source


def _staging(rank: int, world: int, group, chunk_bytes: int, buffer: torch.Tensor, comm: torch.device):
    """Rank 0's [W, chunk] scatter staging and, where the buffer is not on the comm device, a receive
    chunk. Every rank must use the same chunk, yet each may have picked its own size (from its own
    free memory): one all-reduce agrees on the smallest, or, if any rank's allocation failed, on half
    the smallest, and every rank takes the same branch. Down to policy.MIN_CHUNK_BYTES, then fail."""
    while True:
        chunk_elems = max(1, chunk_bytes // buffer.element_size())
        try:
            recv = None if buffer.device == comm else torch.empty(chunk_elems, dtype=buffer.dtype, device=comm)
            rows = torch.empty(world, chunk_elems, dtype=buffer.dtype, device=comm) if rank == 0 else None
            ok = True
        except torch.OutOfMemoryError:
            recv = rows = None
            ok = False
        # [smallest size among ranks whose allocation worked (0 if any failed), smallest size asked]
        agreed = torch.tensor([chunk_bytes if ok else 0, chunk_bytes], dtype=torch.int64, device=comm)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        fitted, smallest = (int(v) for v in agreed.tolist())
        if fitted > 0:  # every rank allocated at least `smallest`: use that much of what it holds
            return max(1, smallest // buffer.element_size()), rows, recv
        if smallest <= policy.MIN_CHUNK_BYTES:
            raise RuntimeError(f"cannot allocate even {policy.MIN_CHUNK_BYTES // policy.MiB} MiB of staging on {comm} "
                               "on every rank; free device memory and retry")
        logger.warning("ztriton partition: staging of %.1f MiB did not fit on every rank; halving", smallest / policy.MiB)
        recv = rows = None
        chunk_bytes = smallest // 2


def _fill_scattered(buffer: torch.Tensor, entries: list[_Entry], rank: int, world: int, group, chunk_bytes: int) -> None:
    """Rank 0 scatters every rank's slices, one window of the per-rank buffer at a time."""
    comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    itemsize = buffer.element_size()
    src_rank = dist.get_global_rank(group, 0) if group is not None else 0
    chunk_elems, staging, recv_stage = _staging(rank, world, group, chunk_bytes, buffer, comm)
    for done, (begin, end) in enumerate(_windows(buffer.numel(), chunk_elems)):
        n = end - begin
        rows = None
        if rank == 0:
            rows = [staging[r, :n] for r in range(world)]
            for r, row in enumerate(rows):
                _fill(row, _window_pieces(entries, r, begin, end), chunk_elems)
        recv = buffer[begin:end] if recv_stage is None else recv_stage[:n]
        dist.scatter(recv, scatter_list=rows, src=src_rank, group=group)
        if recv_stage is not None:
            buffer[begin:end].copy_(recv)
        _progress(done, buffer.numel(), chunk_elems, itemsize)
    _synchronize(buffer)


def _progress(window: int, total: int, chunk_elems: int, itemsize: int) -> None:
    windows = -(-total // chunk_elems)
    if windows >= 20 and (window + 1) % (windows // 10) == 0:
        logger.info("ztriton partition: %d%% of %.2f GiB", 100 * (window + 1) // windows, total * itemsize / policy.GiB)


def _synchronize(buffer: torch.Tensor) -> None:
    """Non-blocking host copies must land before the sources may change."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
