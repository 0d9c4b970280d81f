"""Planning the copies: validation, pieces -> launch tables, :class:`Plan` and :class:`Tuning`.

Everything reduces to one plan: a list of *pieces* (elements ``[start, start + count)`` of a
source's row-major flattening go to ``dst[offset : offset + count]``; see ``docs/architecture.md``,
"Vocabulary") and a list of zero ranges of ``dst``. Pieces whose source range is contiguous in memory
become byte segments, cut into rows of the word-copy table by alignment class (16-byte words when
source and destination agree modulo 16, narrower words otherwise); strided pieces become tiles of
the gather table. A plan costs at most one launch per alignment class plus one gather launch,
whatever the number of tensors.

All sizes are element counts and all offsets int64; nothing here knows about ZeRO. Every argument is
checked (types first, then ranges) before any byte is written; the per-piece work is one tight loop
and the rest numpy columns, because a ZeRO-2 flatten plans hundreds to thousands of tensors per call.
"""
from __future__ import annotations

import functools
import operator
import os
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from .descriptor import DESC_HEAD, MAX_DIMS

__all__ = ["PackPieces", "Piece", "Plan", "Tuning", "as_index", "as_sequence", "byte_extent", "byte_extents", "check_dst",
           "interpreted", "KERNELS_ONLY", "make_plan", "pack_pieces", "run_plan", "runs_on", "slices_to_pieces",
           "uncovered", "validate"]

# Element sizes the kernels move as integers of that width (16-byte elements move as pairs of 8).
_ITEMSIZES = (8, 4, 2, 1)


@functools.cache
def _jit() -> SimpleNamespace:
    """The jit kernels and triton's integer types, imported by the first plan that launches a kernel (or asks
    whether the interpreter is on). A process whose copies all go through torch's copy_ (``Tuning.torch_pieces``,
    ``BEFORE_LOAD_PIECES``) never imports triton: ~0.3 s of a fresh process's start on an H200 host."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from .copy import _copy_words_kernel, _gather_tile_kernel

    return SimpleNamespace(
        copy_words=_copy_words_kernel, gather_tile=_gather_tile_kernel,
        word_types={16: tl.int64, 8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8},
        int_for_itemsize={8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8},
        # triton decides when a kernel is decorated (at its first import) whether it runs under the
        # interpreter (TRITON_INTERPRET=1); the environment variable read later could say otherwise.
        interpreted=not isinstance(_copy_words_kernel, JITFunction))


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (imports triton, once)."""
    return _jit().interpreted


def _jit_imported() -> bool:
    """Whether :func:`_jit` has imported triton and the kernels yet (asking does not import them)."""
    return _jit.cache_info().currsize > 0


# The interpreter patches triton.language module-wide during a launch: two launches at once from two
# threads would undo each other's patches. Launches under it take turns.
_INTERPRETER_LOCK = threading.Lock()
# Every size and offset must stay below this, so that a sum of two still fits in int64.
_INDEX_LIMIT = 2**62


class Piece(NamedTuple):
    """Elements ``[start, start + count)`` of ``src``'s row-major flattening go to ``dst[offset:]``."""

    src: torch.Tensor
    start: int
    count: int
    offset: int


class PackPieces(Sequence):
    """Pieces whose ranges are already int64 columns (:func:`pack_pieces`, :func:`slices_to_pieces`) and whose
    sources are known to be tensors, so that validation reads each source's attributes once instead of
    re-deriving the ranges from thousands of tuples. Indexing gives the :class:`Piece`."""

    def __init__(self, sources: list, start: np.ndarray, count: np.ndarray, offset: np.ndarray, numel: np.ndarray):
        self.sources, self.start, self.count, self.offset, self.numel = sources, start, count, offset, numel

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return Piece(self.sources[i], int(self.start[i]), int(self.count[i]), int(self.offset[i]))

    def take(self, indices: np.ndarray) -> "PackPieces":
        """The pieces at ``indices`` (an integer array, in that order), still as columns."""
        if not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
            raise TypeError(f"indices must be an integer numpy array, got {_show(indices)}")  # a mask would mis-pick
        sources = self.sources
        return PackPieces([sources[i] for i in indices.tolist()], self.start[indices], self.count[indices],
                          self.offset[indices], self.numel[indices])


def _sources_of(pieces: Sequence[Piece]) -> list:
    return pieces.sources if isinstance(pieces, PackPieces) else [p[0] for p in pieces]


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can launch on tensors of ``device``: CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and _interpreter_on())


def _interpreter_on() -> bool:
    """:func:`interpreted`, without importing triton to learn a "no" the environment already gives: before the
    kernels are imported, triton would decide from ``TRITON_INTERPRET`` as it reads now, and importing them
    while it reads "0" would fix that "no" for the life of the process (a caller may unset it briefly)."""
    if not _jit_imported() and os.environ.get("TRITON_INTERPRET", "0").lower() not in _TRUTHY:
        return False
    return interpreted()


# What triton takes for "on" in TRITON_INTERPRET.
_TRUTHY = ("1", "true", "on", "yes")


# --------------------------------------------------------------------------------------------
# Argument types: integers are integers, sequences are sequences, tensors are dense tensors with data.


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_index(name: str, value: object) -> int:
    """``value`` as a Python int (an int, a numpy integer or an integer 0-d tensor), else a TypeError
    naming ``name``: a float would be truncated and a bool is not a count. ValueError if it is too
    large for int64 arithmetic."""
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got the bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {_show(value)}") from None
    if not -_INDEX_LIMIT < value < _INDEX_LIMIT:
        raise ValueError(f"{name}={value} is out of range: sizes and offsets must be below 2**62")
    return value


def as_sequence(name: str, value: object) -> Sequence:
    """``value`` if it is a list, tuple (or another sequence, or a 1-D array), else a TypeError naming
    ``name``; a lone tensor is refused rather than iterated over its first dim."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a list or tuple, got a torch.Tensor; wrap a single tensor in a list: [tensor]")
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list or tuple, got {type(value).__name__} {_show(value)}")
    return value


def _within_index_limit(values: np.ndarray) -> bool:
    """Every value strictly between -2**62 and 2**62 (compared, not through abs: abs(-2**63) wraps to itself)."""
    return not values.size or bool(((values > -_INDEX_LIMIT) & (values < _INDEX_LIMIT)).all())


def _int64_column(values: list, name) -> np.ndarray:
    """``values`` (ints) as int64, or a ValueError naming the first one out of range (``name(i)``)."""
    try:
        column = np.array(values, dtype=np.int64)
        if _within_index_limit(column):
            return column
    except OverflowError:
        pass
    for i, v in enumerate(values):
        if not -_INDEX_LIMIT < v < _INDEX_LIMIT:
            raise ValueError(f"{name(i)}={v} is out of range: sizes and offsets must be below 2**62")
    raise AssertionError("unreachable")  # pragma: no cover


def _check_tensor(name: str, t: object) -> None:
    """A dense tensor that holds values: not sparse, not meta, no lazy conjugate or negation bit."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__} {_show(t)}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; the kernels move dense (strided) tensors: pass "
                        "tensor.to_dense()")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and holds no values; materialise it first "
                         "(e.g. module.to_empty(device=...) and load its weights)")
    if t.is_neg() or (t.dtype.is_complex and t.is_conj()):
        raise ValueError(f"{name} is a lazy conjugate (or negated) view whose memory holds other values; "
                         "pass tensor.resolve_conj().resolve_neg()")


# --------------------------------------------------------------------------------------------
# Validation: everything is checked before any byte is written.


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that a view touches (empty views touch nothing)."""
    lo, numel = t.data_ptr(), t.numel()
    if numel == 0:
        return lo, lo
    if t.is_contiguous():  # the common case, for thousands of params: no walk over the dims
        return lo, lo + numel * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return lo, lo + span * t.element_size()


def byte_extents(tensors: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`byte_extent` of each tensor as two int64 arrays (first bytes, ends): one read per attribute
    over all of them, and the walk over the dims only for the strided ones."""
    lo = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    hi = lo + np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
    for k in [k for k, t in enumerate(tensors) if not t.is_contiguous()]:
        hi[k] = byte_extent(tensors[k])[1]
    return lo, hi


def check_dst(dst: torch.Tensor) -> None:
    _check_tensor("dst", dst)
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


def _gather_sources(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool, what: str) -> _Sources:
    """Check each piece's types, dtype and (if ``same_device``) device, and collect its sizes and memory extent.

    The common case (every source a contiguous dense tensor of dst's dtype, plain int ranges) in a few
    comprehensions; anything else one piece at a time, which also names the culprit of an error.
    """
    common = _gather_common(pieces, dst, same_device)
    return common if common is not None else _gather_each(pieces, dst, same_device, what)


def _gather_common(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool) -> _Sources | None:
    """:func:`_gather_sources` for pieces that are all ``(contiguous tensor of dst's dtype, int, int, int)``
    on a device that holds values; None for anything else (checked and named by :func:`_gather_each`).

    Each comprehension reads one attribute of every source (~0.1 us each): a flatten's or defragment's
    600 pieces cost ~0.4 ms here against ~1 ms one piece at a time.
    """
    if not pieces or dst.dtype.is_complex:
        return None
    if isinstance(pieces, PackPieces):  # sources checked to be tensors, ranges integers (pack_pieces)
        srcs = pieces.sources
        ranges = np.stack([pieces.start, pieces.count, pieces.offset])
    else:
        if not all(isinstance(p, tuple) and len(p) == 4 for p in pieces):
            return None
        srcs, starts, counts, offsets = zip(*pieces)
        if not all(issubclass(kind, torch.Tensor) for kind in {type(s) for s in srcs}) or \
                {type(v) for v in starts + counts + offsets} != {int}:
            return None
        ranges = None
    if {s.dtype for s in srcs} != {dst.dtype} or {s.layout for s in srcs} != {torch.strided}:
        return None
    devices = {s.device for s in srcs}
    if any(d.type == "meta" for d in devices) or (same_device and devices != {dst.device}):
        return None
    if not all([s.is_contiguous() for s in srcs]) or any([s.is_neg() for s in srcs]):
        return None
    if ranges is None:
        try:
            ranges = np.array((starts, counts, offsets), dtype=np.int64)
        except OverflowError:
            return None
        if not _within_index_limit(ranges):
            return None
    local = np.ones(len(srcs), dtype=bool) if devices == {dst.device} else \
        np.array([s.device == dst.device for s in srcs], dtype=bool)
    numel = pieces.numel if isinstance(pieces, PackPieces) else np.array([s.numel() for s in srcs], dtype=np.int64)
    lo = np.array([s.data_ptr() for s in srcs], dtype=np.int64)
    return _Sources(*ranges, numel, lo, lo + numel * dst.element_size(), contiguous=np.ones(len(srcs), dtype=bool),
                    local=local)


def _gather_each(pieces: Sequence[Piece], dst: torch.Tensor, same_device: bool, what: str) -> _Sources:
    """:func:`_gather_sources` one piece at a time: any kind of piece, and the error naming the first bad one."""
    dtype, device, itemsize = dst.dtype, dst.device, dst.element_size()
    conj_possible = dtype.is_complex
    rows, contiguous, local = [], [], []
    for i, piece in enumerate(pieces):
        if not isinstance(piece, tuple) or len(piece) != 4:
            raise TypeError(f"{what}[{i}] must be a Piece (src, start, count, offset), got {_show(piece)}")
        src, start, count, offset = piece
        if not isinstance(src, torch.Tensor) or src.layout is not torch.strided:
            _check_tensor(f"{what}[{i}]", src)
        if src.dtype != dtype:
            raise TypeError(f"{what}[{i}] has dtype {src.dtype} but dst has dtype {dtype}; "
                            "kernels move bits and never convert: cast the source first")
        if conj_possible or src.is_neg():  # a lazy negation (x.conj().imag): its memory holds -x
            _check_tensor(f"{what}[{i}]", src)
        src_device = src.device
        on_dst = src_device == device
        if not on_dst:
            if src_device.type == "meta":
                _check_tensor(f"{what}[{i}]", src)
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
            sizes, strides = _merged_dims(src)
            dense = len(sizes) == 1 and strides[0] == 1
        rows += (start, count, offset, numel, lo, hi)
        contiguous.append(dense)
        local.append(on_dst)
    columns = _int64_column(rows, lambda k: f"{what}[{k // 6}] (start, count, offset)").reshape(-1, 6).T
    return _Sources(*columns, contiguous=np.array(contiguous, dtype=bool), local=np.array(local, dtype=bool))


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def _check_ranges(srcs: _Sources, dst: torch.Tensor, what: str) -> None:
    """Source ranges inside their sources, destination ranges inside dst, no source memory in dst."""
    end = srcs.start + srcs.count
    i = _first((srcs.start < 0) | (srcs.count < 0) | (end > srcs.numel))
    if i is not None:
        raise ValueError(f"{what}[{i}]: start={int(srcs.start[i])}, count={int(srcs.count[i])}: range "
                         f"[{int(srcs.start[i])}, {int(end[i])}) is outside its {int(srcs.numel[i])} elements")
    i = _first((srcs.offset < 0) | (srcs.offset + srcs.count > dst.numel()))
    if i is not None:
        raise ValueError(f"{what}[{i}]: offset={int(srcs.offset[i])}, count={int(srcs.count[i])}: destination range "
                         f"[{int(srcs.offset[i])}, {int(srcs.offset[i] + srcs.count[i])}) does not fit in dst of "
                         f"{dst.numel()} elements")
    dst_lo, dst_hi = byte_extent(dst)
    i = _first(srcs.local & (srcs.count > 0) & (srcs.lo < dst_hi) & (srcs.hi > dst_lo))
    if i is not None:
        raise ValueError(f"{what}[{i}] overlaps dst in memory (source bytes [{int(srcs.lo[i]):#x}, "
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


def _zero_ranges(zero_ranges, dst: torch.Tensor) -> np.ndarray:
    """``(offset, count)`` pairs as an ``[n, 2]`` int64 array, each inside dst."""
    if isinstance(zero_ranges, np.ndarray) and zero_ranges.dtype == np.int64 and zero_ranges.ndim == 2:
        zeros = zero_ranges  # built here (pack_pieces, slices_to_pieces): already integers
    else:
        pairs = as_sequence("zero_ranges", zero_ranges)
        flat = []
        for i, pair in enumerate(pairs):
            pair = as_sequence(f"zero_ranges[{i}]", pair)
            if len(pair) != 2:
                raise ValueError(f"zero_ranges[{i}] must be (offset, count), got {_show(pair)}")
            flat += [as_index(f"zero_ranges[{i}] offset", pair[0]), as_index(f"zero_ranges[{i}] count", pair[1])]
        zeros = np.array(flat, dtype=np.int64).reshape(-1, 2)
    i = _first((zeros[:, 0] < 0) | (zeros[:, 1] < 0) | (zeros.sum(1) > dst.numel()))
    if i is not None:
        o, c = int(zeros[i, 0]), int(zeros[i, 1])
        raise ValueError(f"zero range [{o}, {o + c}) does not fit in dst of {dst.numel()} elements")
    return zeros


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


class _WordClass(NamedTuple):
    """One launch of the word copy: segments whose addresses and lengths all divide by ``unit`` bytes."""

    unit: int
    table: np.ndarray  # int64 rows [src_addr, dst word offset, words], then (from ``at``) each row's first program
    at: int
    rows: int
    programs: int


def _word_classes(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, base: int, chunk_bytes: int
                  ) -> list[_WordClass]:
    """Byte segments ``(src, dst, nbytes)`` as launches of one word class each, narrowest class first.

    Source and destination can share a 16-byte phase only if their difference is a multiple of 16; the head
    up to the first aligned destination byte and the tail after the last whole word go to narrower classes.
    ``src == 0`` is a zero fill, which only the destination constrains. The kernel addresses dst in words from
    ``base``, so a word may not be wider than base's alignment. Each row gets ``chunk_bytes`` per program.

    Vectorised over every part of every segment at once and cut by class at the end: a kernel turn's fixed
    cost on an H200's host was mostly this planning's numpy calls (batch s9a), a few per class per part before.
    """
    zero = src == 0
    phase = _units(np.where(zero, base, (src - dst) | base))
    head = np.minimum(nbytes, np.remainder(-dst, phase))
    body = (nbytes - head) // phase * phase
    skip = np.concatenate([np.zeros_like(head), head, head + body])  # each segment's head, body, tail
    length = np.concatenate([head, body, nbytes - head - body])
    zero3 = np.concatenate([zero, zero, zero])
    d = np.concatenate([dst, dst, dst]) + skip
    s = np.where(zero3, 0, np.concatenate([src, src, src]) + skip)
    unit = _units(np.where(zero3, d, s) | d | length | base)
    live = np.flatnonzero(length > 0)
    live = live[np.argsort(unit[live], kind="stable")]  # by class; within one, heads, bodies, tails in order
    unit, s, d, length = unit[live], s[live], d[live], length[live]
    word = np.where(unit == 16, 8, unit)  # 16-byte words travel as pairs of int64
    words = length // word
    chunks = -(-words // (chunk_bytes // word))
    rows = np.stack([s, (d - base) // word, words], axis=1)
    first = np.concatenate([[0], np.cumsum(chunks)])
    cuts = [0, *(np.flatnonzero(unit[1:] != unit[:-1]) + 1).tolist(), len(unit)]
    classes = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            continue
        table, at = _with_first_aligned(rows[a:b].reshape(-1), first[a:b + 1] - first[a])
        classes.append(_WordClass(int(unit[a]), table, at, b - a, int(first[b] - first[a])))
    return classes


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
    # Up to this many pieces, all contiguous, are copied by torch's copy_ (and the gaps by zero_): a
    # contiguous run moves at copy bandwidth either way, a few extra launches cost microseconds, and
    # torch's copy never pays a jit kernel's first-launch cost in a fresh process (~0.5 s on an H200 with
    # Triton's cache warm, seconds with it cold): zero.Init's per-module partitions (HF modules hold 1-4
    # params, bench/models.py's LLM-mix blocks 12) and most loader jobs are this small. The kernels earn their keep on hundreds of pieces (flatten, defragment) and on
    # strided sources. 0: always launch the kernels (the kernel tests and benchmarks use it).
    torch_pieces: int = 16
    # In such torch copies, a piece of at least this many bytes gets a copy_ of its own (a memcpy at copy
    # bandwidth); the others go in torch._foreach_copy_ calls per word width (~1 us of host time a piece, at
    # ~0.7x copy bandwidth: bench/results/copy_paths_h200_s7a.json). A copy_ with its views costs ~20 us of the
    # H200's host, but 256 MiB (session 9's try) was slower: the 8.6 GiB flatten's 200 pieces of 32 MiB took
    # 5.75 ms of device in _foreach_copy_ against 5.0 ms as memcpys, 9.0-9.3 ms whole against 8.2-9.6 (batch
    # s10a, alternating trees).
    own_copy_bytes: int = 16 << 20
    # Under run_now, a _foreach_copy_ is issued each time this many pieces of one word width are ready, so that
    # the device starts while the host still makes the next pieces' views.
    batch_pieces: int = 64
    # torch's _foreach_copy_ and _foreach_zero_ only for more pieces (gaps) than this; fewer get a copy_ (zero_)
    # each. A process's first _foreach_copy_ loads its CUDA kernel: 17-22 ms on the H200 for the LLM mix's 400
    # small params, against 4.6-6.4 ms for a copy_ each, which is a memcpy with no kernel to load (4.0-5.9 ms
    # again on a second call, _foreach_copy_ of int64 views 4.3: bench/results/first_calls_h200_s11g.json). The
    # torch route runs where no kernel is loaded yet: mostly once, in a fresh process.
    foreach_from: int = 1024
    # Runs (and gaps) that follow one another in dst, at least this many, are written by one torch.cat(out=) of
    # their sources (and zeros) instead of a copy_ / _foreach_copy_ each: one call of host time for any number of
    # pieces, which a fresh process's flatten is bound by (session 11: 602 copy_ took 14 ms there against
    # DeepSpeed's 7.5 ms torch.cat). 0: never. The cat moves integer words: in bf16 a span of more than 2^31
    # elements makes torch.cat copy each input with a memcpy in a C++ loop (DeepSpeed's path), which was slower
    # (s12c: the LLM mix's pack 12.2 ms on a second call against 8.2-8.6 ms on int64 words; DeepSpeed 6.3-6.7).
    cat_items: int = 2
    # A gap joins such a cat (as a view of one zero buffer) only up to this many bytes: the buffer is device memory
    # beside dst, so a long gap (the evict tier's evicted params) is zeroed apart instead. Pads are a few elements.
    cat_gap_bytes: int = 64 << 10


# Launch the kernels whatever the pieces (the kernel tests and benchmarks, the warm-up).
KERNELS_ONLY = Tuning(torch_pieces=0)


@dataclass
class Plan:
    """Launches that carry out one copy; reusable while its tensors stay where they are.

    It keeps the source tensors referenced: the tables name them only by address. On CUDA the tables
    were uploaded on ``stream`` (the stream current when the plan was made); a launch runs on the
    stream current at launch time, on dst's device.
    """

    launches: list
    keep_alive: list
    tables: list = field(default_factory=list)
    stream: Any = None
    copies: list = field(default_factory=list)  # (out, src) views for torch's copy_ (Tuning.torch_pieces)
    batches: list = field(default_factory=list)  # (outs, srcs) lists of views for one torch._foreach_copy_ each
    fills: list = field(default_factory=list)  # views of dst for torch's zero_
    inference: bool = False  # the views are inference tensors (made in inference mode): written only inside it
    zero_each: bool = False  # a zero_ per fill instead of one _foreach_zero_ (Tuning.foreach_from)
    cats: list = field(default_factory=list)  # (out, inputs): one torch.cat(inputs, out=out) each

    @property
    def torch_copies(self) -> bool:
        """Whether this plan copies with torch (copy_, cat, _foreach_copy_, zero_) instead of launching kernels."""
        return bool(self.copies or self.cats or self.batches or self.fills)

    def launch(self) -> None:
        if self.stream is None:  # CPU, under the interpreter
            with self._interpreter_turn():
                self._launch_all()
            return
        device = self.stream.device
        with torch.cuda.device(device) if torch.cuda.current_device() != device.index else nullcontext():
            current = torch.cuda.current_stream(device)
            if current != self.stream:
                # Launched on another stream than the tables' upload: wait for the upload, and keep
                # the tables' memory from being reused on the upload stream while this one reads it.
                current.wait_stream(self.stream)
                for table in self.tables:
                    table.record_stream(current)
            with self._interpreter_turn():
                self._launch_all()

    def _interpreter_turn(self):
        """The interpreter's lock for a plan that launches kernels under it; a torch-only plan's turn otherwise."""
        return _INTERPRETER_LOCK if self.launches and interpreted() else _torch_turn()

    def copy_with_torch(self) -> None:
        """The torch part: each own copy, each ``torch.cat``, each batch's ``_foreach_copy_``, the gaps' ``zero_``
        each or one ``_foreach_zero_`` (in the caller's autograd mode)."""
        for out, src in self.copies:
            out.copy_(src)
        for out, inputs in self.cats:
            torch.cat(inputs, out=out)
        for outs, srcs in self.batches:
            torch._foreach_copy_(outs, srcs)
        if self.zero_each:
            for fill in self.fills:
                fill.zero_()
        elif self.fills:
            torch._foreach_zero_(self.fills)

    def _launch_all(self) -> None:
        if self.torch_copies:
            # Views made in inference mode may be written only inside it (entering it costs tens of microseconds,
            # a small zero.Init partition's copy a few); the others without autograd, as the kernels write.
            with torch.inference_mode() if self.inference else torch.no_grad():
                self.copy_with_torch()
        if self.launches and self.stream is not None:
            _await_warm_up(self.stream.device)
        for kernel, grid, args, kwargs in self.launches:
            kernel[grid](*args, **kwargs)
        if self.launches and self.stream is not None:
            LOADED.add(self.stream.device.index)


def _torch_turn():
    """The interpreter's lock for torch's copies once kernels may run under it (a launch on CUDA tensors copies
    dst's whole storage to the host and back: torch's copies beside it would be lost); nothing where triton is not
    even imported yet, since then no kernel can be running."""
    return _INTERPRETER_LOCK if _jit_imported() and interpreted() else nullcontext()


# Background warm-ups in flight, by CUDA device index (kernels/warmup.py registers them here).
WARMING: dict[int, threading.Thread] = {}
# A launch waits at most this long for one (a cold compile takes seconds); then it loads the kernel itself.
_WARM_UP_WAIT_S = 120.0

# CUDA devices on which a kernel launch has returned in this process: the first launch there paid the
# kernels' load (Triton's cache key, the cubin, the launcher: ~0.5 s on an H200 with Triton's cache warm,
# seconds with it cold), later ones do not.
LOADED: set[int] = set()

# Until the kernels are loaded on a device (by the background warm-up, or by a first job that needs them),
# contiguous pieces on it up to this many go through torch's copy_ (~8 us of host time each: 4096 of them
# cost ~30 ms, far less than the load they avoid). A process whose jobs all fit (a dense model's or a fused
# MoE's flatten and defragment: hundreds of params) never loads the kernels at all.
BEFORE_LOAD_PIECES = 4096


def kernels_loaded(device: torch.device) -> bool:
    """Whether a kernel launch on ``device`` has already paid the kernels' load (always, off CUDA: the
    interpreter loads nothing)."""
    return device.type != "cuda" or device.index in LOADED


def _await_warm_up(device: torch.device) -> None:
    """Let a warm-up of ``device`` still loading the kernels finish rather than load them a second time
    beside it (Triton does not share a load in progress between threads)."""
    thread = _warm_up_elsewhere(device)
    if thread is None:
        return
    if thread.is_alive():
        thread.join(timeout=_WARM_UP_WAIT_S)
    WARMING.pop(device.index, None)  # waited once, finished or not: later launches never wait again


def _warm_up_elsewhere(device: torch.device) -> threading.Thread | None:
    """The warm-up registered for ``device``, unless there is none or it is the calling thread itself."""
    thread = WARMING.get(device.index) if device.type == "cuda" else None
    return None if thread is None or thread is threading.current_thread() else thread


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Upload a host-built table without making the host wait for the device's queue.

    A pageable copy would block until all earlier work on the stream is done; a pinned one is
    queued like a kernel (torch's pinned-memory cache keeps the buffer until the copy has run). The
    pinned buffer comes straight from that cache (``empty(pin_memory=True)``): ``Tensor.pin_memory()``
    first asks whether the table is pinned already, which cost 0.1-0.5 ms a table on the H200's host
    (batch s8c, torch.profiler), a quarter of a 2,000-tensor plan's host time.
    """
    if device.type != "cuda":
        return table.to(device)
    pinned = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
    pinned.copy_(table)
    return pinned.to(device, non_blocking=True)


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


def validate(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
             same_device: bool = True, what: str = "sources") -> tuple[_Sources, np.ndarray]:
    """Every check of a copy, before any byte is written: ``dst`` a contiguous dense tensor, each piece's
    types, dtype (and, with ``same_device``, device), ranges inside their tensors, no source memory
    inside ``dst``, no two destination ranges overlapping. ``what`` names the pieces in errors (the
    caller's argument). Returns the pieces' facts and the zero ranges as an ``[n, 2]`` array."""
    check_dst(dst)
    pieces = as_sequence(what, pieces)
    srcs = _gather_sources(pieces, dst, same_device, what)
    _check_ranges(srcs, dst, what)
    zeros = _zero_ranges(zero_ranges, dst)
    n = len(pieces)
    _check_disjoint(np.concatenate([srcs.offset, zeros[:, 0]]), np.concatenate([srcs.offset + srcs.count, zeros.sum(1)]),
                    lambda k: f"{what}[{k}]" if k < n else "a pad range")
    return srcs, zeros


def _check_launchable(dst: torch.Tensor) -> None:
    if not runs_on(dst.device):
        raise ValueError(
            f"dst is on {dst.device}, where the Triton kernels cannot run: they need a CUDA device, or CPU tensors "
            "under Triton's interpreter (set the environment variable TRITON_INTERPRET=1 before triton is first "
            "imported). For host tensors use the torch reference: ztriton.kernels.torch_pack, torch_pack_slices, "
            "torch_copy_chunk")


def _as_word_pairs(dst: torch.Tensor, pieces: Sequence[Piece], srcs: _Sources, zeros: np.ndarray):
    """A copy of 16-byte elements (complex128) as the same copy of twice as many 8-byte ones: the
    kernels move words of at most 8 bytes per element. Views only, nothing is copied."""
    def pairs(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(t)  # [..., 2] float64, any strides

    pieces = [(pairs(p[0]), 0, 0, 0) for p in pieces]  # sizes: the doubled columns below
    srcs = _Sources(2 * srcs.start, 2 * srcs.count, 2 * srcs.offset, 2 * srcs.numel, srcs.lo, srcs.hi,
                    srcs.contiguous, srcs.local)
    return pairs(dst).view(-1), pieces, srcs, 2 * zeros


def make_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              tuning: Tuning = Tuning(), what: str = "sources", run_now: bool = False) -> Plan:
    """Validate, then build the launches that copy every piece into ``dst`` and zero ``zero_ranges``.

    ``zero_ranges`` are ``(offset, count)`` in elements of dst. On any error nothing is written.
    ``run_now`` (for :func:`run_plan`): torch copies are issued as they are planned, so the device starts
    on the first piece while the host makes the views of the rest; the plan returned then has nothing left
    to launch.
    """
    srcs, zeros = validate(dst, pieces, zero_ranges, what=what)
    _check_launchable(dst)
    keep_alive = [dst, *_sources_of(pieces)]
    if _torch_copies_suffice(srcs, tuning, dst.device):
        return _torch_copy_plan(dst, pieces, srcs, zeros, keep_alive, tuning, run_now)
    if dst.element_size() not in _ITEMSIZES:
        if not dst.dtype.is_complex:
            raise TypeError(f"dst has dtype {dst.dtype} of {dst.element_size()} bytes, which the kernels do not move")
        dst, pieces, srcs, zeros = _as_word_pairs(dst, pieces, srcs, zeros)

    jit = _jit()
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
    calls: list[_Call] = []
    for unit, table, at, rows, programs in _word_classes(*segments, base, tuning.chunk_bytes):
        word = _word_bytes(unit)
        calls.append(_Call(jit.copy_words, (programs,), table, at, (rows, storage), dict(
            WORD=jit.word_types[unit], VEC=unit // word, BLOCK=tuning.step_bytes // word,
            CHUNK=tuning.chunk_bytes // word, STREAM=tuning.stream, num_warps=tuning.num_warps)))

    strided: dict[tuple, list[tuple[list[int], int]]] = {}
    for i in np.flatnonzero(~srcs.contiguous & (srcs.count > 0)).tolist():
        piece = Piece(pieces[i][0], int(srcs.start[i]), int(srcs.count[i]), int(srcs.offset[i]))
        desc, tiles = _strided_descriptor(piece, dst.storage_offset(), tuning.tile_p, tuning.tile_c)
        if tiles:
            strided.setdefault(_tile_class(desc, dst, tuning.tile_p, tuning.tile_c), []).append((desc, tiles))
    for (p_unit, c_unit, src_align, dst_align, size_align, small), entries in sorted(strided.items()):
        first = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum([t for _, t in entries], out=first[1:])
        table, at = _with_first_aligned(np.array([d for d, _ in entries], dtype=np.int64).reshape(-1), first)
        calls.append(_Call(jit.gather_tile, (int(first[-1]),), table, at, (len(entries), storage), dict(
            WORD=jit.int_for_itemsize[itemsize], MAX_DIMS=MAX_DIMS, DESC_HEAD=DESC_HEAD, BLOCK_P=tuning.tile_p,
            BLOCK_C=tuning.tile_c, P_UNIT=p_unit, C_UNIT=c_unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align,
            SIZE_ALIGN=size_align, SMALL=small,
            num_warps=tuning.tile_warps)))

    uploaded, parts = _upload([call.table for call in calls], dst.device)
    launches = [(call.kernel, call.grid, (part, part[call.at:], *call.rest), call.meta)
                for call, part in zip(calls, parts)]
    return Plan(launches, keep_alive, [] if uploaded is None else [uploaded], _launch_stream(dst))


class _Call(NamedTuple):
    """One launch of a plan before its table is uploaded."""

    kernel: Any
    grid: tuple
    table: np.ndarray  # host int64: its rows, then (from ``at``) each row's first program
    at: int
    rest: tuple  # the arguments after the table's two parts
    meta: dict  # the kernel's constexprs and launch options


def _upload(tables: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """Every launch's table in one host-to-device copy (an upload has a fixed cost of tens of microseconds on
    an H200's host, and a plan has up to a launch per word class), each starting on a 16-byte boundary: Triton
    compiles a separate kernel for a pointer that is not. Returns the uploaded tensor (None for no table) and
    each table's view of it."""
    if not tables:
        return None, []
    starts = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([len(t) + len(t) % 2 for t in tables], out=starts[1:])
    joined = np.zeros(int(starts[-1]), dtype=np.int64)
    for table, start in zip(tables, starts.tolist()):
        joined[start:start + len(table)] = table
    uploaded = _to_device(torch.from_numpy(joined), device)
    return uploaded, [uploaded[start:start + len(table)] for table, start in zip(tables, starts.tolist())]


def _torch_copies_suffice(srcs: _Sources, tuning: Tuning, device: torch.device) -> bool:
    """Contiguous pieces that torch's copy_ moves without a kernel launch: a few of them (``Tuning.torch_pieces``;
    0 always launches the kernels), or up to ``BEFORE_LOAD_PIECES`` pieces on dst's device while no kernel has been
    loaded there: a copy_ per piece costs microseconds, the kernels' first load a fraction of a second (warm Triton
    cache) to seconds (cold), whether this thread pays it or waits for a background warm-up."""
    moving = srcs.count > 0
    if tuning.torch_pieces <= 0 or not bool(srcs.contiguous[moving].all()):
        return False
    count = int(moving.sum())
    # Before the load, only pieces already on the device: a copy_ from host memory blocks the host per piece.
    return count <= tuning.torch_pieces or (count <= BEFORE_LOAD_PIECES and bool(srcs.local[moving].all())
                                            and not kernels_loaded(device))


def _torch_copy_plan(dst: torch.Tensor, pieces: Sequence[Piece], srcs: _Sources, zeros: np.ndarray,
                     keep_alive: list, tuning: Tuning, run_now: bool = False) -> Plan:
    """The plan of :func:`_torch_copies_suffice`'s case: torch copies each piece (pieces that continue each other
    in one storage and in dst as one, :class:`_CopyRuns`), and zeroes each gap.

    On integer views of the flattened tensors (the widest word that every destination range, and the piece's
    source, is aligned to; bytes at worst), as the kernels see them: offsets count elements of dst's flattening
    whatever its shape, and bits move unchanged (bool bytes other than 0 and 1, NaN payloads, fp4 pairs, which
    torch would convert, canonicalise or refuse as their own dtypes). Runs and gaps that follow one another in
    dst (``Tuning.cat_items`` or more, every run word-aligned and on dst's device, every gap short:
    ``Tuning.cat_gap_bytes``) are written by one ``torch.cat(out=)`` of their sources and of a zero buffer's
    views, into one view of their span. Of the others, a piece of ``Tuning.own_copy_bytes`` or more gets a
    ``copy_`` of its own, the rest ``torch._foreach_copy_`` per word width, the gaps one ``torch._foreach_zero_``;
    up to ``Tuning.foreach_from`` of them, each its own ``copy_`` (``zero_``). The views are made, and later
    written, without autograd (so no ``detach`` per source). Where those pieces and gaps tile a span of dst one
    ``split`` cuts all their views; a source copied whole needs no ``narrow``. ``run_now``: each
    own copy is issued as soon as its views exist, a ``_foreach_copy_`` as soon as ``Tuning.batch_pieces`` pieces
    of its width are ready, the rest at the end, in the mode the views were made in; nothing is left to launch.
    """
    route = _route(dst, pieces, srcs, zeros, tuning)
    runs, word, words = route.runs, route.word, route.words
    with _torch_turn() if run_now else nullcontext(), torch.no_grad():
        out = _bytes(dst).view(words)
        # dst's views only for what is copied or zeroed alone: a cat writes one view of its whole span.
        outs = _cut(out, list(zip((runs.offset[route.alone_runs] // word).tolist(),
                                  (runs.nbytes[route.alone_runs] // word).tolist())),
                    [(offset // word, count // word) for offset, count in route.gaps[route.alone_gaps].tolist()])
        copies, batches = _lone_copies(route, outs, tuning.batch_pieces, run_now)
        # (after the lone copies: under run_now the device starts on them while these views are made)
        sources = runs.joined_views(route.joined_runs, route.aligned, words)
        cats, zero = _cats(out, route.joined, sources, route.item_offset // word, route.item_nbytes // word,
                           len(runs.sources), words) if route.joined else ([], None)
        fills = outs[len(route.alone_runs):]
        if run_now:
            Plan([], keep_alive, [], None, [], batches, fills, zero_each=route.zero_each,
                 cats=cats).copy_with_torch()
            return Plan([], keep_alive, [], _launch_stream(dst))
    # Views made in inference mode are inference tensors even of a normal dst: launched outside it, they must
    # be written inside it again. The zero buffer, made and filled on this stream, goes with the tables: a launch
    # on another stream waits for it and keeps its memory from reuse until that stream has read it.
    return Plan([], keep_alive, [] if zero is None else [zero], _launch_stream(dst), copies, batches,
                fills, out.is_inference(), route.zero_each, cats)


@dataclass
class _Route:
    """How torch's route moves a plan's runs and gaps (:func:`_route`): all in bytes of dst, runs first, then gaps."""

    runs: _CopyRuns
    gaps: np.ndarray  # [n, 2]: offset, bytes
    word: int  # the widest integer word every destination range is aligned to
    words: torch.dtype  # the integer dtype of that width
    aligned: np.ndarray  # per run: its source can be viewed as words too (else it moves as bytes)
    item_offset: np.ndarray  # the runs' and gaps' offsets, as one column
    item_nbytes: np.ndarray
    joined: list[list[int]]  # items that one torch.cat each writes (:func:`_joined`)
    alone_runs: np.ndarray  # runs copied alone
    alone_gaps: np.ndarray  # gaps zeroed alone
    own: np.ndarray  # per run: its own copy_ if alone (else a _foreach_copy_ batch)
    zero_each: bool  # the lone gaps: a zero_ each (else one _foreach_zero_)

    @property
    def joined_runs(self) -> np.ndarray:
        n_runs = len(self.runs.sources)
        return np.array([i for items in self.joined for i in items if i < n_runs], dtype=np.int64)


def _route(dst: torch.Tensor, pieces: Sequence[Piece], srcs: _Sources, zeros: np.ndarray, tuning: Tuning) -> _Route:
    """Decide :func:`_torch_copy_plan`'s route (no tensor is made here): the runs, the word, which items a cat
    joins and how the others are copied or zeroed."""
    width = dst.element_size()
    live = np.flatnonzero(srcs.count > 0)
    gaps = zeros[zeros[:, 1] > 0] * width
    runs = _copy_runs(_sources_of(pieces), live, srcs, width)
    # dst's views must be whole words of its storage, and (for _foreach_copy_'s vector loads) at word addresses.
    word = _common_word(np.concatenate([runs.offset, runs.nbytes, gaps.reshape(-1),
                                       [dst.storage_offset() * width, dst.numel() * width, dst.data_ptr()]]))
    aligned = runs.aligned_to(word)
    n_runs = len(runs.sources)
    item_offset, item_nbytes = np.concatenate([runs.offset, gaps[:, 0]]), np.concatenate([runs.nbytes, gaps[:, 1]])
    # Only sources on dst's device join a cat (torch.cat would move a host source to the device first, whole).
    joined = _joined(item_offset, item_nbytes,
                     np.concatenate([aligned & runs.local, gaps[:, 1] <= tuning.cat_gap_bytes]), tuning.cat_items)
    alone = np.ones(n_runs + len(gaps), dtype=bool)
    for items in joined:
        alone[items] = False
    own = runs.nbytes >= tuning.own_copy_bytes
    if int(alone[:n_runs].sum()) <= tuning.foreach_from:
        own[:] = True
    return _Route(runs, gaps, word, _INT_OF_WIDTH[word], aligned, item_offset, item_nbytes, joined,
                  np.flatnonzero(alone[:n_runs]), np.flatnonzero(alone[n_runs:]), own,
                  int(alone[n_runs:].sum()) <= tuning.foreach_from)


def _lone_copies(route: _Route, outs: list[torch.Tensor], batch_pieces: int, run_now: bool
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[list, list]]]:
    """The runs copied alone (``outs``: their views of dst, in :attr:`_Route.alone_runs`' order): each own copy
    ``(into, view)``, and the ``_foreach_copy_`` batches per word width. ``run_now``: an own copy is issued at
    once, a batch as soon as it holds ``batch_pieces``; what is returned is what is left to issue."""
    copies, batches = [], {}
    for r, into in zip(route.alone_runs.tolist(), outs):
        view, into = route.runs.views(r, into, route.words if route.aligned[r] else torch.uint8)
        if route.own[r]:
            if run_now:
                into.copy_(view)
            else:
                copies.append((into, view))
        else:
            batch = batches.setdefault(view.dtype, ([], []))
            batch[0].append(into)
            batch[1].append(view)
            if run_now and len(batch[0]) >= batch_pieces:
                torch._foreach_copy_(*batch)
                del batches[view.dtype]
    return copies, list(batches.values())


def _joined(offset: np.ndarray, nbytes: np.ndarray, joinable: np.ndarray, at_least: int) -> list[list[int]]:
    """Groups of items (by index) that follow one another in dst, each item starting where the one before it
    ends, all ``joinable``, at least ``at_least`` of them (0: none), each group in dst order."""
    n = len(offset)
    if at_least <= 0 or n < max(at_least, 2):
        return []
    order = np.argsort(offset, kind="stable")
    start, end, ok = offset[order], (offset + nbytes)[order], joinable[order]
    touch = (start[1:] == end[:-1]) & ok[1:] & ok[:-1]
    heads = np.flatnonzero(np.concatenate([[True], ~touch]))
    ends = np.append(heads[1:], n)
    return [order[h:e].tolist() for h, e in zip(heads.tolist(), ends.tolist()) if e - h >= max(at_least, 2)]


def _cats(out: torch.Tensor, joined: list[list[int]], sources: dict, offset: np.ndarray, count: np.ndarray,
          n_runs: int, words: torch.dtype) -> tuple[list[tuple[torch.Tensor, list]], torch.Tensor | None]:
    """One ``(out view, inputs)`` per group of :func:`_joined` (items' ``offset`` and ``count`` in elements of
    ``out``, runs first, then gaps): its runs' source views and, for its gaps, views of one zero buffer (as long as
    the longest gap), in dst order; and that buffer (None without gaps)."""
    longest = max((int(count[i]) for items in joined for i in items if i >= n_runs), default=0)
    zero = torch.zeros(longest, dtype=words, device=out.device) if longest else None
    cats = []
    for items in joined:
        inputs = [sources[i] if i < n_runs else zero.narrow(0, 0, int(count[i])) for i in items]
        cats.append((out.narrow(0, int(offset[items[0]]), int(count[items].sum())), inputs))
    return cats, zero


@dataclass
class _CopyRuns:
    """The torch route's copies, in bytes: each run is one piece, or several pieces that continue each other in
    one storage and in dst (:func:`_runs`), copied as one."""

    sources: list  # each run's first source
    first: np.ndarray  # the run's first byte in its source's storage
    start: np.ndarray  # the run's first byte in its source's flattening
    nbytes: np.ndarray
    offset: np.ndarray  # in dst
    alone: np.ndarray  # a single piece
    whole: np.ndarray  # a single piece that is its whole source
    source_words: np.ndarray  # bytes its source's storage offset and size share (a single piece's word bound)
    address: np.ndarray  # the run's first source byte in memory
    local: np.ndarray  # its source is on dst's device

    def aligned_to(self, word: int) -> np.ndarray:
        """Runs whose source side can be viewed as ``word``-byte integers: a single piece whose source starts on
        a word in its storage, holds whole words and whose start is on one; a run of several, one view of their
        storage, if it starts on a word; either only at a word address (a storage may start anywhere, e.g. one
        imported through DLPack, and CUDA's vector loads need the address). The others move as bytes."""
        in_storage = np.where(self.alone, (self.source_words | self.start) % word == 0, self.first % word == 0)
        return in_storage & (self.address % word == 0)

    def views(self, r: int, into: torch.Tensor | None, words: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``r``'s source bytes and ``into`` (its part of dst; None: not wanted), both as ``words``."""
        src = self.sources[r]
        view = src if src.dim() == 1 else src.view(-1)
        unit = words.itemsize
        if not self.alone[r]:
            view = view.view(torch.uint8).as_strided((int(self.nbytes[r]),), (1,), int(self.first[r]))
        if view.dtype != words:
            view = view.view(words)
        if into is not None and into.dtype != words:
            into = into.view(words)
        if self.alone[r] and not self.whole[r]:
            view = view.narrow(0, int(self.start[r]) // unit, int(self.nbytes[r]) // unit)
        return view, into


    def joined_views(self, joined: np.ndarray, aligned: np.ndarray, words: torch.dtype) -> dict[int, torch.Tensor]:
        """The source views of the runs a cat joins, by run: a whole source (a flatten's every param) in one
        pass of at most two views each (hundreds of them, each a few microseconds of a fresh process's host),
        the others through :meth:`views`."""
        plain = (self.whole & aligned)[joined].tolist()
        views = {}
        for r, is_plain in zip(joined.tolist(), plain):
            if is_plain:
                src = self.sources[r]
                view = src if src.dim() == 1 else src.view(-1)
                views[r] = view if view.dtype == words else view.view(words)
            else:
                views[r] = self.views(r, None, words if aligned[r] else torch.uint8)[0]
        return views


def _copy_runs(every: list, live: np.ndarray, srcs: _Sources, width: int) -> _CopyRuns:
    """The non-empty pieces as :class:`_CopyRuns`."""
    starts, counts, offsets, numels = (column[live] * width for column in (srcs.start, srcs.count, srcs.offset,
                                                                            srcs.numel))
    sources = [every[i] for i in live.tolist()]
    first = np.array([s.storage_offset() for s in sources], dtype=np.int64) * width  # in its storage, bytes
    heads, ends = _runs(sources, srcs.lo[live] - first, first + starts, counts, offsets)
    alone = ends - heads == 1
    return _CopyRuns([sources[k] for k in heads.tolist()], (first + starts)[heads], starts[heads],
                     np.add.reduceat(counts, heads) if len(heads) else counts, offsets[heads], alone,
                     alone & ((starts == 0) & (counts == numels))[heads], (first | numels)[heads],
                     (srcs.lo[live] + starts)[heads], srcs.local[live][heads])


def _runs(sources: list, bases: np.ndarray, firsts: np.ndarray, counts: np.ndarray, offsets: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """``[head, end)`` index ranges of consecutive pieces that continue each other both in one storage (the same
    ``bases``, the address its storage starts at; ``firsts``, each piece's first byte in it) and in dst
    (``offsets``), all in bytes: a defragment's partitions still side by side in their module's buffer. Each run
    is copied as one. A run that would reach past its first source's storage (a tensor made over another's
    memory) is split back into its pieces."""
    n = len(counts)
    if n == 0:
        return np.arange(0), np.arange(0)
    follows = (bases[1:] == bases[:-1]) & (firsts[1:] == firsts[:-1] + counts[:-1]) & \
        (offsets[1:] == offsets[:-1] + counts[:-1])
    heads = np.flatnonzero(np.concatenate([[True], ~follows]))
    ends = np.append(heads[1:], n)
    reach = np.add.reduceat(counts, heads) + firsts[heads]
    too_far = [r for r in np.flatnonzero(ends - heads > 1).tolist()
               if reach[r] > sources[heads[r]].untyped_storage().nbytes()]
    if too_far:
        heads = np.union1d(heads, np.concatenate([np.arange(heads[r], ends[r]) for r in too_far]))
        ends = np.append(heads[1:], n)
    return heads, ends


# Integer dtypes by width in bytes: the views torch copies through (integer copies never convert a bit).
_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _common_word(byte_values: np.ndarray) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every value (:func:`_units` of their bits together; torch
    has no 16-byte integer to view as)."""
    bits = np.bitwise_or.reduce(byte_values.astype(np.int64), keepdims=True) if len(byte_values) else \
        np.zeros(1, dtype=np.int64)
    return min(8, int(_units(bits)[0]))


def _cut(out: torch.Tensor, pieces: list[tuple[int, int]], gaps: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``out`` at each ``(offset, length)`` of ``pieces`` then ``gaps`` (elements of ``out``), in that
    order: one ``split`` of the span they cover when together they tile it (they are disjoint, as validated: a
    pack, a partition, or one turn of either), else a ``narrow`` each (~3x the host time per view)."""
    segments = pieces + gaps
    if not segments:
        return []
    order = sorted(range(len(segments)), key=lambda k: segments[k][0])
    lo = segments[order[0]][0]
    span = sum(length for _, length in segments)
    if max(offset + length for offset, length in segments) - lo != span:
        return [out.narrow(0, offset, length) for offset, length in segments]
    views = out.narrow(0, lo, span).split([segments[k][1] for k in order])
    placed = [None] * len(segments)
    for k, view in zip(order, views):
        placed[k] = view
    return placed


def _launch_stream(dst: torch.Tensor):
    """The stream a plan for ``dst`` is made on (its tables uploaded on): the current one; None on the CPU."""
    return torch.cuda.current_stream(dst.device) if dst.device.type == "cuda" else None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements, row-major, as a flat uint8 view (no copy). Its callers make it under
    ``torch.no_grad``: a tensor that requires grad then gets no autograd view bookkeeping."""
    return t.reshape(-1).view(torch.uint8)


def run_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
             what: str = "sources") -> None:
    """Copy every piece into ``dst`` and write zeros over ``zero_ranges``: :func:`make_plan`, launched (torch
    copies as they are planned)."""
    make_plan(dst, pieces, zero_ranges, what=what, run_now=True).launch()


def _gaps(begin: np.ndarray, end: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``[n, 2]`` (offset, count) of the parts of ``[lo, hi)`` that no ``[begin, end)`` covers."""
    keep = end > begin
    begin, end = begin[keep], end[keep]
    order = np.argsort(begin, kind="stable")
    begin, end = begin[order], end[order]
    reach = np.maximum.accumulate(np.concatenate([[lo], end]))  # covered up to, before each range
    starts = np.concatenate([reach[:-1], reach[-1:]])
    stops = np.concatenate([begin, [hi]])
    starts = np.maximum(starts, lo)
    stops = np.minimum(stops, hi)
    gap = stops > starts
    return np.stack([starts[gap], stops[gap] - starts[gap]], axis=1).astype(np.int64).reshape(-1, 2)


def uncovered(covered: Sequence[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """``(offset, count)`` of the parts of ``[begin, end)`` that no ``(b, e)`` in ``covered`` holds."""
    pairs = np.array(list(covered), dtype=np.int64).reshape(-1, 2)
    return [tuple(g) for g in _gaps(pairs[:, 0], pairs[:, 1], begin, end).tolist()]


def slices_to_pieces(dst: torch.Tensor, slices: Sequence[tuple[torch.Tensor, int, int, int]]
                     ) -> tuple[Sequence[Piece], np.ndarray]:
    """``(src, start, count, offset)`` slices as pieces, and the ranges of ``dst`` they leave to zero."""
    check_dst(dst)
    slices = as_sequence("slices", slices)
    columns = _plain_slices(slices)
    if columns is not None:
        offsets, counts = columns[:, 2], columns[:, 1]
        zeros = _gaps(offsets, offsets + np.maximum(counts, 0), 0, dst.numel())
        sources = [s[0] for s in slices]
        if not all(isinstance(src, torch.Tensor) for src in sources):
            return list(slices), zeros  # validate names the culprit
        # The common case: columns as a pack's, so that validation reads each source's attributes once.
        return PackPieces(sources, columns[:, 0], counts, offsets,
                          np.array([src.numel() for src in sources], dtype=np.int64)), zeros
    pieces = []
    for i, s in enumerate(slices):
        if isinstance(s, torch.Tensor) or not isinstance(s, (tuple, list)) or len(s) != 4:
            raise TypeError(f"slices[{i}] must be a (src, start, count, offset) tuple, got {_show(s)}")
        src, start, count, offset = s
        pieces.append(Piece(src, as_index(f"slices[{i}] start", start), as_index(f"slices[{i}] count", count),
                            as_index(f"slices[{i}] offset", offset)))
    offsets = np.array([p[3] for p in pieces], dtype=np.int64)
    counts = np.array([p[2] for p in pieces], dtype=np.int64)
    return pieces, _gaps(offsets, offsets + np.maximum(counts, 0), 0, dst.numel())


def _plain_slices(slices: Sequence) -> np.ndarray | None:
    """``[n, 3]`` (start, count, offset) of slices that are all 4-tuples of a source and plain ints in
    range; None otherwise (then each slice is checked, and a bad one named, one at a time)."""
    if not all(type(s) is tuple and len(s) == 4 for s in slices) or \
            not {type(v) for s in slices for v in s[1:]} <= {int}:
        return None
    try:
        columns = np.array([s[1:] for s in slices], dtype=np.int64).reshape(-1, 3)
    except OverflowError:
        return None
    return columns if _within_index_limit(columns) else None


def pack_pieces(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
                window: tuple[int, int] | None = None) -> tuple[PackPieces, np.ndarray]:
    """The pieces and zero ranges of a pack: ``sources`` (flattened row-major) at element ``offsets``
    of a flat layout, zeros elsewhere; with ``window=(w0, w1)`` only elements ``[w0, w1)`` of that
    layout, written to ``dst[: w1 - w0]``. Checks the arguments of the pack itself; the pieces are
    checked by :func:`validate`."""
    check_dst(dst)
    sources = as_sequence("sources", sources)
    offsets = as_sequence("offsets", offsets)
    if len(sources) != len(offsets):
        raise ValueError(f"got {len(sources)} sources but {len(offsets)} offsets")
    if window is None:
        w0, w1 = 0, dst.numel()
    else:
        window = as_sequence("window", window)
        if len(window) != 2:
            raise ValueError(f"window must be None or (w0, w1), got {_show(window)}")
        w0, w1 = as_index("window[0]", window[0]), as_index("window[1]", window[1])
        if not (0 <= w0 <= w1) or w1 - w0 > dst.numel():
            raise ValueError(f"window=({w0}, {w1}) must satisfy 0 <= w0 <= w1 and fit dst's {dst.numel()} elements")
    # One pass per fact over thousands of sources (the first turn of a fresh pack waits for this): a type per
    # source, then its numel; one at a time only to name a culprit.
    if not all(issubclass(kind, torch.Tensor) for kind in {type(src) for src in sources}):
        for i, src in enumerate(sources):
            if not isinstance(src, torch.Tensor):
                raise TypeError(f"sources[{i}] must be a torch.Tensor, got {type(src).__name__} {_show(src)}")
    numels = np.array([src.numel() for src in sources], dtype=np.int64)
    if not {type(o) for o in offsets} <= {int}:
        offsets = [o if type(o) is int else as_index(f"offsets[{i}]", o) for i, o in enumerate(offsets)]
    begin = _int64_column(offsets, lambda i: f"offsets[{i}]")
    end = begin + numels
    i = _first(begin < 0)
    if i is not None:
        raise ValueError(f"offsets[{i}]={int(begin[i])} is negative")
    i = _first(end > dst.numel()) if window is None else None
    if i is not None:
        raise ValueError(f"sources[{i}]: destination range [{int(begin[i])}, {int(end[i])}) does not "
                         f"fit in dst of {dst.numel()} elements")
    _check_disjoint(begin, end, lambda k: f"sources[{k}]")
    # Each source's part inside the window; sources outside it still get validated, as empty pieces.
    lo, hi = np.maximum(begin, w0), np.minimum(end, w1)
    inside = lo < hi
    pieces = PackPieces(list(sources), np.where(inside, lo - begin, 0), np.where(inside, hi - lo, 0),
                        np.where(inside, lo - w0, 0), end - begin)
    return pieces, _gaps(lo[inside] - w0, hi[inside] - w0, 0, w1 - w0)
