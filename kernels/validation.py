"""Every check of a copy, before any byte is written (:func:`validate`), and the pieces' facts it gathers on the
way (:class:`Sources`), which planning then reads instead of the tensors.

The common case (contiguous sources of dst's dtype, plain int ranges, or a pack's columns) is read one attribute
over all sources at a time; anything else one piece at a time, which also names the culprit of an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch

from .checks import as_index, as_sequence, as_zero_ranges, byte_extent, check_disjoint, check_dst, check_tensor, \
    each, each_int64, first_true, int64_column, merged_dims, show, within_index_limit
from .pieces import PackPieces, Piece, known_disjoint

__all__ = ["Sources", "validate"]

_DTYPE, _LAYOUT, _DEVICE = attrgetter("dtype"), attrgetter("layout"), attrgetter("device")


@dataclass
class Sources:
    """Per-piece facts gathered in one pass, as int64 columns for vectorised checks and planning.

    Host-side arrays are numpy: torch's CPU sort and scans on a few thousand elements pay for their
    threading, numpy's do not.
    """

    start: np.ndarray
    count: np.ndarray
    offset: np.ndarray
    numel: np.ndarray
    lo: np.ndarray  # first byte the source view touches
    hi: np.ndarray  # one past its last byte
    contiguous: np.ndarray
    local: np.ndarray  # on dst's device (only those can overlap dst in memory)


def validate(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
             same_device: bool = True, what: str = "sources") -> tuple[Sources, np.ndarray]:
    """Every check of a copy, before any byte is written: ``dst`` a contiguous dense tensor, each piece's
    types, dtype (and, with ``same_device``, device), ranges inside their tensors, no source memory
    inside ``dst``, no two destination ranges overlapping. ``what`` names the pieces in errors (the
    caller's argument). Returns the pieces' facts and the zero ranges as an ``[n, 2]`` array."""
    check_dst(dst)
    pieces = as_sequence(what, pieces)
    srcs = _gather_sources(pieces, dst, same_device, what)
    _check_ranges(srcs, dst, what)
    zeros = as_zero_ranges(zero_ranges, dst)
    if known_disjoint(pieces, zeros):
        return srcs, zeros
    n = len(pieces)
    check_disjoint(np.concatenate([srcs.offset, zeros[:, 0]]), np.concatenate([srcs.offset + srcs.count, zeros.sum(1)]),
                   lambda k: f"{what}[{k}]" if k < n else "a pad range")
    return srcs, zeros


def _gather_sources(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool, what: str) -> Sources:
    """Check each piece's types, dtype and (if ``same_device``) device, and collect its sizes and memory extent."""
    common = _gather_common(pieces, dst, same_device)
    return common if common is not None else _gather_each(pieces, dst, same_device, what)


def _gather_common(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool) -> Sources | None:
    """:func:`_gather_sources` for pieces that are all ``(contiguous tensor of dst's dtype, int, int, int)``
    on a device that holds values, one attribute of every source per comprehension; None for anything else
    (checked and named by :func:`_gather_each`)."""
    if not pieces or dst.dtype.is_complex:
        return None
    if isinstance(pieces, PackPieces):  # sources checked to be tensors, ranges integers (pack_pieces)
        srcs = pieces.sources
        kinds = set(map(type, srcs))
        ranges = np.stack([pieces.start, pieces.count, pieces.offset])
    else:
        if not all(isinstance(p, tuple) and len(p) == 4 for p in pieces):
            return None
        srcs, starts, counts, offsets = zip(*pieces)
        kinds = set(map(type, srcs))
        if not all(issubclass(kind, torch.Tensor) for kind in kinds) or \
                {type(v) for v in starts + counts + offsets} != {int}:
            return None
        ranges = None
    # One attribute of every source per pass, each a C call mapped over the list: thousands of sources per plan.
    if set(map(_DTYPE, srcs)) != {dst.dtype} or set(map(_LAYOUT, srcs)) != {torch.strided}:
        return None
    devices = set(map(_DEVICE, srcs))
    if any(d.type == "meta" for d in devices) or (same_device and devices != {dst.device}):
        return None
    if not all(each("is_contiguous", srcs, kinds)) or any(each("is_neg", srcs, kinds)):
        return None
    if ranges is None:
        try:
            ranges = np.array((starts, counts, offsets), dtype=np.int64)
        except OverflowError:
            return None
        if not within_index_limit(ranges):
            return None
    local = np.ones(len(srcs), dtype=bool) if devices == {dst.device} else \
        np.array([s.device == dst.device for s in srcs], dtype=bool)
    numel = pieces.numel if isinstance(pieces, PackPieces) else each_int64("numel", srcs, kinds)
    lo = each_int64("data_ptr", srcs, kinds)
    return Sources(*ranges, numel, lo, lo + numel * dst.element_size(), contiguous=np.ones(len(srcs), dtype=bool),
                   local=local)


def _gather_each(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool, what: str) -> Sources:
    """:func:`_gather_sources` one piece at a time: any kind of piece, and the error naming the first bad one."""
    dtype, device, itemsize = dst.dtype, dst.device, dst.element_size()
    conj_possible = dtype.is_complex
    rows, contiguous, local = [], [], []
    for i, piece in enumerate(pieces):
        if not isinstance(piece, tuple) or len(piece) != 4:
            raise TypeError(f"{what}[{i}] must be a Piece (src, start, count, offset), got {show(piece)}")
        src, start, count, offset = piece
        if not isinstance(src, torch.Tensor) or src.layout is not torch.strided:
            check_tensor(f"{what}[{i}]", src)
        if src.dtype != dtype:
            raise TypeError(f"{what}[{i}] has dtype {src.dtype} but dst has dtype {dtype}; "
                            "kernels move bits and never convert: cast the source first")
        if conj_possible or src.is_neg():  # a lazy negation (x.conj().imag): its memory holds -x
            check_tensor(f"{what}[{i}]", src)
        src_device = src.device
        on_dst = src_device == device
        if not on_dst:
            if src_device.type == "meta":
                check_tensor(f"{what}[{i}]", src)
            if same_device:
                raise ValueError(f"{what}[{i}] is on {src_device} but dst is on {device}; "
                                 "move one of them so both are on the same device")
        if type(start) is not int:
            start = as_index(f"{what}[{i}] start", start)
        if type(count) is not int:
            count = as_index(f"{what}[{i}] count", count)
        if type(offset) is not int:
            offset = as_index(f"{what}[{i}] offset", offset)
        numel = src.numel()
        dense = src.is_contiguous()
        if dense:
            lo = src.data_ptr()
            hi = lo + numel * itemsize
        else:
            lo, hi = byte_extent(src)
            sizes, strides = merged_dims(src)
            dense = len(sizes) == 1 and strides[0] == 1
        rows += (start, count, offset, numel, lo, hi)
        contiguous.append(dense)
        local.append(on_dst)
    columns = int64_column(rows, lambda k: f"{what}[{k // 6}] (start, count, offset)").reshape(-1, 6).T
    return Sources(*columns, contiguous=np.array(contiguous, dtype=bool), local=np.array(local, dtype=bool))


def _check_ranges(srcs: Sources, dst: torch.Tensor, what: str) -> None:
    """Source ranges inside their sources, destination ranges inside dst, no source memory in dst."""
    end = srcs.start + srcs.count
    dst_lo, dst_hi = byte_extent(dst)
    outside = (srcs.start < 0) | (srcs.count < 0) | (end > srcs.numel)
    misplaced = (srcs.offset < 0) | (srcs.offset + srcs.count > dst.numel())
    inside_dst = srcs.local & (srcs.count > 0) & (srcs.lo < dst_hi) & (srcs.hi > dst_lo)
    if not (outside | misplaced | inside_dst).any():  # the common case: one test, then each culprit's own
        return
    i = first_true(outside)
    if i is not None:
        raise ValueError(f"{what}[{i}]: start={int(srcs.start[i])}, count={int(srcs.count[i])}: range "
                         f"[{int(srcs.start[i])}, {int(end[i])}) is outside its {int(srcs.numel[i])} elements")
    i = first_true(misplaced)
    if i is not None:
        raise ValueError(f"{what}[{i}]: offset={int(srcs.offset[i])}, count={int(srcs.count[i])}: destination range "
                         f"[{int(srcs.offset[i])}, {int(srcs.offset[i] + srcs.count[i])}) does not fit in dst of "
                         f"{dst.numel()} elements")
    i = first_true(inside_dst)
    if i is not None:
        raise ValueError(f"{what}[{i}] overlaps dst in memory (source bytes [{int(srcs.lo[i]):#x}, "
                         f"{int(srcs.hi[i]):#x}), dst bytes [{dst_lo:#x}, {dst_hi:#x})); copy from a separate buffer")
