"""Pieces, the unit of every copy (``docs/architecture.md``, "Vocabulary"), and the builders that turn a pack's
or a list of slices' arguments into pieces and the zero ranges they leave.

A builder checks the arguments of its own call; the pieces themselves are checked by
:func:`~ztriton.kernels.validation.validate`. Builders hand over int64 columns (:class:`PackPieces`), so that a
flatten's thousands of pieces are never re-read one tuple at a time.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from .checks import as_index, as_sequence, check_disjoint, check_dst, each, each_int64, first_true, int64_column, \
    show, within_index_limit

__all__ = ["PackPieces", "Piece", "known_disjoint", "offsets_column", "pack_pieces", "slices_to_pieces", "sources_of",
           "uncovered"]


class Piece(NamedTuple):
    """Elements ``[start, start + count)`` of ``src``'s row-major flattening go to ``dst[offset:]``."""

    src: torch.Tensor
    start: int
    count: int
    offset: int


class PackPieces(Sequence):
    """Pieces whose ranges are already int64 columns (:func:`pack_pieces`, :func:`slices_to_pieces`) and whose
    sources are known to be tensors, so that validation reads each source's attributes once instead of
    re-deriving the ranges from thousands of tuples. Indexing gives the :class:`Piece`.

    ``gaps``: set by a builder that checked the pieces' destination ranges pairwise disjoint, to the zero ranges it
    computed as what they leave uncovered (disjoint from every piece by construction); a selection of distinct
    pieces (:meth:`take` with ``distinct=True``) keeps it. Validation then skips the disjointness check of these
    pieces with no zero ranges or with exactly these (:func:`known_disjoint`): a second pass over thousands of
    ranges before a fresh pack's first launch. The columns and ``gaps`` are the builder's: never changed after.
    """

    def __init__(self, sources: list, start: np.ndarray, count: np.ndarray, offset: np.ndarray, numel: np.ndarray,
                 gaps: np.ndarray | None = None):
        self.sources, self.start, self.count, self.offset, self.numel = sources, start, count, offset, numel
        self.gaps = gaps

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return Piece(self.sources[i], int(self.start[i]), int(self.count[i]), int(self.offset[i]))

    def take(self, indices: np.ndarray, distinct: bool = False) -> "PackPieces":
        """The pieces at ``indices`` (an integer array, in that order), still as columns. ``distinct``: the caller
        knows no index repeats (a part of a permutation), so the selection keeps ``gaps``; otherwise it drops them
        (a piece taken twice overlaps itself)."""
        if not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
            raise TypeError(f"indices must be an integer numpy array, got {show(indices)}")  # a mask would mis-pick
        sources = self.sources
        return PackPieces([sources[i] for i in indices.tolist()], self.start[indices], self.count[indices],
                          self.offset[indices], self.numel[indices], self.gaps if distinct else None)

    def after(self, indices: np.ndarray, copied: np.ndarray) -> "PackPieces":
        """These pieces less the first ``copied`` elements of those at ``indices`` (copied already; no index twice):
        the same sources, each range what is left of its piece's, so still disjoint (``gaps`` kept)."""
        start, count, offset = self.start.copy(), self.count.copy(), self.offset.copy()
        start[indices] += copied
        count[indices] -= copied
        offset[indices] += copied
        return PackPieces(self.sources, start, count, offset, self.numel, self.gaps)


def known_disjoint(pieces: Sequence[Piece], zeros: np.ndarray) -> bool:
    """Whether ``pieces`` and ``zeros`` are known not to overlap in dst (:class:`PackPieces`' ``gaps``): the
    pieces checked pairwise disjoint by their builder, and no zero ranges or the builder's own (the same array)."""
    gaps = getattr(pieces, "gaps", None)
    return gaps is not None and (not len(zeros) or zeros is gaps)


def sources_of(pieces: Sequence[Piece]) -> list:
    """Each piece's source tensor, in order (from the column where the pieces have one)."""
    return pieces.sources if isinstance(pieces, PackPieces) else [p[0] for p in pieces]


def _gaps(begin: np.ndarray, end: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``[n, 2]`` (offset, count) of the parts of ``[lo, hi)`` that no ``[begin, end)`` covers."""
    keep = end > begin
    begin, end = begin[keep], end[keep]
    if not bool((begin[1:] >= begin[:-1]).all()):  # a pack's ranges usually come in order already
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
                          np.array(each("numel", sources), dtype=np.int64)), zeros
    pieces = []
    for i, s in enumerate(slices):
        if isinstance(s, torch.Tensor) or not isinstance(s, (tuple, list)) or len(s) != 4:
            raise TypeError(f"slices[{i}] must be a (src, start, count, offset) tuple, got {show(s)}")
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
    return columns if within_index_limit(columns) else None


def pack_pieces(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
                window: tuple[int, int] | None = None) -> tuple[PackPieces, np.ndarray]:
    """The pieces and zero ranges of a pack: ``sources`` (flattened row-major) at element ``offsets``
    of a flat layout, zeros elsewhere; with ``window=(w0, w1)`` only elements ``[w0, w1)`` of that
    layout, written to ``dst[: w1 - w0]``."""
    check_dst(dst)
    sources = as_sequence("sources", sources)
    column = offsets if _is_offsets_column(offsets) else None
    offsets = offsets if column is not None else as_sequence("offsets", offsets)
    if len(sources) != len(offsets):
        raise ValueError(f"got {len(sources)} sources but {len(offsets)} offsets")
    w0, w1 = _window(window, dst)
    # One pass per fact over thousands of sources (the first turn of a fresh pack waits for this): a type per
    # source, then its numel; one at a time only to name a culprit.
    kinds = set(map(type, sources))
    if not all(issubclass(kind, torch.Tensor) for kind in kinds):
        for i, src in enumerate(sources):
            if not isinstance(src, torch.Tensor):
                raise TypeError(f"sources[{i}] must be a torch.Tensor, got {type(src).__name__} {show(src)}")
    numels = each_int64("numel", sources, kinds)
    begin = column if column is not None else offsets_column(offsets)
    end = begin + numels
    i = first_true(begin < 0)
    if i is not None:
        raise ValueError(f"offsets[{i}]={int(begin[i])} is negative")
    i = first_true(end > dst.numel()) if window is None else None
    if i is not None:
        raise ValueError(f"sources[{i}]: destination range [{int(begin[i])}, {int(end[i])}) does not "
                         f"fit in dst of {dst.numel()} elements")
    check_disjoint(begin, end, lambda k: f"sources[{k}]")
    # Each source's part inside the window; sources outside it still get validated, as empty pieces.
    lo, hi = np.maximum(begin, w0), np.minimum(end, w1)
    inside = lo < hi
    gaps = _gaps(lo[inside] - w0, hi[inside] - w0, 0, w1 - w0)
    pieces = PackPieces(list(sources), np.where(inside, lo - begin, 0), np.where(inside, hi - lo, 0),
                        np.where(inside, lo - w0, 0), end - begin, gaps)
    return pieces, gaps


def offsets_column(offsets: Sequence[int]) -> np.ndarray:
    """A pack's ``offsets`` (a sequence of ints) as an int64 column, or the error naming the first bad one."""
    if not set(map(type, offsets)) <= {int}:
        offsets = [o if type(o) is int else as_index(f"offsets[{i}]", o) for i, o in enumerate(offsets)]
    return int64_column(offsets, lambda i: f"offsets[{i}]")


def _is_offsets_column(offsets: object) -> bool:
    """Whether ``offsets`` is already what :func:`offsets_column` makes (a fresh pack's early turn made it):
    a 1-D int64 array in range, used as it is (never kept: the pieces' columns are computed from it)."""
    return type(offsets) is np.ndarray and offsets.dtype == np.int64 and offsets.ndim == 1 and \
        within_index_limit(offsets)  # not a subclass: a masked array's masked values would be read as offsets


def _window(window: tuple[int, int] | None, dst: torch.Tensor) -> tuple[int, int]:
    """A pack's ``window`` checked, as ``(w0, w1)``; all of dst for None."""
    if window is None:
        return 0, dst.numel()
    window = as_sequence("window", window)
    if len(window) != 2:
        raise ValueError(f"window must be None or (w0, w1), got {show(window)}")
    w0, w1 = as_index("window[0]", window[0]), as_index("window[1]", window[1])
    if not (0 <= w0 <= w1) or w1 - w0 > dst.numel():
        raise ValueError(f"window=({w0}, {w1}) must satisfy 0 <= w0 <= w1 and fit dst's {dst.numel()} elements")
    return w0, w1
