"""Argument coercion and the checks that need no pieces: integers are integers, sequences are sequences,
tensors are dense tensors with values, destination ranges do not overlap.

Each failure is a TypeError or ValueError naming the caller's argument, raised before any byte is written.
Every size and offset stays below 2**62, so that a sum of two still fits in int64.
"""
from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
import torch

__all__ = ["as_index", "as_sequence", "as_zero_ranges", "byte_extent", "byte_extents", "check_disjoint", "check_dst",
           "check_tensor", "each", "each_int64", "first_true", "int64_column", "merged_dims", "show", "within_index_limit"]

_INDEX_LIMIT = 2**62


def show(value: object) -> str:
    """``repr(value)`` cut to 60 characters, for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_index(name: str, value: object) -> int:
    """``value`` as a Python int (an int, a numpy integer or an integer 0-d tensor), else a TypeError
    naming ``name``: a float would be truncated and a bool is not a count. ValueError if it is too
    large for int64 arithmetic."""
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got the bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {show(value)}") from None
    if not -_INDEX_LIMIT < value < _INDEX_LIMIT:
        raise ValueError(f"{name}={value} is out of range: sizes and offsets must be below 2**62")
    return value


def as_sequence(name: str, value: object) -> Sequence:
    """``value`` if it is a list, tuple (or another sequence, or a 1-D array), else a TypeError naming
    ``name``; a lone tensor is refused rather than iterated over its first dim."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a list or tuple, got a torch.Tensor; wrap a single tensor in a list: [tensor]")
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list or tuple, got {type(value).__name__} {show(value)}")
    return value


def within_index_limit(values: np.ndarray) -> bool:
    """Every value strictly between -2**62 and 2**62 (compared, not through abs: abs(-2**63) wraps to itself)."""
    return not values.size or bool(((values > -_INDEX_LIMIT) & (values < _INDEX_LIMIT)).all())


def int64_column(values: list, name) -> np.ndarray:
    """``values`` (ints) as int64, or a ValueError naming the first one out of range (``name(i)``)."""
    try:
        column = np.array(values, dtype=np.int64)
        if within_index_limit(column):
            return column
    except OverflowError:
        pass
    for i, v in enumerate(values):
        if not -_INDEX_LIMIT < v < _INDEX_LIMIT:
            raise ValueError(f"{name(i)}={v} is out of range: sizes and offsets must be below 2**62")
    raise AssertionError("unreachable")  # pragma: no cover


def check_tensor(name: str, t: object) -> None:
    """A dense tensor that holds values: not sparse, not meta, no lazy conjugate or negation bit."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__} {show(t)}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; the kernels move dense (strided) tensors: pass "
                        "tensor.to_dense()")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and holds no values; materialise it first "
                         "(e.g. module.to_empty(device=...) and load its weights)")
    if t.is_neg() or (t.dtype.is_complex and t.is_conj()):
        raise ValueError(f"{name} is a lazy conjugate (or negated) view whose memory holds other values; "
                         "pass tensor.resolve_conj().resolve_neg()")


def check_dst(dst: torch.Tensor) -> None:
    """``dst`` a contiguous dense tensor with values: the kernels write it as one flat range."""
    check_tensor("dst", dst)
    if not dst.is_contiguous():
        raise ValueError(f"dst must be contiguous (shape {tuple(dst.shape)}, strides {dst.stride()}); "
                         "pass a contiguous buffer or a contiguous view of one")


def each(method: str, tensors: Sequence[torch.Tensor], kinds: set | None = None) -> list:
    """``[t.method() for t in tensors]``: through torch.Tensor's own method where every tensor's type (``kinds``,
    if the caller has them) inherits it unchanged, which skips each instance's attribute lookup (half the time of
    a read for an ``nn.Parameter``, whose class chain is longer); else each instance's own method. A method set on
    one instance (``t.numel = ...``) is not seen: the library reads tensors' own facts, never such overrides."""
    return list(map(_reader(method, tensors, kinds), tensors))


def each_int64(method: str, tensors: Sequence[torch.Tensor], kinds: set | None = None) -> np.ndarray:
    """:func:`each` of a method returning an int (``numel``, ``data_ptr``), as an int64 array filled as it reads."""
    return np.fromiter(map(_reader(method, tensors, kinds), tensors), dtype=np.int64, count=len(tensors))


def _reader(method: str, tensors: Sequence[torch.Tensor], kinds: set | None):
    """torch.Tensor's own ``method`` if every type in ``kinds`` (else the tensors' types) inherits it, else a
    function calling each instance's (:func:`each`)."""
    own = getattr(torch.Tensor, method)
    if kinds is None:
        kinds = set(map(type, tensors))
    if all(getattr(kind, method, None) is own for kind in kinds):
        return own
    return lambda t: getattr(t, method)()


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that a view touches (empty views touch nothing)."""
    lo, numel = t.data_ptr(), t.numel()
    if numel == 0:
        return lo, lo
    if t.is_contiguous():  # the common case, for thousands of params: no walk over the dims
        return lo, lo + numel * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return lo, lo + span * t.element_size()


def byte_extents(tensors: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`byte_extent` of each tensor as two int64 arrays (first bytes, ends): one read per attribute
    over all of them, and the walk over the dims only for the strided ones."""
    kinds = set(map(type, tensors))
    lo = np.array(each("data_ptr", tensors, kinds), dtype=np.int64)
    hi = lo + np.array(each("numel", tensors, kinds), dtype=np.int64) * \
        np.array(each("element_size", tensors, kinds), dtype=np.int64)
    for k in [k for k, dense in enumerate(each("is_contiguous", tensors, kinds)) if not dense]:
        hi[k] = byte_extent(tensors[k])[1]
    return lo, hi


def merged_dims(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes and strides of ``t`` with size-1 dims dropped and dims contiguous together merged."""
    sizes, strides = [], []
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == size * stride:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    return sizes, strides


def first_true(mask: np.ndarray) -> int | None:
    """The index of the first True in ``mask``, or None: the culprit an error names."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def check_disjoint(begin: np.ndarray, end: np.ndarray, names) -> None:
    """Destination ranges must not overlap, or the result would depend on the order of writes.

    ``names(k)`` names range k in an error. Empty ranges overlap nothing.
    """
    keep = np.flatnonzero(end > begin)
    if len(keep) < 2:
        return
    first = begin[keep]
    # A pack's or flatten's ranges usually come in order already: then no sort.
    order = keep if bool((first[1:] >= first[:-1]).all()) else keep[np.argsort(first, kind="stable")]
    reach = np.maximum.accumulate(end[order])
    k = first_true(begin[order][1:] < reach[:-1])
    if k is not None:
        a, b = int(order[np.argmax(end[order][:k + 1])]), int(order[k + 1])
        raise ValueError(f"{names(a)} (dst [{int(begin[a])}, {int(end[a])})) and {names(b)} "
                         f"(dst [{int(begin[b])}, {int(end[b])})) overlap in dst")


def as_zero_ranges(zero_ranges, dst: torch.Tensor) -> np.ndarray:
    """``(offset, count)`` pairs as an ``[n, 2]`` int64 array, each inside dst."""
    if isinstance(zero_ranges, np.ndarray) and zero_ranges.dtype == np.int64 and zero_ranges.ndim == 2:
        zeros = zero_ranges  # built by pieces.pack_pieces or slices_to_pieces: already integers
    else:
        pairs = as_sequence("zero_ranges", zero_ranges)
        flat = []
        for i, pair in enumerate(pairs):
            pair = as_sequence(f"zero_ranges[{i}]", pair)
            if len(pair) != 2:
                raise ValueError(f"zero_ranges[{i}] must be (offset, count), got {show(pair)}")
            flat += [as_index(f"zero_ranges[{i}] offset", pair[0]), as_index(f"zero_ranges[{i}] count", pair[1])]
        zeros = np.array(flat, dtype=np.int64).reshape(-1, 2)
    if not len(zeros):
        return zeros
    if not within_index_limit(zeros):
        i = int(np.flatnonzero(((zeros <= -_INDEX_LIMIT) | (zeros >= _INDEX_LIMIT)).any(1))[0])
        raise ValueError(f"zero range {i}: ({int(zeros[i, 0])}, {int(zeros[i, 1])}) is out of range: sizes and "
                         "offsets must be below 2**62")
    ends = zeros[:, 0] + zeros[:, 1]  # no overflow below 2**62
    if zeros.min() >= 0 and ends.max() <= dst.numel():  # the common case: a few reductions, no mask
        return zeros
    i = first_true((zeros[:, 0] < 0) | (zeros[:, 1] < 0) | (ends > dst.numel()))
    if i is not None:
        o, c = int(zeros[i, 0]), int(zeros[i, 1])
        raise ValueError(f"zero range [{o}, {o + c}) does not fit in dst of {dst.numel()} elements")
    return zeros
