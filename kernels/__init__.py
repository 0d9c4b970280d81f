"""Triton kernels and their launch functions. Installed as ``ztriton.kernels``; knows nothing of ZeRO.

* ``copy.py``: the jit kernels. ``plan.py``: validation, pieces -> launch tables (:class:`Plan`,
  :class:`Tuning`). ``ops.py``: the launch functions. ``reference.py``: the same functions in torch,
  the fallback and the tests' oracle.
* :func:`copy_chunk` -- elements ``[start, start + count)`` of any strided tensor into a contiguous one.
* :func:`pack` -- many tensors into one flat layout at given offsets, zeros between; ``window=``
  writes only one range of that layout (one rank's partition).
* :func:`pack_slices` -- ``(src, start, count, offset)`` slices into one buffer, zeros elsewhere.
"""
import sys as _sys


def _hand_over_top_level_name() -> bool:
    """This folder is ``ztriton.kernels``. From a checkout root (``python -m pytest``, ``PYTHONPATH=.``) Python
    also finds it as the top-level ``kernels``, a name that belongs to another distribution (PyPI's ``kernels``,
    which transformers imports). Imported under that name, load the other package in its place, if there is one
    further down sys.path: the import then returns it. Returns whether it did."""
    import importlib.machinery
    import importlib.util
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [entry for entry in _sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
    if spec is None or spec.loader is None or not spec.has_location:  # none, or only a namespace portion
        return False
    module = importlib.util.module_from_spec(spec)
    _sys.modules["kernels"] = module  # the import system returns what sys.modules holds once this file ends
    spec.loader.exec_module(module)
    return True


if __name__ != "kernels" or not _hand_over_top_level_name():
    from .ops import copy_chunk, pack, pack_plan, pack_slices
    from .plan import KERNELS_ONLY, Piece, Plan, Tuning, byte_extent, byte_extents, make_plan, run_plan, uncovered
    from .reference import bits, torch_copy_chunk, torch_pack, torch_pack_slices, torch_run

__all__ = ["KERNELS_ONLY", "Piece", "Plan", "Tuning", "bits", "byte_extent", "byte_extents", "copy_chunk", "make_plan", "pack", "pack_plan", "pack_slices",
           "run_plan", "torch_copy_chunk", "torch_pack", "torch_pack_slices", "torch_run", "uncovered"]
