"""Triton kernels and their launch functions. Installed as ``ztriton.kernels``; knows nothing of ZeRO.

* ``copy.py``: the jit kernels. ``plan.py``: validation, pieces -> launch tables (:class:`Plan`,
  :class:`Tuning`). ``ops.py``: the launch functions. ``reference.py``: the same functions in torch,
  the fallback and the tests' oracle.
* :func:`copy_chunk` -- elements ``[start, start + count)`` of any strided tensor into a contiguous one.
* :func:`pack` -- many tensors into one flat layout at given offsets, zeros between; ``window=``
  writes only one range of that layout (one rank's partition).
* :func:`pack_slices` -- ``(src, start, count, offset)`` slices into one buffer, zeros elsewhere.
"""
from .ops import copy_chunk, pack, pack_plan, pack_slices
from .plan import KERNELS_ONLY, Piece, Plan, Tuning, byte_extent, byte_extents, make_plan, run_plan, uncovered
from .reference import bits, torch_copy_chunk, torch_pack, torch_pack_slices, torch_run

__all__ = ["KERNELS_ONLY", "Piece", "Plan", "Tuning", "bits", "byte_extent", "byte_extents", "copy_chunk", "make_plan", "pack", "pack_plan", "pack_slices",
           "run_plan", "torch_copy_chunk", "torch_pack", "torch_pack_slices", "torch_run", "uncovered"]
