"""The kernels' route (:func:`kernel_plan`): pieces -> launch tables of the two jit kernels, uploaded in one copy.

Pieces whose source range is contiguous in memory become byte segments, cut into rows of the word-copy table
by alignment class (16-byte words when source and destination agree modulo 16, narrower words otherwise);
strided pieces become tiles of the gather table, one launch per tile class. A table holds a row per part plus
a prefix sum of the programs each part needs (``copy.py`` says how the kernels read it), so one launch serves
any number of tensors. All planning is numpy over columns: a flatten plans thousands of pieces per call.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from .checks import merged_dims
from .descriptor import DESC_HEAD, MAX_DIMS
from .launch import Plan, launch_stream
from .pieces import Piece
from .tuning import Tuning
from .validation import Sources
from .variants import GATHER, WORD_COPY, gather_meta, word_meta
from .words import units, word_unit

__all__ = ["kernel_plan"]


class _Call(NamedTuple):
    """One launch of a plan before its table is uploaded."""

    kernel: str  # the jit kernel's name (variants.WORD_COPY, variants.GATHER)
    grid: tuple
    table: np.ndarray  # host int64: its rows, then (from ``at``) each row's first program
    at: int
    rest: tuple  # the arguments after the table's two parts
    meta: dict  # the kernel's constexprs and launch options, plain values (variants.py)


def kernel_plan(dst: torch.Tensor, pieces: Sequence[Piece], srcs: Sources, zeros: np.ndarray, keep_alive: list,
                tuning: Tuning) -> Plan:
    """The plan that launches the kernels for validated ``pieces`` and ``zeros`` (imports nothing: each launch
    comes from the compiled cache or Triton's JIT, ``compiled.py``)."""
    # Kernels address dst from the start of its storage, which the allocator aligns, so that an
    # offset view of a buffer still gets 16-byte words wherever its elements allow them.
    storage = torch.empty(0, dtype=torch.uint8, device=dst.device).set_(dst.untyped_storage())
    calls = _word_copy_calls(dst, srcs, zeros, storage, tuning) + _gather_calls(dst, pieces, srcs, storage, tuning)
    uploaded, parts = _upload([call.table for call in calls], dst.device)
    launches = [(call.kernel, call.grid, (part, part[call.at:], *call.rest), call.meta)
                for call, part in zip(calls, parts)]
    return Plan(launches, keep_alive, [] if uploaded is None else [uploaded], launch_stream(dst))


def _word_copy_calls(dst: torch.Tensor, srcs: Sources, zeros: np.ndarray, storage: torch.Tensor,
                     tuning: Tuning) -> list[_Call]:
    """The word copy's launches: the contiguous pieces and the zero ranges, one launch per word class."""
    itemsize = dst.element_size()
    base = storage.data_ptr()
    dense = srcs.contiguous & (srcs.count > 0)
    segments = (
        np.concatenate([(srcs.lo + srcs.start * itemsize)[dense], np.zeros(len(zeros), dtype=np.int64)]),
        np.concatenate([srcs.offset[dense], zeros[:, 0]]) * itemsize + dst.data_ptr(),
        np.concatenate([srcs.count[dense], zeros[:, 1]]) * itemsize,
    )
    calls = []
    for unit, table, at, rows, programs in _word_classes(*segments, base, tuning.program_bytes):
        calls.append(_Call(WORD_COPY, (programs,), table, at, (rows, storage), word_meta(unit, tuning)))
    return calls


class _WordClass(NamedTuple):
    """One launch of the word copy: segments whose addresses and lengths all divide by ``unit`` bytes."""

    unit: int
    table: np.ndarray  # int64 rows [src_addr, dst word offset, words], then (from ``at``) each row's first program
    at: int
    rows: int
    programs: int


def _word_classes(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, base: int, program_bytes: int
                  ) -> list[_WordClass]:
    """Byte segments ``(src, dst, nbytes)`` as launches of one word class each, narrowest class first.

    Source and destination share a 16-byte phase only if their difference is a multiple of 16; a segment's head
    (up to its first aligned destination byte) and tail go to narrower classes. ``src == 0`` is a zero fill. No
    word is wider than ``base``'s alignment (the kernel addresses dst in words from it). Vectorised over every
    part at once: this planning's numpy calls are most of a kernel turn's fixed cost on the host.
    """
    if not (int(np.bitwise_or.reduce(src | dst)) | base) % 16:
        return _aligned_word_classes(src, dst, nbytes, base, program_bytes)
    return _mixed_word_classes(src, dst, nbytes, base, program_bytes)


def _mixed_word_classes(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, base: int, program_bytes: int
                        ) -> list[_WordClass]:
    """:func:`_word_classes` in general: each segment cut into head, body and tail, each in its own class."""
    zero = src == 0
    phase = units(np.where(zero, base, (src - dst) | base))
    head = np.minimum(nbytes, np.remainder(-dst, phase))
    body = (nbytes - head) // phase * phase
    skip = np.concatenate([np.zeros_like(head), head, head + body])  # each segment's head, body, tail
    length = np.concatenate([head, body, nbytes - head - body])
    zero3 = np.concatenate([zero, zero, zero])
    d = np.concatenate([dst, dst, dst]) + skip
    s = np.where(zero3, 0, np.concatenate([src, src, src]) + skip)
    unit = units(np.where(zero3, d, s) | d | length | base)
    live = np.flatnonzero(length > 0)
    live = live[np.argsort(unit[live], kind="stable")]  # by class; within one, heads, bodies, tails in order
    unit, s, d, length = unit[live], s[live], d[live], length[live]
    word = np.where(unit == 16, 8, unit)  # 16-byte words travel as pairs of int64
    words = length // word
    chunks = -(-words // (program_bytes // word))  # programs per segment
    if not len(unit):
        return []
    return _classes_of(unit, np.stack([s, (d - base) // word, words], axis=1), chunks)


def _aligned_word_classes(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, base: int, program_bytes: int
                          ) -> list[_WordClass]:
    """:func:`_word_classes` where every address divides by 16 (the common case: params from the caching
    allocator at offsets padded to 16 bytes): no heads; each segment's body of 16-byte words, and its tail (under
    16 bytes) in the class of the tail's length. The same classes, rows and order as the general cut, in about
    half its numpy calls, which are most of a small turn's planning."""
    body = nbytes & -16
    tail = nbytes - body
    classes = []
    if tail.any():
        cut = np.flatnonzero(tail)
        unit = units(tail[cut])  # the tail's start divides by 16: its length alone sets its word
        by_unit = np.argsort(unit, kind="stable")
        cut, unit = cut[by_unit], unit[by_unit]
        words = tail[cut] // unit
        s = np.where(src[cut] == 0, 0, src[cut] + body[cut])
        classes += _classes_of(unit, np.stack([s, (dst[cut] + body[cut] - base) // unit, words], axis=1),
                               -(-words // (program_bytes // unit)))
    live = np.flatnonzero(body)
    if len(live):
        words = body[live] // 8  # 16-byte words travel as pairs of int64
        classes += _classes_of(np.full(len(live), 16), np.stack([src[live], (dst[live] - base) // 8, words], axis=1),
                               -(-words // (program_bytes // 8)))
    return classes


def _classes_of(unit: np.ndarray, rows: np.ndarray, chunks: np.ndarray) -> list[_WordClass]:
    """Rows ``[n, 3]`` sorted by their ``unit``, each needing ``chunks`` programs, as one :class:`_WordClass` per
    unit: its rows, then each row's first program."""
    first = np.zeros(len(unit) + 1, dtype=np.int64)
    np.cumsum(chunks, out=first[1:])
    cuts = [0, *(np.flatnonzero(unit[1:] != unit[:-1]) + 1).tolist(), len(unit)]
    classes = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        table, at = _with_first_aligned(rows[a:b].reshape(-1), first[a:b + 1] - first[a])
        classes.append(_WordClass(int(unit[a]), table, at, b - a, int(first[b] - first[a])))
    return classes


def _gather_calls(dst: torch.Tensor, pieces: Sequence[Piece], srcs: Sources, storage: torch.Tensor,
                  tuning: Tuning) -> list[_Call]:
    """The gather's launches: the strided pieces' tiles, one launch per tile class."""
    itemsize = dst.element_size()
    strided: dict[tuple, list[tuple[list[int], int]]] = {}
    for i in np.flatnonzero(~srcs.contiguous & (srcs.count > 0)).tolist():
        piece = Piece(pieces[i][0], int(srcs.start[i]), int(srcs.count[i]), int(srcs.offset[i]))
        desc, tiles = _strided_descriptor(piece, dst.storage_offset(), tuning.tile_p, tuning.tile_c)
        if tiles:
            strided.setdefault(_tile_class(desc, dst, tuning.tile_p, tuning.tile_c), []).append((desc, tiles))
    calls = []
    for tile_class, entries in sorted(strided.items()):
        first = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum([t for _, t in entries], out=first[1:])
        table, at = _with_first_aligned(np.array([d for d, _ in entries], dtype=np.int64).reshape(-1), first)
        calls.append(_Call(GATHER, (int(first[-1]),), table, at, (len(entries), storage),
                           gather_meta(itemsize, tile_class, tuning)))
    return calls


def _strided_descriptor(piece: Piece, dst_first: int, tile_p: int, tile_c: int) -> tuple[list[int], int]:
    """The gather descriptor of a strided piece (copy.DESC_ROW) and its number of tiles.

    ``dst_first`` is dst's element offset in its storage. Dims are reordered to (outer..., p, c);
    only the outer indices whose tiles can hold an element of ``[start, start + count)`` are kept.
    """
    sizes, strides = merged_dims(piece.src)
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
    """(P_UNIT, C_UNIT, SRC_ALIGN, DST_ALIGN, SIZE_ALIGN, SMALL): the promises gather_tile_kernel
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
        return max(1, word_unit(*(v * itemsize for v in values)) // itemsize)

    src_align = align([desc[0] // itemsize] + [s for d, s in enumerate(strides) if s != 1 and sizes[d] > 1])
    dst_align = align([dst.untyped_storage().data_ptr() // itemsize + desc[1]]
                      + [w for d, w in enumerate(weights[:-1]) if sizes[d] > 1])
    size_align = align([sizes[-2], sizes[-1]])
    small = max(tile_p * abs(strides[-2]) + tile_c * abs(strides[-1]), tile_p * weights[-2] + tile_c) < 2**31
    return strides[-2] == 1, strides[-1] == 1, src_align, dst_align, size_align, small


def _with_first_aligned(rows: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, int]:
    """``rows`` then ``first`` in one int64 table, ``first`` starting on a 16-byte boundary, and where.

    Triton compiles a separate kernel for a pointer argument that is 16-byte aligned and one that is
    not: an odd number of int64 rows would make the prefix-sum pointer a second variant.
    """
    at = len(rows) + len(rows) % 2
    table = np.zeros(at + len(first), dtype=np.int64)
    table[:len(rows)] = rows
    table[at:] = first
    return table, at


def _upload(tables: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Every launch's table in one host-to-device copy (an upload has a fixed cost, and a plan has up to a launch
    per word class), each starting on a 16-byte boundary: Triton compiles a separate kernel for a pointer that is
    not. Returns the uploaded tensor (None for no table) and each table's view of it."""
    if not tables:
        return None, []
    starts = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([len(t) + len(t) % 2 for t in tables], out=starts[1:])
    host = _host_buffer(int(starts[-1]), device)
    joined = host.numpy()
    for table, start in zip(tables, starts.tolist()):
        joined[start:start + len(table)] = table
    uploaded = _to_device(host, device)
    return uploaded, [uploaded[start:start + len(table)] for table, start in zip(tables, starts.tolist())]


def _host_buffer(words: int, device: torch.device) -> torch.Tensor:
    """int64 host memory for the tables, written through its numpy view (the padding between two tables is never
    read): pinned for a CUDA device, straight from torch's pinned-memory cache (``empty(pin_memory=True)``;
    ``Tensor.pin_memory()`` first asks whether a tensor is pinned already, a large part of a plan's host time)."""
    if device.type != "cuda":
        return torch.zeros(words, dtype=torch.int64)
    return torch.empty(words, dtype=torch.int64, pin_memory=True)


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Upload a host-built table without making the host wait for the device's queue: from pinned memory, queued
    like a kernel (a pageable copy waits for all earlier work on the stream). Torch's pinned-memory cache keeps the
    buffer until the copy has run."""
    if device.type != "cuda":
        return table.to(device)
    return table.to(device, non_blocking=True)
