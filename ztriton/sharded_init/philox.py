"""Counter arithmetic of ATen's CUDA distribution kernels (``normal_``, ``uniform_``), read from
``ATen/native/cuda/DistributionTemplates.h`` and ``TensorIterator.cpp`` (torch 2.11 and 2.13 agree).

One call on a contiguous tensor of ``n`` elements (``distribution_nullary_kernel``):

* launches ``blocks = min(SMs * (maxThreadsPerSM // 256), ceil(n / 256))`` blocks of 256 threads; thread
  ``t`` calls ``curand_init(seed, t, offset)`` and yields ``unroll`` values per round (4 for fp32/bf16/fp16,
  2 for fp64), so element ``e`` comes from thread ``e mod T``, lane ``(e div T) mod unroll``, round
  ``e div (unroll * T)``, ``T = 256 * blocks``;
* reserves ``((n - 1) // (unroll * T) + 1) * 4`` philox offsets, *before* looking at 32-bit indexing;
* a tensor that cannot use 32-bit indexing (more than 2**31 - 1 elements, or a last byte offset past
  2**31 - 1) is then cut by ``with_32bit_indexing``: depth first, the first half (``m // 2``) before the
  second, until every piece fits; each piece is launched as a call of its own and reserves its own
  offsets after the whole-tensor reservation above.

Hence a window: elements ``[k*P, k*P + L)`` of a piece (``P = unroll * T``) are exactly what a call on a
fresh tensor of ``L >= T`` elements gives when the generator's offset is ``piece_base + 4*k`` (same
thread count, rounds shifted by ``k``). Everything here is integers: the module never touches a GPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch

BLOCK = 256
OFFSETS_PER_ROUND = 4  # ATen's max_generator_offsets_per_curand_call
INT32_MAX = 2**31 - 1

__all__ = ["Geometry", "Piece", "Window", "call_layout", "increment", "unroll", "windows"]


@dataclass(frozen=True)
class Geometry:
    """What the kernels read from the device: multiprocessor count and threads per multiprocessor."""

    sms: int
    max_threads_per_sm: int

    @property
    def max_blocks(self) -> int:
        return self.sms * (self.max_threads_per_sm // BLOCK)

    @staticmethod
    def of(device: torch.device) -> "Geometry":
        return _geometry(torch.device(device).index if torch.device(device).index is not None
                         else torch.cuda.current_device())


@dataclass(frozen=True)
class Piece:
    """A 32-bit piece of one call: elements ``[start, start + numel)``; its philox offset is the call's
    base plus ``offset``."""

    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Window:
    """One generation: a fresh tensor of ``length`` elements, generated at offset base + ``offset``,
    whose element 0 is element ``start`` of the full call; elements ``[keep_start, keep_end)`` of the
    full call are taken from it."""

    start: int
    offset: int
    length: int
    keep_start: int
    keep_end: int

    @property
    def exact(self) -> bool:
        """Whether every generated element is kept (the window can be generated in place)."""
        return self.keep_start == self.start and self.keep_end == self.start + self.length


@functools.lru_cache(maxsize=None)
def _geometry(index: int) -> Geometry:
    props = torch.cuda.get_device_properties(index)
    return Geometry(props.multi_processor_count, props.max_threads_per_multi_processor)


def unroll(dtype: torch.dtype) -> int:
    """Values per thread per round: curand_*4 for float/half/bfloat16, curand_*2_double for double."""
    return 2 if dtype == torch.float64 else 4


def _threads(n: int, geometry: Geometry) -> int:
    return BLOCK * min(geometry.max_blocks, -(-n // BLOCK))


def increment(n: int, geometry: Geometry, unroll_factor: int) -> int:
    """Offsets one launch on ``n`` elements reserves (``calc_execution_policy``); 0 for an empty tensor."""
    if n <= 0:
        return 0
    return ((n - 1) // (_threads(n, geometry) * unroll_factor) + 1) * OFFSETS_PER_ROUND


def _fits_32bit(n: int, itemsize: int, limit: int) -> bool:
    """``TensorIterator::can_use_32bit_indexing`` for a contiguous tensor (one operand, one dimension)."""
    return n <= limit and 1 + (n - 1) * itemsize <= limit


def _split(start: int, n: int, itemsize: int, limit: int, out: list[tuple[int, int]]) -> None:
    # SplitUntil32Bit: the iterator on top of the stack is split (first half m // 2 pushed on top)
    # until it fits, so pieces come out in order, first halves first.
    if _fits_32bit(n, itemsize, limit):
        out.append((start, n))
        return
    first = n // 2
    _split(start, first, itemsize, limit, out)
    _split(start + first, n - first, itemsize, limit, out)


def call_layout(n: int, itemsize: int, geometry: Geometry, unroll_factor: int,
                limit: int = INT32_MAX) -> tuple[int, list[Piece]]:
    """How one call on ``n`` contiguous elements advances the generator (total offsets) and where each
    32-bit piece's offsets start. ``limit`` is INT32_MAX; tests shrink it to exercise the split."""
    if n <= 0:
        return 0, []
    whole = increment(n, geometry, unroll_factor)
    if _fits_32bit(n, itemsize, limit):
        return whole, [Piece(0, n, 0)]
    cuts: list[tuple[int, int]] = []
    _split(0, n, itemsize, limit, cuts)
    pieces, offset = [], whole  # the whole-tensor reservation happens first, and is never used
    for start, m in cuts:
        pieces.append(Piece(start, m, offset))
        offset += increment(m, geometry, unroll_factor)
    return offset, pieces


def max_window(itemsize: int, period: int, limit: int = INT32_MAX) -> int:
    """The longest window (a multiple of ``period``) that is itself generated without a 32-bit split."""
    longest = min(limit, (limit - 1) // itemsize + 1)
    return max(period, longest // period * period)


def windows(pieces: list[Piece], begin: int, end: int, geometry: Geometry, unroll_factor: int, itemsize: int,
            longest: int | None = None, limit: int = INT32_MAX) -> Iterator[Window]:
    """Windows that together give elements ``[begin, end)`` of the call laid out as ``pieces``.

    Per piece: an unaligned head up to the next period boundary, then aligned windows of up to
    ``longest`` elements (default: the most a window may hold without being split itself), the last one
    padded to at least one full grid of threads. A piece too small to fill the grid (fewer than
    ``256 * (max_blocks - 1)`` elements) has one round only and is generated whole.
    """
    full_grid = BLOCK * geometry.max_blocks
    for piece in pieces:
        lo, hi = max(begin, piece.start) - piece.start, min(end, piece.start + piece.numel) - piece.start
        if lo >= hi:
            continue
        threads = _threads(piece.numel, geometry)
        if threads < full_grid:
            yield Window(piece.start, piece.offset, piece.numel, piece.start + lo, piece.start + hi)
            continue
        period = unroll_factor * threads
        step = max_window(itemsize, period, limit) if longest is None else max(period, longest // period * period)
        start = lo // period * period
        while start < hi:
            stop = min(hi, start + (period if start < lo else step))
            length = max(stop - start, threads)
            yield Window(piece.start + start, piece.offset + OFFSETS_PER_ROUND * (start // period), length,
                         piece.start + max(lo, start), piece.start + stop)
            start = stop
