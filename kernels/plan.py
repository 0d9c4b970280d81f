"""Planning the copies: validation, pieces -> launch tables, :class:`Plan` and :class:`Tuning`.

Everything reduces to one plan: a list of *pieces* (elements ``[start, start + count)`` of a
source's row-major flattening go to ``dst[offset : offset + count]``; see ``docs/architecture.md``,
"Vocabulary") and a list of zero ranges of ``dst``. Pieces whose source range is contiguous in memory
become byte segments, cut into rows of the word-copy table by alignment class (16-byte words when
source and destination agree modulo 16, narrower words otherwise); strided pieces become tiles of
the gather table. A plan costs at most one launch per alignment class plus one gather launch,
whatever the number of tensors.

All sizes are element counts and all offsets int64; nothing here knows about ZeRO.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton.language as tl

from .copy import DESC_HEAD, DESC_ROW, MAX_DIMS, _copy_words_kernel, _gather_tile_kernel

__all__ = ["Piece", "Plan", "Tuning", "byte_extent", "check_dst", "make_plan", "pack_pieces", "run_plan",
           "slices_to_pieces", "uncovered", "validate"]

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


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that a view touches (empty views touch nothing)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def check_dst(dst: torch.Tensor) -> None:
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"dst must be a torch.Tensor, got {type(dst).__name__}")
    if not dst.is_contiguous():
        raise ValueError(f"dst must be contiguous (shape {tuple(dst.shape)}, strides {dst.stride()}); "
                         "pass a contiguous buffer or a contiguous view of one")


@dataclass
class _Sources:
    """Per-piece facts gathered in one pass, as int64 columns for vectorised checks and planning.

    Host-side arrays are numpy: torch's CPU sort and scans on a few thousand elements pay for
    their threading (tens of milliseconds on a 2-core machine), numpy's take microseconds.
    """

    start: np.ndarray
    count: np.ndarray
    offset: np.ndarray
    numel: np.ndarray
    lo: np.ndarray  # first byte the source view touches
    hi: np.ndarray  # one past its last byte
    contiguous: np.ndarray
    local: np.ndarray  # on dst's device (only those can overlap dst in memory)


def _gather_sources(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool) -> _Sources:
    """Check each piece's type, dtype and (if ``same_device``) device, and collect its sizes and memory extent."""
    columns = [[] for _ in range(6)]
    contiguous, local = [], []
    for i, piece in enumerate(pieces):
        src = piece.src
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"sources[{i}] must be a torch.Tensor, got {type(src).__name__}")
        if src.dtype != dst.dtype:
            raise TypeError(f"sources[{i}] has dtype {src.dtype} but dst has dtype {dst.dtype}; "
                            "kernels move bits and never convert: cast the source first")
        if same_device and src.device != dst.device:
            raise ValueError(f"sources[{i}] is on {src.device} but dst is on {dst.device}; "
                             "move one of them so both are on the same device")
        dense = src.is_contiguous()
        if dense:
            lo = src.data_ptr()
            hi = lo + src.numel() * src.element_size()
        else:
            lo, hi = byte_extent(src)
            sizes, strides = _merged_dims(src)
            dense = len(sizes) == 1 and strides[0] == 1
        for column, value in zip(columns, (piece.start, piece.count, piece.offset, src.numel(), lo, hi)):
            column.append(value)
        contiguous.append(dense)
        local.append(src.device == dst.device)
    arrays = [np.array(c, dtype=np.int64) for c in columns]
    return _Sources(*arrays, contiguous=np.array(contiguous, dtype=bool), local=np.array(local, dtype=bool))


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def _check_ranges(srcs: _Sources, dst: torch.Tensor) -> None:
    """Source ranges inside their sources, destination ranges inside dst, no source memory in dst."""
    end = srcs.start + srcs.count
    i = _first((srcs.start < 0) | (srcs.count < 0) | (end > srcs.numel))
    if i is not None:
        raise ValueError(f"sources[{i}]: range [{int(srcs.start[i])}, {int(end[i])}) is outside its "
                         f"{int(srcs.numel[i])} elements")
    i = _first((srcs.offset < 0) | (srcs.offset + srcs.count > dst.numel()))
    if i is not None:
        raise ValueError(f"sources[{i}]: destination range [{int(srcs.offset[i])}, "
                         f"{int(srcs.offset[i] + srcs.count[i])}) does not fit in dst of {dst.numel()} elements")
    dst_lo, dst_hi = byte_extent(dst)
    i = _first(srcs.local & (srcs.count > 0) & (srcs.lo < dst_hi) & (srcs.hi > dst_lo))
    if i is not None:
        raise ValueError(f"sources[{i}] overlaps dst in memory (source bytes [{int(srcs.lo[i]):#x}, "
                         f"{int(srcs.hi[i]):#x}), dst bytes [{dst_lo:#x}, {dst_hi:#x})); copy from a separate buffer")


def _check_disjoint(begin: np.ndarray, end: np.ndarray, names) -> None:
    """Destination ranges must not overlap, or the result would depend on the order of writes.

    ``names(k)`` names range k in an error. Empty ranges overlap nothing.
    """
    keep = np.flatnonzero(end > begin)
    if len(keep) < 2:
        return
    order = keep[np.argsort(begin[keep], kind="stable")]
    reach = np.maximum.accumulate(end[order])
    k = _first(begin[order][1:] < reach[:-1])
    if k is not None:
        a, b = int(order[np.argmax(end[order][:k + 1])]), int(order[k + 1])
        raise ValueError(f"{names(a)} (dst [{int(begin[a])}, {int(end[a])})) and {names(b)} "
                         f"(dst [{int(begin[b])}, {int(end[b])})) overlap in dst")


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


def _word_unit(*values: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides every value."""
    unit = 16
    while unit > 1 and any(v % unit for v in values):
        unit //= 2
    return unit


def _units(values: np.ndarray) -> np.ndarray:
    """Per element, the widest word (16, 8, 4, 2 or 1 bytes) dividing it: its lowest set bit, capped."""
    low = values & -values
    return np.where((low == 0) | (low > 16), 16, low)


def _split_by_unit(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, base: int) -> dict:
    """Cut byte segments ``(src, dst, nbytes)`` into parts of one word class each: ``{unit: (s, d, n)}``.

    Source and destination can share a 16-byte phase only if their difference is a multiple of 16;
    the head up to the first aligned destination byte and the tail after the last whole word go to
    narrower classes. ``src == 0`` is a zero fill, which only the destination constrains. The kernel
    addresses dst in words from ``base``, so a word may not be wider than base's alignment.
    """
    zero = src == 0
    phase = _units(np.where(zero, base, (src - dst) | base))
    head = np.minimum(nbytes, np.remainder(-dst, phase))
    body = (nbytes - head) // phase * phase
    classes: dict[int, list] = {}
    for skip, length in ((0, head), (head, body), (head + body, nbytes - head - body)):
        s = np.where(zero, 0, src + skip)
        d = dst + skip
        unit = _units(np.where(zero, d, s) | d | length | base)
        for u in np.unique(unit[length > 0]).tolist():
            sel = (length > 0) & (unit == u)
            classes.setdefault(u, []).append((s[sel], d[sel], length[sel]))
    return {u: tuple(np.concatenate(cols) for cols in zip(*parts)) for u, parts in classes.items()}


def _word_parts(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, unit: int, base: int,
                chunk_words: int) -> tuple[torch.Tensor, int]:
    """One int64 table: rows ``[src_addr, dst word offset, words]``, then the prefix sum of the
    programs (chunks of ``chunk_words``) each row needs; and the total number of programs."""
    word = _word_bytes(unit)
    words = nbytes // word
    chunks = (words + chunk_words - 1) // chunk_words
    first = np.zeros(len(src) + 1, dtype=np.int64)
    np.cumsum(chunks, out=first[1:])
    rows = np.stack([src, (dst - base) // word, words], axis=1).reshape(-1)
    return torch.from_numpy(np.concatenate([rows, first])), int(first[-1])


def _word_bytes(unit: int) -> int:
    """The integer a word class moves: 16-byte words travel as pairs of int64."""
    return 8 if unit == 16 else unit


def _strided_descriptor(piece: Piece, dst_first: int, tile_p: int, tile_c: int) -> tuple[list[int], int]:
    """The gather descriptor of a strided piece (copy.DESC_ROW) and its number of tiles.

    ``dst_first`` is dst's element offset in its storage. Dims are reordered to (outer..., p, c);
    only the outer indices whose tiles can hold an element of ``[start, start + count)`` are kept.
    """
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
    sizes, strides, weights = ([v[d] for d in order] for v in (sizes, strides, weights))

    p_blocks, c_blocks = -(-sizes[-2] // tile_p), -(-sizes[-1] // tile_c)
    n_outer = 1
    for size in sizes[:-2]:
        n_outer *= size
    end = piece.start + piece.count

    # Tiles are enumerated as (row, c block), a row being (outer index, p block). Flat indices grow
    # with the outer index (mixed radix over dims kept in row-major order) and, when p is the
    # innermost dim but c, with the row too; so the rows that meet [start, end) form one range,
    # found by bisection.
    def flat_off(outer: int) -> int:
        off = 0
        for d in range(MAX_DIMS - 3, -1, -1):
            outer, coord = divmod(outer, sizes[d])
            off += coord * weights[d]
        return off

    def row_bounds(row: int) -> tuple[int, int]:
        """Smallest and largest flat index of a row of tiles (of the whole outer slice if p moved)."""
        if p_dim != MAX_DIMS - 2:
            base = flat_off(row // p_blocks)
            return base, base + (sizes[-2] - 1) * weights[-2] + sizes[-1] - 1
        outer, block = divmod(row, p_blocks)
        base = flat_off(outer) + block * tile_p * weights[-2]
        rows_in_block = min(tile_p, sizes[-2] - block * tile_p)
        return base, base + (rows_in_block - 1) * weights[-2] + sizes[-1] - 1

    def first_row(pred) -> int:
        lo, hi = 0, n_outer * p_blocks
        while lo < hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    row_lo = first_row(lambda r: row_bounds(r)[1] >= piece.start)
    row_hi = first_row(lambda r: row_bounds(r)[0] >= end)
    if p_dim != MAX_DIMS - 2:  # bounds hold per outer slice: keep whole slices
        row_lo, row_hi = row_lo // p_blocks * p_blocks, -(-row_hi // p_blocks) * p_blocks
    head = [piece.src.data_ptr(), dst_first + piece.offset - piece.start, piece.start, end, row_lo,
            p_blocks, c_blocks]
    return head + sizes + strides + weights, max(0, row_hi - row_lo) * c_blocks


def _tile_class(desc: list[int], dst: torch.Tensor, tile_p: int, tile_c: int) -> tuple:
    """(P_UNIT, C_UNIT, SRC_ALIGN, DST_ALIGN, SIZE_ALIGN, SMALL): the promises _gather_tile_kernel
    relies on for one strided piece.

    Each alignment is the widest power of two (at most 16 bytes' worth of elements) dividing the
    offsets of its side: source address and non-unit strides; where flat index 0 lands in dst and
    the flat weights; the sizes of p and c. SMALL: every offset inside a tile fits in int32.
    """
    itemsize = dst.element_size()
    sizes = desc[DESC_HEAD:DESC_HEAD + MAX_DIMS]
    strides = desc[DESC_HEAD + MAX_DIMS:DESC_HEAD + 2 * MAX_DIMS]
    weights = desc[DESC_HEAD + 2 * MAX_DIMS:]

    def align(values) -> int:
        return max(1, _word_unit(*(v * itemsize for v in values)) // itemsize)

    src_align = align([desc[0] // itemsize] + [s for d, s in enumerate(strides) if s != 1 and sizes[d] > 1])
    dst_align = align([dst.untyped_storage().data_ptr() // itemsize + desc[1]]
                      + [w for d, w in enumerate(weights[:-1]) if sizes[d] > 1])
    size_align = align([sizes[-2], sizes[-1]])
    small = max(tile_p * abs(strides[-2]) + tile_c * abs(strides[-1]), tile_p * weights[-2] + tile_c) < 2**31
    return strides[-2] == 1, strides[-1] == 1, src_align, dst_align, size_align, small


@dataclass(frozen=True)
class Tuning:
    """Launch parameters: bytes a word-copy program moves per loop step and in all, its warps and
    whether it streams; the gather's tile (elements along dim p and along the last dim), its warps."""

    # Chosen from bench/results/kernels_h200_sweep.json (H200): the best worst case over a 1 GiB copy,
    # the 2,000-tensor pack, its 1/8 window and the LLM mix; 128 x 128 tiles for a transposed source.
    step_bytes: int = 32 * 1024
    chunk_bytes: int = 32 * 1024
    num_warps: int = 2
    stream: bool = False
    tile_p: int = 128
    tile_c: int = 128
    tile_warps: int = 4


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


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Upload a host-built table without making the host wait for the device's queue.

    A pageable copy would block until all earlier work on the stream is done; a pinned one is
    queued like a kernel (torch's pinned-memory cache keeps the buffer until the copy has run).
    """
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def validate(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
             same_device: bool = True) -> tuple[_Sources, np.ndarray]:
    """Every check of a copy, before any byte is written: ``dst`` contiguous, each piece's dtype (and,
    with ``same_device``, device), ranges inside their tensors, no source memory inside ``dst``, no two
    destination ranges overlapping. Returns the pieces' facts and the zero ranges as an ``[n, 2]`` array."""
    check_dst(dst)
    srcs = _gather_sources(pieces, dst, same_device)
    _check_ranges(srcs, dst)
    zeros = np.array(list(zero_ranges), dtype=np.int64).reshape(-1, 2)
    i = _first((zeros[:, 0] < 0) | (zeros[:, 1] < 0) | (zeros.sum(1) > dst.numel()))
    if i is not None:
        o, c = zero_ranges[i]
        raise ValueError(f"zero range [{o}, {o + c}) does not fit in dst of {dst.numel()} elements")
    n = len(pieces)
    _check_disjoint(np.concatenate([srcs.offset, zeros[:, 0]]), np.concatenate([srcs.offset + srcs.count, zeros.sum(1)]),
                    lambda k: f"sources[{k}]" if k < n else "a pad range")
    return srcs, zeros


def make_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              tuning: Tuning = Tuning()) -> Plan:
    """Validate, then build the launches that copy every piece into ``dst`` and zero ``zero_ranges``.

    ``zero_ranges`` are ``(offset, count)`` in elements of dst. On any error nothing is written.
    """
    srcs, zeros = validate(dst, pieces, zero_ranges)

    itemsize = dst.element_size()
    # Kernels address dst from the start of its storage, which the allocator aligns, so that an
    # offset view of a buffer still gets 16-byte words wherever its elements allow them.
    storage = torch.empty(0, dtype=torch.uint8, device=dst.device).set_(dst.untyped_storage())
    base = storage.data_ptr()
    dense = srcs.contiguous & (srcs.count > 0)
    segments = (
        np.concatenate([(srcs.lo + srcs.start * itemsize)[dense], np.zeros(len(zeros), dtype=np.int64)]),
        np.concatenate([srcs.offset[dense], zeros[:, 0]]) * itemsize + dst.data_ptr(),
        np.concatenate([srcs.count[dense], zeros[:, 1]]) * itemsize,
    )
    launches = []
    for unit, (s, d, nbytes) in sorted(_split_by_unit(*segments, base).items()):
        word = _word_bytes(unit)
        table, programs = _word_parts(s, d, nbytes, unit, base, tuning.chunk_bytes // word)
        table = _to_device(table, dst.device)
        launches.append((_copy_words_kernel, (programs,), (table, table[3 * len(s):], len(s), storage), dict(
            WORD=_WORD_DTYPES[unit], VEC=unit // word, BLOCK=tuning.step_bytes // word,
            CHUNK=tuning.chunk_bytes // word, STREAM=tuning.stream, num_warps=tuning.num_warps)))

    strided: dict[tuple, list[tuple[list[int], int]]] = {}
    for piece, is_dense in zip(pieces, srcs.contiguous):
        if not is_dense and piece.count:
            desc, tiles = _strided_descriptor(piece, dst.storage_offset(), tuning.tile_p, tuning.tile_c)
            if tiles:
                strided.setdefault(_tile_class(desc, dst, tuning.tile_p, tuning.tile_c), []).append((desc, tiles))
    for (p_unit, c_unit, src_align, dst_align, size_align, small), entries in sorted(strided.items()):
        tiles = torch.tensor([0] + [t for _, t in entries], dtype=torch.int64).cumsum(0)
        table = _to_device(torch.cat([torch.tensor([d for d, _ in entries], dtype=torch.int64).reshape(-1), tiles]),
                           dst.device)
        launches.append((_gather_tile_kernel, (int(tiles[-1]),),
                         (table, table[DESC_ROW * len(entries):], len(entries), storage), dict(
            WORD=_INT_FOR_ITEMSIZE[itemsize], MAX_DIMS=MAX_DIMS, DESC_HEAD=DESC_HEAD, BLOCK_P=tuning.tile_p,
            BLOCK_C=tuning.tile_c, P_UNIT=p_unit, C_UNIT=c_unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align,
            SIZE_ALIGN=size_align, SMALL=small,
            num_warps=tuning.tile_warps)))
    return Plan(launches, [dst, *(p.src for p in pieces)])


def run_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = ()) -> None:
    """Copy every piece into ``dst`` and write zeros over ``zero_ranges``: :func:`make_plan`, launched."""
    make_plan(dst, pieces, zero_ranges).launch()


def uncovered(covered: Sequence[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """``(offset, count)`` of the parts of ``[begin, end)`` that no ``(b, e)`` in ``covered`` holds."""
    gaps, cursor = [], begin
    for b, e in sorted(covered):
        if b > cursor:
            gaps.append((cursor, b - cursor))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end - cursor))
    return gaps


def slices_to_pieces(dst: torch.Tensor, slices: Sequence[tuple[torch.Tensor, int, int, int]]
                     ) -> tuple[list[Piece], list[tuple[int, int]]]:
    """``(src, start, count, offset)`` slices as pieces, and the ranges of ``dst`` they leave to zero."""
    check_dst(dst)
    pieces = [Piece(*s) for s in slices]
    return pieces, uncovered([(p.offset, p.offset + p.count) for p in pieces], 0, dst.numel())


def pack_pieces(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
                window: tuple[int, int] | None = None) -> tuple[list[Piece], list[tuple[int, int]]]:
    """The pieces and zero ranges of a pack: ``sources`` (flattened row-major) at element ``offsets``
    of a flat layout, zeros elsewhere; with ``window=(w0, w1)`` only elements ``[w0, w1)`` of that
    layout, written to ``dst[: w1 - w0]``. Checks the arguments of the pack itself; the pieces are
    checked by :func:`validate`."""
    check_dst(dst)
    if len(sources) != len(offsets):
        raise ValueError(f"got {len(sources)} sources but {len(offsets)} offsets")
    w0, w1 = (0, dst.numel()) if window is None else window
    if not (0 <= w0 <= w1) or w1 - w0 > dst.numel():
        raise ValueError(f"window=({w0}, {w1}) must satisfy 0 <= w0 <= w1 and fit dst's {dst.numel()} elements")
    numels = []
    for i, src in enumerate(sources):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"sources[{i}] must be a torch.Tensor, got {type(src).__name__}")
        numels.append(src.numel())
    begin = np.array(list(offsets), dtype=np.int64)
    end = begin + np.array(numels, dtype=np.int64)
    i = _first(begin < 0)
    if i is not None:
        raise ValueError(f"offsets[{i}]={offsets[i]} is negative")
    i = _first(end > dst.numel()) if window is None else None
    if i is not None:
        raise ValueError(f"sources[{i}]: destination range [{int(begin[i])}, {int(end[i])}) does not "
                         f"fit in dst of {dst.numel()} elements")
    _check_disjoint(begin, end, lambda k: f"sources[{k}]")
    # Each source's part inside the window; sources outside it still get validated, as empty pieces.
    lo, hi = np.maximum(begin, w0), np.minimum(end, w1)
    inside = (lo < hi).tolist()
    pieces = [Piece(src, a - o, b - a, a - w0) if keep else Piece(src, 0, 0, 0)
              for src, o, a, b, keep in zip(sources, begin.tolist(), lo.tolist(), hi.tolist(), inside)]
    covered = [(p.offset, p.offset + p.count) for p, keep in zip(pieces, inside) if keep]
    return pieces, uncovered(covered, 0, w1 - w0)
