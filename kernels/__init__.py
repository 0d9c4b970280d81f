"""Triton kernels and their launch functions. Installed as ``ztriton.kernels``; knows nothing of ZeRO.

* :func:`copy_chunk` -- elements ``[start, start + count)`` of any strided tensor into a contiguous one.
* :func:`pack` -- many tensors into one flat layout at given offsets, zeros between; ``window=``
  writes only one range of that layout (one rank's partition).
* :func:`pack_slices` -- ``(src, start, count, offset)`` slices into one buffer, zeros elsewhere.
"""
from ztriton.kernels.pack import Piece, Plan, Tuning, copy_chunk, make_plan, pack, pack_plan, pack_slices, run_plan

__all__ = ["Piece", "Plan", "Tuning", "copy_chunk", "make_plan", "pack", "pack_plan", "pack_slices", "run_plan"]
