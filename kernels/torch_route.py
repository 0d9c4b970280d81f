"""Torch's route (:func:`torch_copy_plan`): a plan whose pieces are all contiguous, copied by torch's own calls
instead of the kernels (``plan.py`` says when: a few contiguous pieces).

Everything moves on integer views of the flattened tensors (the widest word every destination range is aligned
to; bytes at worst), as the kernels see them: offsets count elements of dst's flattening whatever its shape, and
bits move unchanged (bool bytes other than 0 and 1, NaN payloads, fp4 pairs, which torch would convert,
canonicalise or refuse as their own dtypes). Pieces that continue each other in one storage and in dst are
copied as one run. Runs and gaps side by side in dst go as one ``torch.cat(out=)`` (``Tuning.cat_items``): one
call of host time for any number of pieces. Of the others, big runs get a ``copy_`` each
(``Tuning.own_copy_bytes``), the rest ``torch._foreach_copy_`` per word width, unless there are only a few
(``Tuning.foreach_from``). Views are made and written without autograd.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .launch import Plan, launch_stream
from .pieces import Piece, sources_of
from .state import torch_copies_lock
from .tuning import Tuning
from .validation import Sources
from .words import INT_OF_WIDTH, common_word

__all__ = ["flat_bytes", "torch_copy_plan"]


def torch_copy_plan(dst: torch.Tensor, pieces: Sequence[Piece], srcs: Sources, zeros: np.ndarray,
                    keep_alive: list, tuning: Tuning, run_now: bool = False) -> Plan:
    """The plan that copies validated contiguous ``pieces`` and zeroes ``zeros`` with torch. ``run_now``: each
    copy is issued as soon as its views exist (a ``_foreach_copy_`` once ``Tuning.batch_pieces`` pieces of its
    width are ready), so the device starts while the host makes the rest; nothing is left to launch."""
    route = _route(dst, pieces, srcs, zeros, tuning)
    runs, word, words = route.runs, route.word, route.words
    with torch_copies_lock() if run_now else nullcontext(), torch.no_grad():
        out = flat_bytes(dst).view(words)
        # dst's views only for what is copied or zeroed alone: a cat writes one view of its whole span.
        outs = _cut(out, list(zip((runs.offset[route.alone_runs] // word).tolist(),
                                  (runs.nbytes[route.alone_runs] // word).tolist())),
                    [(offset // word, count // word) for offset, count in route.gaps[route.alone_gaps].tolist()])
        copies, batches = _lone_copies(route, outs, tuning.batch_pieces, run_now)
        # (after the lone copies: under run_now the device starts on them while these views are made)
        sources = runs.joined_views(route.joined_runs, route.aligned, words)
        cats, zero = _cats(out, route.joined, sources, route.item_offset // word, route.item_nbytes // word,
                           len(runs.sources), words) if route.joined else ([], None)
        fills = outs[len(route.alone_runs):]
        if run_now:
            Plan([], keep_alive, [], None, [], batches, fills, zero_each=route.zero_each,
                 cats=cats).copy_with_torch()
            return Plan([], keep_alive, [], launch_stream(dst))
    # Views made in inference mode are inference tensors even of a normal dst: launched outside it, they must
    # be written inside it again. The zero buffer, made and filled on this stream, goes with the tables: a launch
    # on another stream waits for it and keeps its memory from reuse until that stream has read it.
    return Plan([], keep_alive, [] if zero is None else [zero], launch_stream(dst), copies, batches,
                fills, out.is_inference(), route.zero_each, cats)


@dataclass
class _Route:
    """How torch's route moves a plan's runs and gaps (:func:`_route`): all in bytes of dst, runs first, then gaps."""

    runs: _CopyRuns
    gaps: np.ndarray  # [n, 2]: offset, bytes
    word: int  # the widest integer word every destination range is aligned to
    words: torch.dtype  # the integer dtype of that width
    aligned: np.ndarray  # per run: its source can be viewed as words too (else it moves as bytes)
    item_offset: np.ndarray  # the runs' and gaps' offsets, as one column
    item_nbytes: np.ndarray
    joined: list[list[int]]  # items that one torch.cat each writes (:func:`_joined`)
    alone_runs: np.ndarray  # runs copied alone
    alone_gaps: np.ndarray  # gaps zeroed alone
    own: np.ndarray  # per run: its own copy_ if alone (else a _foreach_copy_ batch)
    zero_each: bool  # the lone gaps: a zero_ each (else one _foreach_zero_)

    @property
    def joined_runs(self) -> np.ndarray:
        n_runs = len(self.runs.sources)
        return np.array([i for items in self.joined for i in items if i < n_runs], dtype=np.int64)


def _route(dst: torch.Tensor, pieces: Sequence[Piece], srcs: Sources, zeros: np.ndarray, tuning: Tuning) -> _Route:
    """Decide :func:`torch_copy_plan`'s route (no tensor is made here): the runs, the word, which items a cat
    joins and how the others are copied or zeroed."""
    width = dst.element_size()
    live = np.flatnonzero(srcs.count > 0)
    gaps = zeros[zeros[:, 1] > 0] * width
    runs = _copy_runs(sources_of(pieces), live, srcs, width)
    # dst's views must be whole words of its storage, and (for _foreach_copy_'s vector loads) at word addresses.
    word = common_word(np.concatenate([runs.offset, runs.nbytes, gaps.reshape(-1),
                                      [dst.storage_offset() * width, dst.numel() * width, dst.data_ptr()]]))
    aligned = runs.aligned_to(word)
    n_runs = len(runs.sources)
    item_offset, item_nbytes = np.concatenate([runs.offset, gaps[:, 0]]), np.concatenate([runs.nbytes, gaps[:, 1]])
    # Only sources on dst's device join a cat (torch.cat would move a host source to the device first, whole).
    joined = _joined(item_offset, item_nbytes,
                     np.concatenate([aligned & runs.local, gaps[:, 1] <= tuning.cat_gap_bytes]), tuning.cat_items)
    alone = np.ones(n_runs + len(gaps), dtype=bool)
    for items in joined:
        alone[items] = False
    own = runs.nbytes >= tuning.own_copy_bytes
    if int(alone[:n_runs].sum()) <= tuning.foreach_from:
        own[:] = True
    return _Route(runs, gaps, word, INT_OF_WIDTH[word], aligned, item_offset, item_nbytes, joined,
                  np.flatnonzero(alone[:n_runs]), np.flatnonzero(alone[n_runs:]), own,
                  int(alone[n_runs:].sum()) <= tuning.foreach_from)


def _lone_copies(route: _Route, outs: list[torch.Tensor], batch_pieces: int, run_now: bool
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[list, list]]]:
    """The runs copied alone (``outs``: their views of dst, in :attr:`_Route.alone_runs`' order): each own copy
    ``(into, view)``, and the ``_foreach_copy_`` batches per word width. ``run_now``: an own copy is issued at
    once, a batch as soon as it holds ``batch_pieces``; what is returned is what is left to issue."""
    copies, batches = [], {}
    for r, into in zip(route.alone_runs.tolist(), outs):
        view, into = route.runs.views(r, into, route.words if route.aligned[r] else torch.uint8)
        if route.own[r]:
            if run_now:
                into.copy_(view)
            else:
                copies.append((into, view))
        else:
            batch = batches.setdefault(view.dtype, ([], []))
            batch[0].append(into)
            batch[1].append(view)
            if run_now and len(batch[0]) >= batch_pieces:
                torch._foreach_copy_(*batch)
                del batches[view.dtype]
    return copies, list(batches.values())


def _joined(offset: np.ndarray, nbytes: np.ndarray, joinable: np.ndarray, at_least: int) -> list[list[int]]:
    """Groups of items (by index) that follow one another in dst, each item starting where the one before it
    ends, all ``joinable``, at least ``at_least`` of them (0: none), each group in dst order."""
    n = len(offset)
    if at_least <= 0 or n < max(at_least, 2):
        return []
    order = np.argsort(offset, kind="stable")
    start, end, ok = offset[order], (offset + nbytes)[order], joinable[order]
    touch = (start[1:] == end[:-1]) & ok[1:] & ok[:-1]
    heads = np.flatnonzero(np.concatenate([[True], ~touch]))
    ends = np.append(heads[1:], n)
    return [order[h:e].tolist() for h, e in zip(heads.tolist(), ends.tolist()) if e - h >= max(at_least, 2)]


def _cats(out: torch.Tensor, joined: list[list[int]], sources: dict, offset: np.ndarray, count: np.ndarray,
          n_runs: int, words: torch.dtype) -> tuple[list[tuple[torch.Tensor, list]], torch.Tensor | None]:
    """One ``(out view, inputs)`` per group of :func:`_joined` (items' ``offset`` and ``count`` in elements of
    ``out``, runs first, then gaps): its runs' source views and, for its gaps, views of one zero buffer (as long as
    the longest gap), in dst order; and that buffer (None without gaps)."""
    longest = max((int(count[i]) for items in joined for i in items if i >= n_runs), default=0)
    zero = torch.zeros(longest, dtype=words, device=out.device) if longest else None
    cats = []
    for items in joined:
        inputs = [sources[i] if i < n_runs else zero.narrow(0, 0, int(count[i])) for i in items]
        cats.append((out.narrow(0, int(offset[items[0]]), int(count[items].sum())), inputs))
    return cats, zero


@dataclass
class _CopyRuns:
    """The torch route's copies, in bytes: each run is one piece, or several pieces that continue each other in
    one storage and in dst (:func:`_runs`), copied as one."""

    sources: list  # each run's first source
    first: np.ndarray  # the run's first byte in its source's storage
    start: np.ndarray  # the run's first byte in its source's flattening
    nbytes: np.ndarray
    offset: np.ndarray  # in dst
    alone: np.ndarray  # a single piece
    whole: np.ndarray  # a single piece that is its whole source
    source_words: np.ndarray  # bytes its source's storage offset and size share (a single piece's word bound)
    address: np.ndarray  # the run's first source byte in memory
    local: np.ndarray  # its source is on dst's device

    def aligned_to(self, word: int) -> np.ndarray:
        """Runs whose source side can be viewed as ``word``-byte integers: a single piece whose source starts on
        a word in its storage, holds whole words and whose start is on one; a run of several, one view of their
        storage, if it starts on a word; either only at a word address (a storage may start anywhere, e.g. one
        imported through DLPack, and CUDA's vector loads need the address). The others move as bytes."""
        in_storage = np.where(self.alone, (self.source_words | self.start) % word == 0, self.first % word == 0)
        return in_storage & (self.address % word == 0)

    def views(self, r: int, into: torch.Tensor | None, words: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``r``'s source bytes and ``into`` (its part of dst; None: not wanted), both as ``words``."""
        view = row_major_1d(self.sources[r])
        unit = words.itemsize
        if not self.alone[r]:
            view = view.view(torch.uint8).as_strided((int(self.nbytes[r]),), (1,), int(self.first[r]))
        if view.dtype != words:
            view = view.view(words)
        if into is not None and into.dtype != words:
            into = into.view(words)
        if self.alone[r] and not self.whole[r]:
            view = view.narrow(0, int(self.start[r]) // unit, int(self.nbytes[r]) // unit)
        return view, into

    def joined_views(self, joined: np.ndarray, aligned: np.ndarray, words: torch.dtype) -> dict[int, torch.Tensor]:
        """The source views of the runs a cat joins, by run: a whole source (a flatten's every param) in one
        pass of at most two views each (hundreds of them, each a few microseconds of a fresh process's host),
        the others through :meth:`views`."""
        plain = (self.whole & aligned)[joined].tolist()
        views = {}
        for r, is_plain in zip(joined.tolist(), plain):
            if is_plain:
                view = row_major_1d(self.sources[r])
                views[r] = view if view.dtype == words else view.view(words)
            else:
                views[r] = self.views(r, None, words if aligned[r] else torch.uint8)[0]
        return views


def _copy_runs(every: list, live: np.ndarray, srcs: Sources, width: int) -> _CopyRuns:
    """The non-empty pieces as :class:`_CopyRuns`."""
    starts, counts, offsets, numels = (column[live] * width for column in (srcs.start, srcs.count, srcs.offset,
                                                                            srcs.numel))
    sources = [every[i] for i in live.tolist()]
    first = np.array([s.storage_offset() for s in sources], dtype=np.int64) * width  # in its storage, bytes
    heads, ends = _runs(sources, srcs.lo[live] - first, first + starts, counts, offsets)
    alone = ends - heads == 1
    return _CopyRuns([sources[k] for k in heads.tolist()], (first + starts)[heads], starts[heads],
                     np.add.reduceat(counts, heads) if len(heads) else counts, offsets[heads], alone,
                     alone & ((starts == 0) & (counts == numels))[heads], (first | numels)[heads],
                     (srcs.lo[live] + starts)[heads], srcs.local[live][heads])


def _runs(sources: list, bases: np.ndarray, firsts: np.ndarray, counts: np.ndarray, offsets: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """``[head, end)`` index ranges of consecutive pieces that continue each other both in one storage (the same
    ``bases``, the address its storage starts at; ``firsts``, each piece's first byte in it) and in dst
    (``offsets``), all in bytes: a defragment's partitions still side by side in their module's buffer. Each run
    is copied as one. A run that would reach past its first source's storage (a tensor made over another's
    memory) is split back into its pieces."""
    n = len(counts)
    if n == 0:
        return np.arange(0), np.arange(0)
    follows = (bases[1:] == bases[:-1]) & (firsts[1:] == firsts[:-1] + counts[:-1]) & \
        (offsets[1:] == offsets[:-1] + counts[:-1])
    heads = np.flatnonzero(np.concatenate([[True], ~follows]))
    ends = np.append(heads[1:], n)
    reach = np.add.reduceat(counts, heads) + firsts[heads]
    too_far = [r for r in np.flatnonzero(ends - heads > 1).tolist()
               if reach[r] > sources[heads[r]].untyped_storage().nbytes()]
    if too_far:
        heads = np.union1d(heads, np.concatenate([np.arange(heads[r], ends[r]) for r in too_far]))
        ends = np.append(heads[1:], n)
    return heads, ends


def _cut(out: torch.Tensor, pieces: list[tuple[int, int]], gaps: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``out`` at each ``(offset, length)`` of ``pieces`` then ``gaps`` (elements of ``out``), in that
    order: one ``split`` of the span they cover when together they tile it (they are disjoint, as validated: a
    pack, a partition, or one turn of either), else a ``narrow`` each (a split costs less host time per view)."""
    segments = pieces + gaps
    if not segments:
        return []
    order = sorted(range(len(segments)), key=lambda k: segments[k][0])
    lo = segments[order[0]][0]
    span = sum(length for _, length in segments)
    if max(offset + length for offset, length in segments) - lo != span:
        return [out.narrow(0, offset, length) for offset, length in segments]
    views = out.narrow(0, lo, span).split([segments[k][1] for k in order])
    placed = [None] * len(segments)
    for k, view in zip(order, views):
        placed[k] = view
    return placed


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements, row-major, as a flat uint8 view (no copy). Its callers make it under
    ``torch.no_grad``: a tensor that requires grad then gets no autograd view bookkeeping."""
    return row_major_1d(t).view(torch.uint8)


def row_major_1d(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a 1-d view of stride 1 (no copy). torch calls a tensor contiguous whatever the
    strides of its size-1 dims (a 1-element slice of stride 3 is one), and a dtype view needs stride 1."""
    return t if t.dim() == 1 and t.stride(0) == 1 else t.as_strided((t.numel(),), (1,))
