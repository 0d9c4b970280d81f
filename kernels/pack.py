"""Launch functions: strided chunk copy, multi-tensor pack and its window form.

Everything here reduces to one plan: a list of *pieces* (elements ``[start, start + count)`` of a
source's row-major flattening go to ``dst[offset : offset + count]``) and a list of zero ranges of
``dst``. Pieces whose source range is contiguous in memory become byte segments, cut into rows of
the word-copy table by alignment class (16-byte words when source and destination agree modulo 16,
narrower words otherwise); strided pieces become tiles of the gather table. A plan costs at most one
launch per alignment class plus one gather launch, whatever the number of tensors.

All sizes are element counts and all offsets int64; nothing here knows about ZeRO.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton.language as tl

from ztriton.kernels.copy import (
    MAX_DIMS,
    TILE_ROW,
    WORD_ROW,
    _copy_words_kernel,
    _gather_tile_kernel,
)

__all__ = ["Piece", "Plan", "Tuning", "copy_chunk", "make_plan", "pack", "pack_plan", "pack_slices", "run_plan"]

_TILE_P = 64
_TILE_C = 64
_WORD_DTYPES = {16: tl.int64, 8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
_INT_FOR_ITEMSIZE = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of ``src``'s row-major flattening go to ``dst[offset:]``."""

    src: torch.Tensor
    start: int
    count: int
    offset: int


# --------------------------------------------------------------------------------------------
# Validation: everything is checked before any byte is written.


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that a view touches (empty views touch nothing)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_dst(dst: torch.Tensor) -> None:
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"dst must be a torch.Tensor, got {type(dst).__name__}")
    if not dst.is_contiguous():
        raise ValueError(f"dst must be contiguous (shape {tuple(dst.shape)}, strides {dst.stride()}); "
                         "pass a contiguous buffer or a contiguous view of one")


def _check_piece(i: int, piece: Piece, dst: torch.Tensor, dst_extent: tuple[int, int]) -> None:
    src = piece.src
    name = f"sources[{i}]"
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(src).__name__}")
    if src.dtype != dst.dtype:
        raise TypeError(f"{name} has dtype {src.dtype} but dst has dtype {dst.dtype}; "
                        "kernels move bits and never convert: cast the source first")
    if src.device != dst.device:
        raise ValueError(f"{name} is on {src.device} but dst is on {dst.device}; "
                         "move one of them so both are on the same device")
    if piece.start < 0 or piece.count < 0 or piece.start + piece.count > src.numel():
        raise ValueError(f"{name}: range [{piece.start}, {piece.start + piece.count}) is outside its "
                         f"{src.numel()} elements")
    if piece.offset < 0 or piece.offset + piece.count > dst.numel():
        raise ValueError(f"{name}: destination range [{piece.offset}, {piece.offset + piece.count}) "
                         f"does not fit in dst of {dst.numel()} elements")
    lo, hi = _byte_extent(src)
    if piece.count and lo < dst_extent[1] and dst_extent[0] < hi:
        raise ValueError(f"{name} overlaps dst in memory (source bytes [{lo:#x}, {hi:#x}), dst bytes "
                         f"[{dst_extent[0]:#x}, {dst_extent[1]:#x})); copy from a separate buffer")


def _check_disjoint(ranges: list[tuple[int, int, str]]) -> None:
    """Destination ranges ``(begin, end, name)`` must not overlap: the result would depend on order."""
    ranges = sorted(r for r in ranges if r[1] > r[0])
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise ValueError(f"{n0} (dst [{b0}, {e0})) and {n1} (dst [{b1}, {e1})) overlap in dst")


# --------------------------------------------------------------------------------------------
# Planning: pieces -> word-copy rows and gather tiles.


def _merged_dims(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes and strides of ``t`` with size-1 dims dropped and dims contiguous together merged."""
    sizes, strides = [], []
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == size * stride:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    return sizes, strides


def _contiguous_address(piece: Piece) -> int | None:
    """Byte address of the piece's first element if its elements are contiguous in memory."""
    sizes, strides = _merged_dims(piece.src)
    if not sizes or strides[-1] == 1 and len(sizes) == 1:
        return piece.src.data_ptr() + piece.start * piece.src.element_size()
    return None


def _word_unit(*values: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides every value."""
    unit = 16
    while unit > 1 and any(v % unit for v in values):
        unit //= 2
    return unit


def _segment_rows(src_addr: int, dst_addr: int, nbytes: int, base: int,
                  rows: dict[int, list[tuple[int, int, int]]]) -> None:
    """Split one byte segment into (src, dst, nbytes) parts of one word class each.

    Source and destination can share a 16-byte phase only if their difference is a multiple of 16;
    the head up to the first aligned destination byte and the tail after the last whole word go to
    narrower classes. ``src_addr == 0`` is a zero fill, which only the destination constrains. The
    kernel addresses dst in words from ``base``, so a word may not be wider than base's alignment.
    """
    phase_unit = _word_unit(src_addr - dst_addr, base) if src_addr else _word_unit(base)
    head = min(nbytes, (-dst_addr) % phase_unit)
    body = (nbytes - head) // phase_unit * phase_unit
    parts = ((0, head), (head, body), (head + body, nbytes - head - body))
    for skip, length in parts:
        if length:
            s = src_addr + skip if src_addr else 0
            d = dst_addr + skip
            rows.setdefault(_word_unit(s or d, d, length, base), []).append((s, d, length))


def _word_table(parts: list[tuple[int, int, int]], unit: int, dst_addr: int, chunk_bytes: int) -> torch.Tensor:
    """Rows ``[src_addr, dst word offset, words]`` with each part cut into chunks of ``chunk_bytes``."""
    word = 8 if unit == 16 else unit
    src, dst, nbytes = torch.tensor(parts, dtype=torch.int64).unbind(1)
    chunks = (nbytes + chunk_bytes - 1) // chunk_bytes
    part = torch.repeat_interleave(torch.arange(len(parts)), chunks)
    first_chunk = torch.cumsum(chunks, 0) - chunks
    skip = (torch.arange(len(part)) - first_chunk[part]) * chunk_bytes
    length = torch.clamp(nbytes[part] - skip, max=chunk_bytes)
    src_col = torch.where(src[part] == 0, 0, src[part] + skip)
    dst_col = (dst[part] + skip - dst_addr) // word
    return torch.stack([src_col, dst_col, length // word], dim=1).contiguous()


def _strided_descriptor(piece: Piece, dst_first: int) -> list[int]:
    """The gather descriptor of a strided piece (copy.DESC_ROW); dst_first: dst's element offset in its storage."""
    sizes, strides = _merged_dims(piece.src)
    if len(sizes) > MAX_DIMS:
        raise ValueError(f"a source with {len(sizes)} non-mergeable dims exceeds the {MAX_DIMS} the "
                         f"kernels support (shape {tuple(piece.src.shape)}, strides {piece.src.stride()})")
    pad = MAX_DIMS - len(sizes)
    sizes, strides = [1] * pad + sizes, [0] * pad + strides
    weights = [1] * MAX_DIMS
    for d in range(MAX_DIMS - 2, -1, -1):
        weights[d] = weights[d + 1] * sizes[d + 1]
    # p: the dim before the last one, unless the last dim is not the densest in memory; then the
    # densest other dim, so that a tile of a transposed source reads whole cache lines.
    p_dim = MAX_DIMS - 2
    if strides[-1] != 1:
        candidates = [d for d in range(MAX_DIMS - 1) if sizes[d] > 1]
        if candidates:
            p_dim = min(candidates, key=lambda d: (strides[d], -d))
    order = [d for d in range(MAX_DIMS - 1) if d != p_dim] + [p_dim, MAX_DIMS - 1]
    return ([piece.src.data_ptr(), dst_first + piece.offset - piece.start] + [sizes[d] for d in order]
            + [strides[d] for d in order] + [weights[d] for d in order])


def _tile_class(desc: list[int], piece: Piece, dst: torch.Tensor) -> tuple[bool, bool, int]:
    """(P_UNIT, C_UNIT, ALIGN) of a strided piece: the promises _gather_tile_kernel relies on.

    ALIGN is the widest power of two (at most 16 bytes' worth of elements) dividing every offset
    the kernel forms outside the unit-stride walk: the source address, the strides that are not 1,
    the sizes and flat weights of p and c, the range bounds and where flat index 0 lands in dst.
    """
    itemsize = dst.element_size()
    sizes = desc[2:2 + MAX_DIMS]
    strides = desc[2 + MAX_DIMS:2 + 2 * MAX_DIMS]
    weights = desc[2 + 2 * MAX_DIMS:]
    values = [desc[0] // itemsize, dst.untyped_storage().data_ptr() // itemsize + desc[1], piece.start, piece.start + piece.count,
              sizes[-2], sizes[-1], weights[-2]]
    values += [s for d, s in enumerate(strides) if s != 1 and sizes[d] > 1]
    align = _word_unit(*(v * itemsize for v in values)) // itemsize
    return strides[-2] == 1, strides[-1] == 1, max(align, 1)


def _tile_rows(index: int, desc: list[int], piece: Piece) -> torch.Tensor:
    """Tile-table rows of the tiles of one strided piece that hold at least one of its elements."""
    sizes = desc[2:2 + MAX_DIMS]
    weights = desc[2 + 2 * MAX_DIMS:]
    n_outer = 1
    for size in sizes[:-2]:
        n_outer *= size
    p_blocks = -(-sizes[-2] // _TILE_P)
    c_blocks = -(-sizes[-1] // _TILE_C)
    tile = torch.arange(n_outer * p_blocks * c_blocks, dtype=torch.int64)
    outer, rest = tile // (p_blocks * c_blocks), tile % (p_blocks * c_blocks)
    p0, c0 = rest // c_blocks * _TILE_P, rest % c_blocks * _TILE_C

    # Flat index of each tile's first and last element, to drop tiles outside [start, end).
    flat_lo = torch.zeros_like(tile)
    rem = outer.clone()
    for d in range(MAX_DIMS - 3, -1, -1):
        flat_lo += rem % sizes[d] * weights[d]
        rem //= sizes[d]
    p1 = torch.clamp(p0 + _TILE_P, max=sizes[-2]) - 1
    c1 = torch.clamp(c0 + _TILE_C, max=sizes[-1]) - 1
    flat_hi = flat_lo + p1 * weights[-2] + c1
    flat_lo = flat_lo + p0 * weights[-2] + c0
    end = piece.start + piece.count
    keep = (flat_hi >= piece.start) & (flat_lo < end)
    n = int(keep.sum())
    return torch.stack([
        torch.full((n,), index, dtype=torch.int64), outer[keep], p0[keep], c0[keep],
        torch.full((n,), piece.start, dtype=torch.int64), torch.full((n,), end, dtype=torch.int64),
    ], dim=1)


@dataclass(frozen=True)
class Tuning:
    """Launch parameters: bytes a word-copy program moves per loop step and per table row, warps."""

    step_bytes: int = 16 * 1024
    chunk_bytes: int = 64 * 1024
    num_warps: int = 4


@dataclass
class Plan:
    """Launches that carry out one copy; reusable while its tensors stay where they are.

    It keeps the source tensors referenced: the tables name them only by address.
    """

    launches: list
    keep_alive: list

    def launch(self) -> None:
        for kernel, grid, args, kwargs in self.launches:
            kernel[grid](*args, **kwargs)


def _validate(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]]) -> None:
    _check_dst(dst)
    extent = _byte_extent(dst)
    for i, piece in enumerate(pieces):
        _check_piece(i, piece, dst, extent)
    for offset, count in zero_ranges:
        if offset < 0 or count < 0 or offset + count > dst.numel():
            raise ValueError(f"zero range [{offset}, {offset + count}) does not fit in dst of {dst.numel()} elements")
    _check_disjoint([(p.offset, p.offset + p.count, f"sources[{i}]") for i, p in enumerate(pieces)]
                    + [(o, o + c, "a pad range") for o, c in zero_ranges])


def make_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              tuning: Tuning = Tuning()) -> Plan:
    """Validate, then build the launches that copy every piece into ``dst`` and zero ``zero_ranges``.

    ``zero_ranges`` are ``(offset, count)`` in elements of dst. On any error nothing is written.
    """
    _validate(dst, pieces, zero_ranges)
    itemsize = dst.element_size()
    # Kernels address dst from the start of its storage, which the allocator aligns, so that an
    # offset view of a buffer still gets 16-byte words wherever its elements allow them.
    storage = torch.empty(0, dtype=torch.uint8, device=dst.device).set_(dst.untyped_storage())
    base = storage.data_ptr()
    first = dst.data_ptr()
    word_parts: dict[int, list[tuple[int, int, int]]] = {}
    descriptors, tiles = [], {}
    for piece in pieces:
        if piece.count == 0:
            continue
        address = _contiguous_address(piece)
        if address is not None:
            _segment_rows(address, first + piece.offset * itemsize, piece.count * itemsize, base, word_parts)
        else:
            desc = _strided_descriptor(piece, dst.storage_offset())
            rows = _tile_rows(len(descriptors), desc, piece)
            tiles.setdefault(_tile_class(desc, piece, dst), []).append(rows)
            descriptors.append(desc)
    for offset, count in zero_ranges:
        if count:
            _segment_rows(0, first + offset * itemsize, count * itemsize, base, word_parts)

    launches = []
    for unit, parts in sorted(word_parts.items()):
        table = _word_table(parts, unit, base, tuning.chunk_bytes).to(dst.device)
        word_bytes = 8 if unit == 16 else unit
        launches.append((_copy_words_kernel, (table.shape[0],), (table, storage), dict(
            WORD=_WORD_DTYPES[unit], VEC=unit // word_bytes, BLOCK=tuning.step_bytes // word_bytes,
            num_warps=tuning.num_warps)))
    if tiles:
        desc_table = torch.tensor(descriptors, dtype=torch.int64).to(dst.device)
    for (p_unit, c_unit, align), rows in sorted(tiles.items()):
        tile_table = torch.cat(rows).to(dst.device)
        if tile_table.shape[0]:
            launches.append((_gather_tile_kernel, (tile_table.shape[0],), (tile_table, desc_table, storage), dict(
                WORD=_INT_FOR_ITEMSIZE[itemsize], MAX_DIMS=MAX_DIMS, BLOCK_P=_TILE_P, BLOCK_C=_TILE_C,
                P_UNIT=p_unit, C_UNIT=c_unit, ALIGN=align, num_warps=4)))
    return Plan(launches, [dst, *(p.src for p in pieces)])


def run_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = ()) -> None:
    """Copy every piece into ``dst`` and write zeros over ``zero_ranges``: :func:`make_plan`, launched."""
    make_plan(dst, pieces, zero_ranges).launch()


# --------------------------------------------------------------------------------------------
# Public launch functions.


def copy_chunk(src: torch.Tensor, dst: torch.Tensor, start: int = 0, count: int | None = None) -> torch.Tensor:
    """Write elements ``[start, start + count)`` of ``src``'s row-major flattening into ``dst[:count]``.

    ``src`` may have any shape and strides (transposed, sliced, expanded, offset); it is read in
    place, never made contiguous. ``dst`` is contiguous, for example a view into a larger buffer;
    ``count`` defaults to ``dst.numel()``. Returns ``dst``.
    """
    _check_dst(dst)
    count = dst.numel() if count is None else count
    if count > dst.numel():
        raise ValueError(f"count={count} exceeds dst's {dst.numel()} elements")
    run_plan(dst, [Piece(src, start, count, 0)])
    return dst


def _gaps(covered: list[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """``(offset, count)`` of the parts of ``[begin, end)`` that no ``(b, e)`` in ``covered`` holds."""
    gaps, cursor = [], begin
    for b, e in sorted(covered):
        if b > cursor:
            gaps.append((cursor, b - cursor))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end - cursor))
    return gaps


def pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
         window: tuple[int, int] | None = None) -> torch.Tensor:
    """Lay ``sources`` (flattened row-major) at element ``offsets`` of a flat layout, zeros elsewhere.

    Without ``window`` the layout is ``dst`` itself. With ``window=(w0, w1)`` only elements
    ``[w0, w1)`` of the layout are written, into ``dst[: w1 - w0]``: one rank's partition of a
    flat buffer. Every element of the window is written exactly once. Returns ``dst``.
    """
    pack_plan(dst, sources, offsets, window).launch()
    return dst


def pack_plan(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
              window: tuple[int, int] | None = None, tuning: Tuning = Tuning()) -> Plan:
    """The :class:`Plan` of :func:`pack`, to launch later or again."""
    _check_dst(dst)
    if len(sources) != len(offsets):
        raise ValueError(f"got {len(sources)} sources but {len(offsets)} offsets")
    w0, w1 = (0, dst.numel()) if window is None else window
    if not (0 <= w0 <= w1) or w1 - w0 > dst.numel():
        raise ValueError(f"window=({w0}, {w1}) must satisfy 0 <= w0 <= w1 and fit dst's {dst.numel()} elements")
    pieces, covered = [], []
    for i, (src, offset) in enumerate(zip(sources, offsets)):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"sources[{i}] must be a torch.Tensor, got {type(src).__name__}")
        if offset < 0:
            raise ValueError(f"offsets[{i}]={offset} is negative")
        if window is None and offset + src.numel() > dst.numel():
            raise ValueError(f"sources[{i}]: destination range [{offset}, {offset + src.numel()}) does not "
                             f"fit in dst of {dst.numel()} elements")
        lo, hi = max(offset, w0), min(offset + src.numel(), w1)
        if lo < hi:
            pieces.append(Piece(src, lo - offset, hi - lo, lo - w0))
            covered.append((lo - w0, hi - w0))
        else:  # still validated, so that a bad source is reported whichever window is asked for
            pieces.append(Piece(src, 0, 0, 0))
    _check_disjoint([(o, o + s.numel(), f"sources[{i}]") for i, (s, o) in enumerate(zip(sources, offsets))])
    return make_plan(dst, pieces, _gaps(covered, 0, w1 - w0), tuning)


def pack_slices(dst: torch.Tensor, slices: Sequence[tuple[torch.Tensor, int, int, int]]) -> torch.Tensor:
    """Copy each ``(src, start, count, offset)`` slice into ``dst`` and zero everything else of ``dst``.

    For one rank's ZeRO-3 slices of many params into one per-rank buffer. Returns ``dst``.
    """
    _check_dst(dst)
    pieces = [Piece(*s) for s in slices]
    run_plan(dst, pieces, _gaps([(p.offset, p.offset + p.count) for p in pieces], 0, dst.numel()))
    return dst
