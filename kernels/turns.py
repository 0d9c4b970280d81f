"""A copy into a fresh buffer, in turns: check a turn's sources, start copying them, go on to the next.

:func:`~ztriton.kernels.plan.make_plan` checks every piece before the first byte is written, so that a bad
argument leaves ``dst`` as it was. Reading the sources' attributes for those checks is host work of about a
microsecond or more per tensor: for thousands of tensors, most of the copy's time, during which the device idles.

A buffer allocated for the result (a flatten's or a defragment's flat buffer, a rank's partition) holds nothing
anyone reads yet: a failure half way through leaves only a buffer that its caller drops. For such a ``dst`` the
pieces go in turns, and the device copies one turn while the host checks the next. The biggest pieces go first: the
device then has the most to copy while the host checks the many small ones (the order of the writes does not matter,
their destinations are disjoint), and the zero ranges go last. What never changes: what no turn could check alone
(destination ranges disjoint across the whole job, the zero ranges inside dst) is checked before any byte is
written, but for a pack's lead or first turn chosen by room (below); each turn is checked in full before its own
bytes are written, so nothing is ever written outside dst; the sources are only read; an error names the culprit by
its index in the whole job, as a single plan's would.

Turns pay only where the device has something to overlap: on the kernels' route (more than
``Tuning.torch_pieces`` pieces) and for pieces big enough that the device's copy of one takes longer than the
host's check of the next.

A pack (no window) starts one step sooner (:func:`pack_fresh`): what it copies first is chosen from the offsets
alone and copied before the whole job's pieces are built (a ``numel`` per source) and its destinations checked:
those then overlap the device's copy. Where some offset has room for a piece that could lead, that is the lead,
among the sources with such room (none taken: the whole job is read first); else a first turn, the sources with the
most room before the next offset. That turn copies each of its pieces' whole 16-byte words only, one launch of one
word class where the addresses allow; the tails (under 16 bytes each, which would add a launch per word class) go
with the rest of the job. The first turn's own pieces are checked in full before it is written (the lead's: the
lead's checks), so nothing is ever written outside dst; a fault elsewhere (two destinations overlapping, another
offset that is not an int) is then found after those writes, which a fresh dst allows, and raised as one plan raises
it.

Before any turn (or the one plan), the **lead**: the biggest pieces whose sources are plainly copyable (dst's dtype
and device, contiguous, in range, not in dst's memory) are copied by torch straight away, biggest first, right after
the whole-job checks (a pack's before them, above): one ``copy_`` of its bytes each (a memcpy), so the device starts
at once on the biggest pieces (a model's embeddings, fused experts) while the host plans the rest. Only pieces of
``LEAD_BYTES`` or more lead. A piece that fails a lead check is left to the plan, whose checks name it.

The measurements behind the constants below: ``bench/NOTES.md``, "Kernels: why the tuning is what it is".
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

import torch

from .checks import as_zero_ranges, check_disjoint, check_dst, each_int64
from .pieces import PackPieces, Piece, known_disjoint, pack_pieces
from .plan import check_launchable, make_plan, run_plan
from .state import torch_copies_lock
from .torch_route import flat_bytes
from .tuning import KERNELS_ONLY

__all__ = ["lead", "pack_fresh", "run_fresh", "schedule", "turns", "worth_turns"]

# The first turn is small, so that the device starts early on the biggest pieces; each next one is four times as
# big, so that a turn's fixed cost (one plan's checks, numpy, table upload and launches) is paid a few times only.
# Of the schedules compared, this one was among the fastest for jobs of hundreds to thousands of pieces. Jobs of
# up to MIN_PIECES pieces go as one plan: there is little to overlap.
FIRST_TURN = 64
GROWTH = 4
LAST_TURN = 1024
MIN_PIECES = 128
# A job whose pieces average fewer bytes goes as one plan: the device copies a piece this small in about the time
# the host takes to check one, so it would idle between turns anyway and the turns add only their fixed costs.
MIN_MEAN_BYTES = 4 << 20
# Pieces of at least this many bytes go first, as torch copies (module docstring): the device copies one of them
# in longer than the host takes to issue the next, so it stays ahead whatever the host. Smaller leads did not pay.
LEAD_BYTES = 256 << 20


def turns(n: int, first: int | None = None, growth: int | None = None, last: int | None = None
          ) -> Iterator[tuple[int, int]]:
    """``[a, b)`` index ranges that cover ``range(n)`` in order: ``first`` pieces, then ``growth`` times as many
    each turn, at most ``last`` (by default the module's FIRST_TURN, GROWTH and LAST_TURN, read at the call)."""
    size = FIRST_TURN if first is None else first
    growth = GROWTH if growth is None else growth
    last = LAST_TURN if last is None else last
    a = 0
    while a < n:
        b = min(n, a + size)
        yield a, b
        a, size = b, min(last, growth * size)


def schedule(pieces: PackPieces) -> list[np.ndarray]:
    """The pieces' indices, turn by turn: biggest first (ties in index order), in :func:`turns`' sizes."""
    return [indices for indices, _ in _in_turns(pieces)]


def _in_turns(pieces: PackPieces, first: int | None = None) -> Iterator[tuple[np.ndarray, bool]]:
    """:func:`schedule`'s turns, each with whether it is the last, the order found as they are asked for: the first
    turn's pieces without sorting them all, the rest sorted only when the second turn is asked for (in a fresh
    pack, while the device copies the first)."""
    bounds = list(turns(len(pieces), first))
    count = np.maximum(pieces.count, 0)
    for t, (a, b) in enumerate(bounds):
        if t == 0:
            order = _biggest(count, b)
        elif t == 1:
            order = np.concatenate([order, _rest_by_size(count, order)])
        yield order[a:b], t == len(bounds) - 1


def _biggest(count: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` biggest counts, biggest first, ties in index order: the first ``k`` of a stable
    sort by decreasing count, without sorting all of them (a fresh pack's first turn waits for this)."""
    n = len(count)
    if k >= n:
        return np.argsort(-count, kind="stable")
    kth = np.partition(count, n - k)[n - k]  # the k-th biggest count
    above = np.flatnonzero(count > kth)
    chosen = np.concatenate([above, np.flatnonzero(count == kth)[:k - len(above)]])  # each part in index order
    return chosen[np.argsort(-count[chosen], kind="stable")]


def _rest_by_size(count: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The indices not in ``first``, biggest first, ties in index order: the rest of :func:`_biggest`'s sort."""
    left = np.ones(len(count), dtype=bool)
    left[first] = False
    rest = np.flatnonzero(left)
    return rest[np.argsort(-count[rest], kind="stable")]


def worth_turns(dst: torch.Tensor, pieces: Sequence[Piece]) -> bool:
    """Whether :func:`run_fresh` copies ``pieces`` in turns rather than as one plan (module docstring)."""
    if not isinstance(pieces, PackPieces) or len(pieces) <= MIN_PIECES:
        return False
    moved = int(np.maximum(pieces.count, 0).sum()) * dst.element_size()
    return moved >= MIN_MEAN_BYTES * len(pieces)


def pack_fresh(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
               window: tuple[int, int] | None = None, meanwhile: Callable[[], None] | None = None) -> None:
    """:func:`~ztriton.kernels.ops.pack` into a ``dst`` just allocated for it: :func:`run_fresh` of the pack's
    pieces, after its lead or its first turn chosen from the offsets where the job allows (module docstring). The
    same bytes and, for a bad argument, the same error as one plan. ``meanwhile``: as :func:`run_fresh`'s."""
    meanwhile = _Meanwhile(meanwhile)
    first = _first_by_room(dst, sources, offsets) if window is None else None
    with meanwhile.first_on_error():
        if first is None:
            run_fresh(dst, *pack_pieces(dst, sources, offsets, window), meanwhile=meanwhile)
            return
        begin, chosen, bodies, led = first
        try:
            if led:  # the check of dst that a plan makes before it writes (check_dst passed: _first_by_room)
                check_launchable(dst)
                _copy_lead(dst, bodies, np.arange(len(bodies)))
            else:
                make_plan(dst, bodies, (), KERNELS_ONLY, run_now=True).launch()
        except (TypeError, ValueError):
            _raise_as_one_plan(dst, *pack_pieces(dst, sources, offsets), what="sources")
            raise
        # The other offsets' types, checked while the device copies: anything but ints, and pack_pieces converts
        # them again and names a bad one (its error, as one plan's).
        column = begin if set(map(type, offsets)) <= {int} else offsets
        run_fresh(dst, *pack_pieces(dst, sources, column), done=(chosen, bodies.count),
                  first_turn=None if led else FIRST_TURN * GROWTH, meanwhile=meanwhile)


class _Meanwhile:
    """A caller's host work (``pack``'s ``meanwhile``), run once: once the device has the job's first copies, or,
    where the job raises for a bad argument before that, first (so that the caller's checks, where they name the
    culprit, win over the job's)."""

    __slots__ = ("work",)

    def __init__(self, work: Callable[[], None] | None) -> None:
        self.work = work

    def __call__(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work()

    @contextmanager
    def first_on_error(self) -> Iterator[None]:
        try:
            yield
        except (TypeError, ValueError):
            self()
            raise


def _first_by_room(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int]
                   ) -> tuple[np.ndarray, np.ndarray, PackPieces, bool] | None:
    """The offsets as an int64 column, and the indices and pieces of what a pack copies first, chosen from the
    offsets, with whether they lead: where some offset has room for a piece that could lead, the sources with such
    room that :func:`lead` takes, else a first turn (:func:`_first_turn_by_room`) of whole words. Only
    the chosen offsets' types are checked here (ints; the others' after the first copy, :func:`pack_fresh`). None
    where the job goes as :func:`run_fresh` alone: offsets out of range, a chosen offset that is not an int, or a
    chosen source that is not a tensor or does not fit its room (the whole job's checks then name it), or nothing
    to choose. Never raises for a bad argument: that is for the checks that name it."""
    if not isinstance(dst, torch.Tensor) or not isinstance(sources, (list, tuple)) or \
            not isinstance(offsets, (list, tuple)) or len(offsets) != len(sources) or not len(sources):
        return None
    lead_elements = _lead_elements(dst)
    if len(sources) <= MIN_PIECES and dst.numel() < lead_elements:  # neither a lead nor turns: a small job
        return None
    try:  # any value int() takes: a float or a bool here is found by the type checks
        begin = np.fromiter(offsets, dtype=np.int64, count=len(sources))
    except Exception:  # noqa: BLE001 (whatever a value's int() raises: the checks that follow name the value)
        return None
    room = _room(begin, dst.numel())
    if room is None:
        return None
    leads = int(room.max()) >= lead_elements
    if leads:
        try:  # before lead() reads dst's address; a dst it refuses is named by the whole job's checks
            check_dst(dst)
        except (TypeError, ValueError):
            return None
    chosen = np.flatnonzero(room >= lead_elements) if leads else _first_turn_by_room(dst, room)
    if chosen is None:
        return None
    at = chosen.tolist()
    picked = [sources[i] for i in at]
    if not all(type(offsets[i]) is int for i in at) or not all(isinstance(src, torch.Tensor) for src in picked):
        return None
    count = each_int64("numel", picked)
    if bool((count > room[chosen]).any()):
        return None
    # Each inside its own room: their destinations are disjoint (so the plan need not check it again). A first
    # turn's piece is its source's whole 16-byte words; a source of less than one word goes with the rest: as an
    # empty piece here, its memory would not be checked against dst's before this turn writes.
    size = count if leads else _whole_words(count, dst.element_size())
    pieces = PackPieces(picked, np.zeros_like(count), size, begin[chosen], count, gaps=np.zeros((0, 2), np.int64))
    keep = lead(dst, pieces) if leads else np.flatnonzero(size > 0)
    if not len(keep):
        return None
    return begin, chosen[keep], pieces.take(keep, distinct=True), leads


def _first_turn_by_room(dst: torch.Tensor, room: np.ndarray) -> np.ndarray | None:
    """The indices of a pack's first turn: the FIRST_TURN sources with the most room before the next offset (dst's
    end for the last). None for a job of too few pieces or bytes for turns."""
    n = len(room)
    if n <= MIN_PIECES or dst.numel() * dst.element_size() < MIN_MEAN_BYTES * n:
        return None
    return _biggest(room, FIRST_TURN)


def _whole_words(count: np.ndarray, itemsize: int) -> np.ndarray:
    """Each count rounded down to whole 16-byte words of ``itemsize``-byte elements."""
    per_word = max(1, 16 // itemsize)
    return count - count % per_word


def _room(begin: np.ndarray, end: int) -> np.ndarray | None:
    """Each offset's distance to the next one up (in order of offset, ties in index order; ``end`` after the last),
    or None for offsets out of ``[0, end]``."""
    if int(begin.min()) < 0 or int(begin.max()) > end:
        return None
    gaps = np.empty_like(begin)  # inside [0, end]: no difference wraps
    np.subtract(begin[1:], begin[:-1], out=gaps[:-1])
    gaps[-1] = end - begin[-1]
    if int(gaps.min()) >= 0:  # in order already (a flatten's layout)
        return gaps
    order = np.argsort(begin, kind="stable")
    room = np.empty_like(begin)
    room[order] = np.diff(begin[order], append=end)
    return room


def run_fresh(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              what: str = "sources", done: tuple[np.ndarray, np.ndarray] | None = None,
              first_turn: int | None = None, meanwhile: Callable[[], None] | None = None) -> None:
    """:func:`~ztriton.kernels.plan.run_plan` for a ``dst`` that was just allocated for this result: the same
    copy and the same errors, but the biggest pieces are copied first (:func:`lead`) and the rest checked and
    copied in turns where that pays (:func:`worth_turns`). On an error raised after the first copy, dst holds part
    of the result (drop it). The sources are only read, as dst's contract requires: a source lying inside dst (which
    a just-allocated dst cannot hold) is refused, but only once its own turn is checked, possibly after earlier
    copies wrote over it. ``done``: ``(indices, copied)``, how many of their first elements those pieces had copied
    already (:func:`pack_fresh`'s lead or first turn): checked with the whole job, only the rest of each copied.
    ``first_turn``: the size of the first of the turns (default FIRST_TURN; after a first turn, the second's).
    ``meanwhile``: the caller's host work, run once, as soon as the device has enough to copy to hide it: after the
    lead and the first of the turns, or before the one plan where the job goes in none (:class:`_Meanwhile`)."""
    meanwhile = meanwhile if isinstance(meanwhile, _Meanwhile) else _Meanwhile(meanwhile)
    with meanwhile.first_on_error():
        _run_fresh(dst, pieces, zero_ranges, what, done, first_turn, meanwhile)
    meanwhile()  # every path above runs it; this only makes sure


def _run_fresh(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]], what: str,
               done: tuple[np.ndarray, np.ndarray] | None, first_turn: int | None, meanwhile: _Meanwhile) -> None:
    if done is None and (not isinstance(pieces, PackPieces) or not (_may_lead(dst, pieces) or
                                                                     worth_turns(dst, pieces))):
        meanwhile()
        run_plan(dst, pieces, zero_ranges, what=what)
        return
    check_dst(dst)
    with _errors_as_one_plan(dst, pieces, zero_ranges, what):
        zeros = as_zero_ranges(zero_ranges, dst)
        check_launchable(dst)  # as one plan's (after its checks of the pieces): even when every piece leads
        if not known_disjoint(pieces, zeros):  # a pack's pieces and gaps were checked by pack_pieces
            _check_destinations(dst, pieces, zeros, what)
    # In the job's order. A mask, not np.setdiff1d: its first call imports numpy.ma, slow in a fresh process.
    left = np.ones(len(pieces), dtype=bool)
    todo = pieces
    if done is not None:
        indices, copied = done
        todo = pieces.after(indices, copied)
        left[indices[todo.count[indices] == 0]] = False
    first = lead(dst, todo)
    first = first[left[first]]
    if len(first):
        _copy_lead(dst, todo, first)
        left[first] = False
    rest = todo if bool(left.all()) else todo.take(np.flatnonzero(left), distinct=True)
    if not worth_turns(dst, rest):
        meanwhile()
        if len(rest) or len(zeros):
            with _errors_as_one_plan(dst, pieces, zeros, what):
                run_plan(dst, rest, zeros, what=what)
        return
    no_zeros = zeros[:0]
    for indices, last in _in_turns(rest, first_turn):
        # The zero ranges last: thousands of pads are host work that the device's backlog hides by then.
        zeros_now = zeros if last else no_zeros
        with _errors_as_one_plan(dst, pieces, zeros, what):
            # The kernels always: a last turn of a few small pieces would otherwise
            # take torch's copies, with a view per zero range, and thousands of pads would cost milliseconds.
            make_plan(dst, rest.take(indices, distinct=True), zeros_now, KERNELS_ONLY, what=what,
                      run_now=True).launch()
        meanwhile()  # after the first turn's launch (then it does nothing)


def _may_lead(dst: torch.Tensor, pieces: PackPieces) -> bool:
    """Whether any piece is big enough to lead (from the columns: no source is read)."""
    return bool(len(_big_enough(dst, pieces)))


def _big_enough(dst: torch.Tensor, pieces: PackPieces) -> np.ndarray:
    """The indices of the pieces of at least ``LEAD_BYTES``, in index order."""
    return np.flatnonzero(pieces.count >= _lead_elements(dst))


def _lead_elements(dst: torch.Tensor) -> int:
    """``LEAD_BYTES`` in elements of dst, rounded up: the fewest a piece that leads has."""
    return -(-LEAD_BYTES // dst.element_size())


def lead(dst: torch.Tensor, pieces: PackPieces) -> np.ndarray:
    """The indices of the pieces :func:`run_fresh` copies first, biggest first (ties in index order): at least
    ``LEAD_BYTES`` each, and plainly copyable as bytes: a source of dst's dtype, layout and device, contiguous,
    without a lazy negation or conjugation, its range inside it, its destination inside dst, its memory (the
    whole source, as one plan checks it) outside dst's. Reads only the candidates' attributes; a candidate that
    fails is left to the plan's checks."""
    itemsize = dst.element_size()
    big = _big_enough(dst, pieces)
    if not len(big):
        return big
    big = big[np.argsort(-pieces.count[big], kind="stable")]
    dst_lo = dst.data_ptr()
    dst_hi = dst_lo + dst.numel() * itemsize
    keep = []
    for i in big.tolist():
        src = pieces.sources[i]
        start, count, offset = int(pieces.start[i]), int(pieces.count[i]), int(pieces.offset[i])
        if src.dtype != dst.dtype or src.layout != torch.strided or src.device != dst.device or \
                not src.is_contiguous() or src.is_neg() or src.is_conj():
            continue
        if start < 0 or start + count > src.numel() or offset < 0 or offset + count > dst.numel():
            continue
        lo = src.data_ptr()
        if lo < dst_hi and dst_lo < lo + src.numel() * itemsize:
            continue
        keep.append(i)
    return np.array(keep, dtype=np.int64)


def _copy_lead(dst: torch.Tensor, pieces: PackPieces, first: np.ndarray) -> None:
    """Copy the pieces ``first`` (checked by :func:`lead`) as bytes, one ``copy_`` each: a memcpy, whatever the
    dtype (bits move unchanged), issued on the current stream as the plans after it are."""
    itemsize = dst.element_size()
    inference = dst.is_inference() and not torch.is_inference_mode_enabled()
    with torch_copies_lock(), torch.inference_mode() if inference else torch.no_grad():
        out = flat_bytes(dst)
        for i in first.tolist():
            start, count, offset = int(pieces.start[i]) * itemsize, int(pieces.count[i]) * itemsize, \
                int(pieces.offset[i]) * itemsize
            src = pieces.sources[i]
            # Contiguous: its elements are its storage's from its offset on, whatever strides its size-1 dims carry.
            flat = src.as_strided((src.numel(),), (1,), src.storage_offset()).view(torch.uint8)
            out.narrow(0, offset, count).copy_(flat.narrow(0, start, count))


@contextmanager
def _errors_as_one_plan(dst: torch.Tensor, pieces: PackPieces, zeros: np.ndarray, what: str) -> Iterator[None]:
    """A check failing inside: run one plan's checks over the whole job first, so that the error raised is the one
    a single plan raises (its order: types, ranges, overlaps; the culprit named by its index in the whole job)."""
    try:
        yield
    except (TypeError, ValueError):
        _raise_as_one_plan(dst, pieces, zeros, what)
        raise


def _raise_as_one_plan(dst: torch.Tensor, pieces: Sequence[Piece], zeros, what: str) -> None:
    """Raise the error one plan of the whole job raises first, if any: its checks, then its planning's (a source's
    dims past the kernels' limit is found there, and named by its shape). Nothing is launched. A failure that is
    no argument's fault (memory for the plan's tables) is not raised: the caller's own error then stands."""
    try:
        make_plan(dst, pieces, zeros, what=what)
    except (TypeError, ValueError):
        raise
    except Exception:  # noqa: BLE001 (see the docstring)
        pass


def _check_destinations(dst: torch.Tensor, pieces: PackPieces, zeros: np.ndarray, what: str) -> None:
    """What no turn can check alone: no two destination ranges of the whole job overlap (nor a zero range).
    From the columns, before anything is written; each turn checks its own pieces' ranges again."""
    n = len(pieces)
    count = np.maximum(pieces.count, 0)
    check_disjoint(np.concatenate([pieces.offset, zeros[:, 0]]), np.concatenate([pieces.offset + count, zeros.sum(1)]),
                    lambda k: f"{what}[{k}]" if k < n else "a pad range")
