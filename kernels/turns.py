"""A copy into a fresh buffer, in turns: check a turn's sources, start copying them, go on to the next.

:func:`~ztriton.kernels.plan.make_plan` checks every piece before the first byte is written, so that a bad
argument leaves ``dst`` as it was. Reading the sources' attributes for those checks is host work of ~1-3 us
per tensor on an H200's host: for 2,000 tensors ~5 ms, most of a 7 ms copy, during which the device idles.

A buffer allocated for the result (a flatten's or a defragment's flat buffer, a rank's partition) holds
nothing anyone reads yet: a failure half way through leaves only a buffer that its caller drops. For such a
``dst`` the pieces go in turns, and the device copies one turn while the host checks the next. What never
changes: what no turn could check alone (destination ranges disjoint across the whole job, the zero ranges
inside dst) is checked before any byte is written; each turn is checked in full before its own bytes are
written, so nothing is ever written outside dst; the sources are only read; an error names the culprit by
its index in the whole job, as a single plan's would.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

import torch

from .plan import PackPieces, Piece, _check_disjoint, _zero_ranges, check_dst, make_plan, run_plan, validate

__all__ = ["run_fresh", "turns"]

# The first turn is small, so that the device starts early; each next one doubles, so that a turn's checks take
# about as long as the device's copy of the turn before. A turn has a fixed cost besides its ~1 us per piece: one
# plan's numpy, table uploads and launches, ~0.5 ms on the H200's host (batch s8d), which 64 pieces doubling to
# 512 paid seven times for 2,000 pieces (the early turns host-bound); 128 doubling to 1,024 pays it five times.
FIRST_TURN = 128
LAST_TURN = 1024


def turns(n: int, first: int = FIRST_TURN, last: int = LAST_TURN) -> Iterator[tuple[int, int]]:
    """``[a, b)`` index ranges that cover ``range(n)`` in order: ``first`` pieces, then twice as many each
    turn, at most ``last``."""
    a, size = 0, first
    while a < n:
        b = min(n, a + size)
        yield a, b
        a, size = b, min(last, 2 * size)


def run_fresh(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              what: str = "sources") -> None:
    """:func:`~ztriton.kernels.plan.run_plan` for a ``dst`` that was just allocated for this result: the same
    copy and the same errors, but the pieces are checked and copied in :func:`turns`. On an error raised after
    the first turn, dst holds part of the result (drop it); the sources are untouched."""
    if not isinstance(pieces, PackPieces) or len(pieces) <= FIRST_TURN:
        run_plan(dst, pieces, zero_ranges, what=what)
        return
    check_dst(dst)
    zeros = _zero_ranges(zero_ranges, dst)
    with _errors_as_one_plan(dst, pieces, zeros, what):
        _check_destinations(dst, pieces, zeros, what)
    spans = list(turns(len(pieces)))
    zeros_of_turn = _turn_of_each_zero_range(pieces, zeros, spans)
    for t, (a, b) in enumerate(spans):
        with _errors_as_one_plan(dst, pieces, zeros, what):
            make_plan(dst, pieces.part(a, b), zeros[zeros_of_turn == t], what=what, run_now=True).launch()


@contextmanager
def _errors_as_one_plan(dst: torch.Tensor, pieces: PackPieces, zeros: np.ndarray, what: str) -> Iterator[None]:
    """A check failing inside: run one plan's checks over the whole job first, so that the error raised is the one
    a single plan raises (its order: types, ranges, overlaps; the culprit named by its index in the whole job)."""
    try:
        yield
    except (TypeError, ValueError):
        validate(dst, pieces, zeros, what=what)
        raise


def _turn_of_each_zero_range(pieces: PackPieces, zeros: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """The turn that zeroes each zero range: the one whose piece ends where the range begins (else the first).

    So that a turn's pieces and zero ranges tile one span of dst where its pieces are neighbours there (a pack's
    layout in order, a defragment, a partition), and torch's route cuts all of a turn's views with one ``split``
    instead of a ``narrow`` each (the first turn would otherwise make thousands of views for the pads alone)."""
    turn_of_piece = np.repeat(np.arange(len(spans)), [b - a for a, b in spans])
    live = np.flatnonzero(pieces.count > 0)
    if not len(live) or not len(zeros):
        return np.zeros(len(zeros), dtype=np.int64)
    ends = pieces.offset[live] + pieces.count[live]
    order = np.argsort(ends, kind="stable")
    k = np.minimum(np.searchsorted(ends[order], zeros[:, 0]), len(live) - 1)
    follows = ends[order][k] == zeros[:, 0]
    return np.where(follows, turn_of_piece[live[order[k]]], 0)


def _check_destinations(dst: torch.Tensor, pieces: PackPieces, zeros: np.ndarray, what: str) -> None:
    """What no turn can check alone: no two destination ranges of the whole job overlap (nor a zero range).
    From the columns, before anything is written; each turn checks its own pieces' ranges again."""
    n = len(pieces)
    count = np.maximum(pieces.count, 0)
    _check_disjoint(np.concatenate([pieces.offset, zeros[:, 0]]), np.concatenate([pieces.offset + count, zeros.sum(1)]),
                    lambda k: f"{what}[{k}]" if k < n else "a pad range")
