"""The launch functions: strided chunk copy, multi-tensor pack, its window form, and slices.

Each builds a :class:`~ztriton.kernels.launch.Plan` (validated before any byte is written) and launches
it. :mod:`ztriton.kernels.reference` does the same in plain torch: the fallback where the kernels
cannot run, and the tests' oracle.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .checks import as_index, check_dst
from .launch import Plan
from .pieces import Piece, pack_pieces, slices_to_pieces
from .plan import make_plan, run_plan
from .tuning import Tuning
from .turns import pack_fresh, run_fresh

__all__ = ["copy_chunk", "pack", "pack_plan", "pack_slices"]


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
         window: tuple[int, int] | None = None, *, fresh: bool = False,
         meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
    """Lay ``sources`` (flattened row-major) at element ``offsets`` of a flat layout, zeros elsewhere.

    Without ``window`` the layout is ``dst`` itself. With ``window=(w0, w1)`` only elements
    ``[w0, w1)`` of the layout are written, into ``dst[: w1 - w0]``: one rank's partition of a
    flat buffer. Every element of the window is written exactly once. Returns ``dst``.

    ``fresh=True`` says dst was just allocated for this result and nothing reads it yet: the biggest
    pieces are then copied first and the rest checked and copied in turns (:mod:`~ztriton.kernels.turns`),
    so the device starts before the last source is checked; an error after the first copy leaves dst
    partly written (drop it).

    ``meanwhile``: the caller's host work, called once: with ``fresh``, once the device has the first copies
    (the lead, and the first of the turns where the job goes in turns), so that it overlaps them; else before
    the job is read. What it raises propagates (a fresh dst then partly written); where the job itself raises
    for a bad argument first, it still runs first, so that a caller's check naming the culprit wins.
    """
    if fresh:
        pack_fresh(dst, sources, offsets, window, meanwhile)
        return dst
    if meanwhile is not None:
        meanwhile()
    run_plan(dst, *pack_pieces(dst, sources, offsets, window))
    return dst


def pack_plan(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
              window: tuple[int, int] | None = None, tuning: Tuning = Tuning()) -> Plan:
    """The :class:`Plan` of :func:`pack`, to launch later or again."""
    return make_plan(dst, *pack_pieces(dst, sources, offsets, window), tuning)


def pack_slices(dst: torch.Tensor, slices: Sequence[tuple[torch.Tensor, int, int, int]], *,
                fresh: bool = False) -> torch.Tensor:
    """Copy each ``(src, start, count, offset)`` slice into ``dst`` and zero everything else of ``dst``.

    For one rank's ZeRO-3 slices of many params into one per-rank buffer. Returns ``dst``. ``fresh``:
    as :func:`pack`'s.
    """
    (run_fresh if fresh else run_plan)(dst, *slices_to_pieces(dst, slices), what="slices")
    return dst
