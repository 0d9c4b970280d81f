"""Triton kernels and their launch functions. Installed as ``ztriton.kernels``; knows nothing of ZeRO.

* ``ops.py``: the launch functions below. ``reference.py``: the same functions in torch, the fallback and
  the tests' oracle. ``turns.py``: a copy into a fresh buffer, checked and copied in turns.
* ``plan.py``: pieces -> a :class:`Plan` (``launch.py``), after every check (``checks.py``, ``validation.py``)
  of the :class:`Piece` list (``pieces.py``), by torch's route (``torch_route.py``) or the kernels' launch
  tables (``tables.py``, ``words.py``, ``variants.py``), with a :class:`Tuning` (``tuning.py``). ``copy.py``: the
  jit kernels. ``compiled.py``: each launch, from the compiled cache (``cache.py``, loaded by ``driver.py``; filled
  by ``build.py``) or through Triton's JIT. ``state.py``: triton imported on demand, the interpreter, the launch
  counter. ``warmup.py``: the cache's background fill, a first load in a background thread.
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
    from .checks import byte_extent, byte_extents
    from .launch import Plan
    from .pieces import Piece, uncovered
    from .plan import make_plan, run_plan
    from .tuning import KERNELS_ONLY, Tuning
    from .reference import bits, torch_copy_chunk, torch_pack, torch_pack_slices, torch_run
    from .words import integer_view

__all__ = ["KERNELS_ONLY", "Piece", "Plan", "Tuning", "bits", "byte_extent", "byte_extents", "copy_chunk", "integer_view", "make_plan", "pack", "pack_plan", "pack_slices",
           "run_plan", "torch_copy_chunk", "torch_pack", "torch_pack_slices", "torch_run", "uncovered"]
