"""Replaying a :class:`~.record.Record`: one rank's elements, or the whole tensor.

* CUDA (:func:`replay` of a cuda record): the window method. Every random op's elements ``[a, b)`` are
  generated straight into the destination where windows align, through a scratch of at most one
  period (``4 * SMs * maxThreadsPerSM`` elements) at the edges; elementwise ops run on the slice. Device
  memory: the destination plus that scratch (plus a chunk when the destination is elsewhere or casts
  intervene).
* CPU (the generator is serial): the whole tensor is replayed, one record at a time, and the slice kept.

Either way every generator a record used is put back as it was: recording already moved it where the
full calls would have left it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ztriton.sharded_init import philox, rng
from ztriton.sharded_init.record import CompositeOp, FillOp, RandomOp, Record, empty

__all__ = ["agree", "materialise", "replay"]

DEFAULT_CHUNK_BYTES = 8 << 20


@contextlib.contextmanager
def _generators_kept(record: Record) -> Iterator[None]:
    """Every generator the record draws from is left as it was found."""
    saved = {}
    for _, op in record.random_ops():
        if id(op.generator) not in saved:
            saved[id(op.generator)] = (op.generator, rng.capture(op.generator))
    try:
        yield
    finally:
        for generator, state in saved.values():
            rng.restore(generator, state)


def _check_out(record: Record, out: torch.Tensor, start: int, count: int) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D tensor (the rank's partition), got "
                         f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
    if out.dtype != record.dtype:
        raise ValueError(f"out is {out.dtype} but {record.describe()} is {record.dtype}; pass a partition of that dtype")
    if out.numel() != count:
        raise ValueError(f"out holds {out.numel()} elements but count is {count}")
    if start < 0 or count < 0:
        raise ValueError(f"start ({start}) and count ({count}) must be >= 0")
    if out.device.type == "meta":
        raise ValueError("out is on the meta device and can hold no values")


def replay(record: Record, out: torch.Tensor, start: int, count: int, *,
           chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Write elements ``[start, start + count)`` of the tensor the record stands for into ``out``.

    ``out`` is the rank's 1-D partition (``count`` elements, the record's dtype, any device); the part
    past the tensor's last element is padding and is zeroed. Values are bit-identical to running the
    recorded calls on a full tensor of the record's dtype on its device; generators are left as they
    were. ``chunk_bytes`` bounds the scratch used when ``out`` is not on the record's device.
    """
    _check_out(record, out, start, count)
    begin, end = min(start, record.numel), min(start + count, record.numel)
    valid = end - begin
    if valid > 0:
        target = out.narrow(0, 0, valid)
        if record.materialised:
            target.copy_(record.real.reshape(-1).narrow(0, begin, valid))
        elif record.device.type == "cuda":
            with _generators_kept(record):
                _replay_range(record, target, begin, end, max(1, chunk_bytes // out.element_size()))
        else:
            full = materialise(record)
            target.copy_(full.view(-1).narrow(0, begin, valid))
            del full
    if valid < count:
        out.narrow(0, valid, count - valid).zero_()


def materialise(record: Record, device: torch.device | str | None = None) -> torch.Tensor:
    """The full tensor the record stands for, on ``device`` (default: the record's own). On the record's
    device this is what running the calls gives; elsewhere it is filled by :func:`replay` chunk by chunk."""
    device = record.device if device is None else torch.device(device)
    if record.materialised:
        return record.real.to(device)
    if device != record.device:
        full = empty(record.shape, record.dtype, device)
        replay(record, full.view(-1), 0, record.numel)
        return full
    dtype, ops = record.effective_ops()
    full = _VF_zeros(record.shape, dtype, device)
    with _generators_kept(record):
        for op in ops:
            full = op.run_full(full)
    return full


def _VF_zeros(shape, dtype, device) -> torch.Tensor:
    return torch._C._VariableFunctions.zeros(shape, dtype=dtype, device=device)


# ---- CUDA windows


class CudaDraws:
    """Draws of a recorded CUDA random op at a chosen philox offset (tests put a model in its place)."""

    def geometry(self, device: torch.device) -> philox.Geometry:
        return philox.Geometry.of(device)

    def fill(self, op: RandomOp, target: torch.Tensor, offset: int) -> None:
        rng.restore(op.generator, op.start.advanced(offset))
        op.run(target)

    def state(self, op: RandomOp) -> rng.PhiloxState:
        """The op's generator's state now: after a fill, where that call left it."""
        return rng.capture(op.generator)


def generate_range(op: RandomOp, numel: int, dst: torch.Tensor, begin: int, end: int,
                   draws: CudaDraws | None = None, longest: int | None = None, limit: int = philox.INT32_MAX) -> None:
    """Elements ``[begin, end)`` of ``op`` run on a tensor of ``numel`` elements, into ``dst`` (``end -
    begin`` contiguous elements of the op's dtype on the op's device)."""
    draws = draws or CudaDraws()
    geometry = draws.geometry(dst.device)
    unroll, itemsize = philox.unroll(op.dtype), dst.element_size()
    _, pieces = philox.call_layout(numel, itemsize, geometry, unroll, limit)
    for w in philox.windows(pieces, begin, end, geometry, unroll, itemsize, longest, limit):
        keep = dst.narrow(0, w.keep_start - begin, w.keep_end - w.keep_start)
        if w.exact:
            draws.fill(op, keep, w.offset)
        else:
            scratch = empty((w.length,), op.dtype, dst.device)
            draws.fill(op, scratch, w.offset)
            keep.copy_(scratch.narrow(0, w.keep_start - w.start, w.keep_end - w.keep_start))


def _replay_range(record: Record, dst: torch.Tensor, begin: int, end: int, chunk_elems: int,
                  draws: CudaDraws | None = None) -> None:
    dtype, ops = record.effective_ops()
    if any(isinstance(op, CompositeOp) for op in ops):
        raise NotImplementedError(f"{record.describe()}: composite ops replay on the CPU only")
    in_place = dst.device == record.device and dtype == dst.dtype and all(op.dtype == dtype for op in ops)
    if in_place:  # straight into the destination: no scratch beyond the window edges
        _first_values(record, ops, dst, begin, end, draws)
        for op in ops[1:] if ops and ops[0].overwrites else ops:
            op.run(dst)
        return
    for lo in range(begin, end, chunk_elems):
        hi = min(end, lo + chunk_elems)
        values = empty((hi - lo,), dtype, record.device)
        _first_values(record, ops, values, lo, hi, draws)
        for op in ops[1:] if ops and ops[0].overwrites else ops:
            values = op.run(values)
        dst.narrow(0, lo - begin, hi - lo).copy_(values)


def _first_values(record: Record, ops: list, dst: torch.Tensor, begin: int, end: int, draws) -> None:
    """Elements ``[begin, end)`` after the first effective op (zeros where none overwrites)."""
    first = ops[0] if ops and ops[0].overwrites else None
    if isinstance(first, RandomOp):
        generate_range(first, record.numel, dst, begin, end, draws)
    elif isinstance(first, FillOp):
        first.run(dst)
    else:
        dst.zero_()


# ---- agreement on rank 0's generator states


def agree(records: list[Record], group: dist.ProcessGroup | None = None) -> None:
    """Make every random op of ``records`` replay from group rank 0's generator state.

    DeepSpeed broadcasts rank 0's tensor, so its values come from rank 0's generator; each rank's own
    generator keeps its own state (recording advanced it as the full calls would have). One broadcast
    of the states (16 bytes per CUDA op, 5 KB per CPU op). Every rank must pass the same records in
    the same order. A world of one, or torch's fake process group, leaves the states as they are.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if dist.get_backend(group) == "fake":
        return
    entries = [(record, i, op) for record in records for i, op in record.random_ops()]
    if not entries:
        return
    encoded = [op.start.encode() for _, _, op in entries]
    sizes = [e.numel() for e in encoded]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    payload = torch.cat(encoded).to(device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(payload, src=src, group=group)
    payload = payload.cpu()
    offset = 0
    for (record, index, op), size in zip(entries, sizes):
        record.with_start(index, type(op.start).decode(payload[offset:offset + size]))
        offset += size
