"""Planning a copy: :func:`make_plan` validates pieces and picks the route that moves them; :func:`run_plan` also
launches it. Whether the kernels can run on a device at all (:func:`runs_on`) is asked here too.

Every copy is a list of *pieces* (elements ``[start, start + count)`` of a source's row-major flattening go to
``dst[offset : offset + count]``; ``docs/architecture.md``, "Vocabulary") and a list of zero ranges of ``dst``.
All sizes are element counts and all offsets int64; nothing here knows about ZeRO. Every argument is checked
(``validation.py``) before any byte is written. Two routes carry the copy out, chosen by the job alone (its
pieces, strides and sizes; never by what the process ran before): torch's own copies (``torch_route.py``) for a
few contiguous pieces; the kernels' launch tables (``tables.py``) otherwise, at most one launch per alignment
class plus one per gather class whatever the number of tensors, each from the compiled cache (``compiled.py``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import state
from .launch import Plan
from .pieces import Piece, sources_of
from .state import interpreted
from .tables import kernel_plan
from .torch_route import torch_copy_plan
from .tuning import Tuning
from .validation import Sources, validate
from .words import ITEMSIZES

# ztriton.memory and ztriton.partitioning import runs_on from here; tests read interpreted and Piece here too.
__all__ = ["check_launchable", "interpreted", "interpreter_on", "make_plan", "run_plan", "runs_on"]


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can launch on tensors of ``device``: CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreter_on())


def interpreter_on() -> bool:
    """:func:`~ztriton.kernels.state.interpreter_on`, asking this module's ``interpreted`` (tests replace it)."""
    return state.interpreter_on(lambda: interpreted())


def check_launchable(dst: torch.Tensor) -> None:
    """A ValueError unless the kernels can run on dst's device (:func:`runs_on`), saying what to use instead."""
    if not runs_on(dst.device):
        raise ValueError(
            f"dst is on {dst.device}, where the Triton kernels cannot run: they need a CUDA device, or CPU tensors "
            "under Triton's interpreter (set the environment variable TRITON_INTERPRET=1 before triton is first "
            "imported). For host tensors use the torch reference: ztriton.kernels.torch_pack, torch_pack_slices, "
            "torch_copy_chunk")


def make_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              tuning: Tuning = Tuning(), what: str = "sources", run_now: bool = False) -> Plan:
    """Validate, then build the launches that copy every piece into ``dst`` and zero ``zero_ranges``.

    ``zero_ranges`` are ``(offset, count)`` in elements of dst. On any error nothing is written.
    ``run_now`` (for :func:`run_plan`): torch copies are issued as they are planned, so the device starts
    on the first piece while the host makes the views of the rest; the plan returned then has nothing left
    to launch.
    """
    srcs, zeros = validate(dst, pieces, zero_ranges, what=what)
    check_launchable(dst)
    keep_alive = [dst, *sources_of(pieces)]
    if _torch_copies_suffice(srcs, tuning):
        return torch_copy_plan(dst, pieces, srcs, zeros, keep_alive, tuning, run_now)
    if dst.element_size() not in ITEMSIZES:
        if not dst.dtype.is_complex:
            raise TypeError(f"dst has dtype {dst.dtype} of {dst.element_size()} bytes, which the kernels do not move")
        dst, pieces, srcs, zeros = _as_word_pairs(dst, pieces, srcs, zeros)
    return kernel_plan(dst, pieces, srcs, zeros, keep_alive, tuning)


def run_plan(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
             what: str = "sources") -> None:
    """Copy every piece into ``dst`` and write zeros over ``zero_ranges``: :func:`make_plan`, launched (torch
    copies as they are planned)."""
    make_plan(dst, pieces, zero_ranges, what=what, run_now=True).launch()


def _torch_copies_suffice(srcs: Sources, tuning: Tuning) -> bool:
    """Whether torch's route takes the copy: at most ``Tuning.torch_pieces`` pieces, all contiguous (0 always
    launches the kernels). The job alone decides: a contiguous run moves at copy bandwidth either way, and a few
    copy_ calls cost the host less than a plan's tables."""
    moving = srcs.count > 0
    if tuning.torch_pieces <= 0 or not bool(srcs.contiguous[moving].all()):
        return False
    return int(moving.sum()) <= tuning.torch_pieces


def _as_word_pairs(dst: torch.Tensor, pieces: Sequence[Piece], srcs: Sources, zeros: np.ndarray):
    """A copy of 16-byte elements (complex128) as the same copy of twice as many 8-byte ones: the
    kernels move words of at most 8 bytes per element. Views only, nothing is copied."""
    def pairs(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(t)  # [..., 2] float64, any strides

    pieces = [(pairs(p[0]), 0, 0, 0) for p in pieces]  # sizes: the doubled columns below
    srcs = Sources(2 * srcs.start, 2 * srcs.count, 2 * srcs.offset, 2 * srcs.numel, srcs.lo, srcs.hi,
                   srcs.contiguous, srcs.local)
    return pairs(dst).view(-1), pieces, srcs, 2 * zeros
