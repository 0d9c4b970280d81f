"""The launch functions: strided chunk copy, multi-tensor pack, its window form, and slices.

Each builds a :class:`~ztriton.kernels.plan.Plan` (validated before any byte is written) and launches
it. :mod:`ztriton.kernels.reference` does the same in plain torch: the fallback where the kernels
cannot run, and the tests' oracle.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .plan import Piece, Plan, Tuning, as_index, check_dst, make_plan, pack_pieces, run_plan, slices_to_pieces

__all__ = ["copy_chunk", "pack", "pack_pipelined", "pack_plan", "pack_slices"]


def copy_chunk(src: torch.Tensor, dst: torch.Tensor, start: int = 0, count: int | None = None) -> torch.Tensor:
    """Write elements ``[start, start + count)`` of ``src``'s row-major flattening into ``dst[:count]``.

    ``src`` may have any shape and strides (transposed, sliced, expanded, offset); it is read in
    place, never made contiguous. ``dst`` is contiguous, for example a view into a larger buffer;
    ``count`` defaults to ``dst.numel()``. Returns ``dst``.

    Every launch function refuses bad arguments (non-integer sizes, a lone tensor for a list, meta or
    sparse tensors, CPU tensors outside Triton's interpreter) with a TypeError or ValueError naming
    the argument, before any byte is written.
    """
    run_plan(dst, [chunk_piece(src, dst, start, count)], what="src")
    return dst


def chunk_piece(src: torch.Tensor, dst: torch.Tensor, start: int, count: int | None) -> Piece:
    """The one piece of :func:`copy_chunk` (``count`` defaults to all of ``dst``)."""
    check_dst(dst)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    start = as_index("start", start)
    count = dst.numel() if count is None else as_index("count", count)
    if count > dst.numel():
        raise ValueError(f"count={count} exceeds dst's {dst.numel()} elements")
    return Piece(src, start, count, 0)


def pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
         window: tuple[int, int] | None = None) -> torch.Tensor:
    """Lay ``sources`` (flattened row-major) at element ``offsets`` of a flat layout, zeros elsewhere.

    Without ``window`` the layout is ``dst`` itself. With ``window=(w0, w1)`` only elements
    ``[w0, w1)`` of the layout are written, into ``dst[: w1 - w0]``: one rank's partition of a
    flat buffer. Every element of the window is written exactly once. Returns ``dst``.
    """
    pack_plan(dst, sources, offsets, window).launch()
    return dst


# pack_pipelined's first batch of sources; each later batch is twice the one before.
PIPELINE_FIRST = 32


def pack_pipelined(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int]) -> torch.Tensor:
    """:func:`pack` (no window) in growing batches of sources, each launched as soon as it is planned,
    so the device copies one batch while the host plans the next: for hundreds of sources the host's
    planning takes about as long as the device's copying, and one plan would run them one after the other.

    Batch k holds sources ``[a, b)`` (32, 64, 128, ... of them) and writes dst from ``offsets[a]`` to
    ``offsets[b]`` (the end of dst for the last batch), zeros included: the same bytes as one pack.
    ``offsets`` must ascend (else: one pack). Each batch is validated before it is written, so a bad
    source in a later batch raises after earlier batches wrote their part of dst: for a buffer the
    caller has just allocated and drops on error. Returns ``dst``.
    """
    check_dst(dst)
    n = len(sources)
    starts = np.asarray(offsets, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
    if n <= 2 * PIPELINE_FIRST or len(offsets) != n or bool((np.diff(starts) < 0).any()) or starts[0] < 0:
        return pack(dst, sources, offsets)
    a, size, end = 0, PIPELINE_FIRST, dst.numel()
    if int(starts[0]) > 0:  # the zeros before the first source
        dst.narrow(0, 0, min(end, int(starts[0]))).zero_()
    while a < n:
        b = min(n, a + size)
        lo = int(starts[a])
        hi = end if b == n else int(starts[b])
        pack(dst.narrow(0, lo, max(0, hi - lo)), sources[a:b], (starts[a:b] - lo).tolist())
        a, size = b, 2 * size
    return dst


def pack_plan(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
              window: tuple[int, int] | None = None, tuning: Tuning = Tuning()) -> Plan:
    """The :class:`Plan` of :func:`pack`, to launch later or again."""
    return make_plan(dst, *pack_pieces(dst, sources, offsets, window), tuning)


def pack_slices(dst: torch.Tensor, slices: Sequence[tuple[torch.Tensor, int, int, int]]) -> torch.Tensor:
    """Copy each ``(src, start, count, offset)`` slice into ``dst`` and zero everything else of ``dst``.

    For one rank's ZeRO-3 slices of many params into one per-rank buffer. Returns ``dst``.
    """
    run_plan(dst, *slices_to_pieces(dst, slices), what="slices")
    return dst
