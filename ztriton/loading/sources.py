"""How a model tensor is built from checkpoint tensors, and which of their elements a window needs.

A :data:`Source` is a tree: :class:`Key` (one checkpoint tensor as stored), :class:`Stack`
(``torch.stack(parts, dim)``) and :class:`Concat` (``torch.cat(parts, dim)``), nestable (Mixtral's
fused ``gate_up_proj`` is a stack over experts of a concat of ``w1`` and ``w3``).

:func:`resolve_window` maps a flat element window ``[begin, end)`` of the row-major flattening of
the built tensor to :class:`Span` s ``(key, start, count, offset)``: elements ``[start, start +
count)`` of checkpoint tensor ``key``'s flattening go to element ``offset`` of the window. Nothing is
materialised: only shapes are looked at, and the work grows with the number of spans, not the window.

The arithmetic: both a stack and a concat along ``dim`` lay the built tensor out as ``outer`` rows
(the product of the dims before ``dim``), each row the parts' blocks side by side; part ``i``
contributes ``width_i`` contiguous elements of its own flattening to every row (``width_i`` =
its elements from ``dim`` on; for a stack, a part's dim ``dim`` is a new dim of size 1). So element
``row * L + col`` of the built tensor (``L = sum(width)``) is element ``row * width_i + col - C_i``
of part ``i``, where ``C_i <= col < C_i + width_i``. Windows are arrays, so a window cut into many
rows is handled by numpy, not by a Python loop per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence, Union

import numpy as np

from ztriton.layout import is_int

__all__ = ["Key", "Stack", "Concat", "Source", "Span", "SourceError", "leaf_keys", "built_shape", "resolve_window"]


class SourceError(ValueError):
    """A source tree that cannot be built from the given shapes (wrong dims, parts that do not fit)."""


@dataclass(frozen=True)
class Key:
    """One checkpoint tensor, exactly as stored (its dtype, its shape)."""

    name: str

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"Key name must be a str, got {type(self.name).__name__}")


def _check_parts(kind: str, parts: object, dim: object) -> tuple:
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence):
        raise TypeError(f"{kind} parts must be a tuple of sources, got {type(parts).__name__}")
    parts = tuple(parts)
    if not parts:
        raise ValueError(f"{kind} needs at least one part")
    for i, part in enumerate(parts):
        if not isinstance(part, (Key, Stack, Concat)):
            raise TypeError(f"{kind} part {i} must be a Key, Stack or Concat, got {type(part).__name__}")
    if not is_int(dim):
        raise TypeError(f"{kind} dim must be an int, got {dim!r}")
    return parts


@dataclass(frozen=True)
class _Joined:
    """Parts of one shape (but along ``dim`` for a concat) joined along ``dim``; checked on construction."""

    parts: tuple
    dim: int = 0

    def __post_init__(self):
        object.__setattr__(self, "parts", _check_parts(type(self).__name__, self.parts, self.dim))


class Stack(_Joined):
    """``torch.stack(parts, dim)``: parts of one shape, along a new dim."""


class Concat(_Joined):
    """``torch.cat(parts, dim)``: parts of one shape except along ``dim``."""


Source = Union[Key, Stack, Concat]


class Span(NamedTuple):
    """Elements ``[start, start + count)`` of checkpoint tensor ``key`` go to ``offset`` in the window."""

    key: str
    start: int
    count: int
    offset: int


def leaf_keys(source: Source) -> list[str]:
    """The checkpoint tensors ``source`` reads, each once, in first-use order."""
    seen: dict[str, None] = {}
    todo = [source]
    while todo:
        node = todo.pop()
        if isinstance(node, Key):
            seen.setdefault(node.name)
        else:
            todo.extend(reversed(node.parts))
    return list(seen)


class _Shapes:
    """Built shapes of the nodes of one tree, computed once per node (keyed by identity: a node may be
    shared, and hashing frozen trees over and over would cost more than the arithmetic)."""

    def __init__(self, leaves: Mapping[str, Sequence[int]]):
        self.leaves = leaves
        self.cache: dict[int, tuple[int, ...]] = {}

    def of(self, node: Source) -> tuple[int, ...]:
        shape = self.cache.get(id(node))
        if shape is None:
            shape = self._build(node)
            self.cache[id(node)] = shape
        return shape

    def _build(self, node: Source) -> tuple[int, ...]:
        if isinstance(node, Key):
            if node.name not in self.leaves:
                raise SourceError(f"no shape for checkpoint tensor {node.name!r}")
            return tuple(int(d) for d in self.leaves[node.name])
        shapes = [self.of(part) for part in node.parts]
        first = shapes[0]
        if isinstance(node, Stack):
            d = _normalize_dim(node, len(first) + 1)
            for i, shape in enumerate(shapes):
                if shape != first:
                    raise SourceError(f"{_describe(node)}: part {i} ({_describe(node.parts[i])}) has shape {shape} "
                                      f"but part 0 ({_describe(node.parts[0])}) has {first}; stacked parts must "
                                      "have one shape")
            return first[:d] + (len(shapes),) + first[d:]
        d = _normalize_dim(node, len(first))
        for i, shape in enumerate(shapes):
            if len(shape) != len(first) or shape[:d] + shape[d + 1:] != first[:d] + first[d + 1:]:
                raise SourceError(f"{_describe(node)}: part {i} ({_describe(node.parts[i])}) has shape {shape} "
                                  f"but part 0 ({_describe(node.parts[0])}) has {first}; concatenated parts must "
                                  f"agree on every dim but {node.dim}")
        return first[:d] + (sum(s[d] for s in shapes),) + first[d + 1:]

    def rows(self, node: Stack | Concat) -> tuple[int, list[int]]:
        """(number of rows, elements each part gives every row): see the module docstring."""
        shapes = [self.of(part) for part in node.parts]
        if isinstance(node, Stack):
            d = _normalize_dim(node, len(shapes[0]) + 1)
            return math.prod(shapes[0][:d]), [math.prod(s[d:]) for s in shapes]
        d = _normalize_dim(node, len(shapes[0]))
        return math.prod(shapes[0][:d]), [math.prod(s[d:]) for s in shapes]


def _normalize_dim(node: Stack | Concat, ndim: int) -> int:
    """``node.dim`` in ``[0, ndim)`` (``ndim``: dims of the built tensor), negative dims counted from the end."""
    if ndim == 0 or not -ndim <= node.dim < ndim:
        kind = "a stack builds" if isinstance(node, Stack) else "a concat of them has"
        raise SourceError(f"{_describe(node)}: dim {node.dim} is out of range: {kind} {ndim} dims "
                          f"(valid: {-ndim} to {ndim - 1})" if ndim else
                          f"{_describe(node)}: cannot concatenate 0-d tensors")
    return node.dim % ndim


def _describe(node: Source, depth: int = 0) -> str:
    """A short repr for errors: nested parts elided past two levels."""
    if isinstance(node, Key):
        return f"Key({node.name!r})"
    kind = type(node).__name__
    if depth >= 1:
        return f"{kind}(<{len(node.parts)} parts>, dim={node.dim})"
    inner = ", ".join(_describe(p, depth + 1) for p in node.parts[:3])
    more = f", ... {len(node.parts) - 3} more" if len(node.parts) > 3 else ""
    return f"{kind}(({inner}{more}), dim={node.dim})"


def built_shape(source: Source, shapes: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    """The shape of the tensor ``source`` builds from checkpoint tensors of ``shapes``; SourceError if
    it cannot be built."""
    return _Shapes(shapes).of(source)


def _merge(start: np.ndarray, count: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, ...]:
    """Join neighbours (sorted by offset) that continue each other on both sides."""
    if len(start) < 2:
        return start, count, offset
    joins = (start[:-1] + count[:-1] == start[1:]) & (offset[:-1] + count[:-1] == offset[1:])
    head = np.flatnonzero(np.concatenate([[True], ~joins]))
    return start[head], np.add.reduceat(count, head), offset[head]


def _split_rows(start: np.ndarray, count: np.ndarray, offset: np.ndarray, row_len: int):
    """Cut each window at row boundaries: (row, first column, end column, window offset) per piece."""
    first = start // row_len
    rows_per = (start + count - 1) // row_len - first + 1
    which = np.repeat(np.arange(len(start)), rows_per)
    within = np.arange(int(rows_per.sum())) - np.repeat(np.cumsum(rows_per) - rows_per, rows_per)
    row = first[which] + within
    base = row * row_len
    lo = np.maximum(start[which], base) - base
    hi = np.minimum(start[which] + count[which], base + row_len) - base
    return row, lo, hi, offset[which] + base + lo - start[which]


def _resolve(node: Source, shapes: _Shapes, start: np.ndarray, count: np.ndarray, offset: np.ndarray,
             found: dict[str, list]) -> None:
    if len(start) == 0:
        return
    if isinstance(node, Key):
        found.setdefault(node.name, []).append((start, count, offset))
        return
    _, widths = shapes.rows(node)
    row_len = sum(widths)
    if row_len == 0:
        return
    row, lo, hi, dst = _split_rows(start, count, offset, row_len)
    column = 0
    for part, width in zip(node.parts, widths):
        a, b = np.maximum(lo, column), np.minimum(hi, column + width)
        keep = np.flatnonzero(b > a)
        if len(keep):
            child = _merge(row[keep] * width + a[keep] - column, (b - a)[keep], dst[keep] + a[keep] - lo[keep])
            _resolve(part, shapes, *child, found)
        column += width


def resolve_window(source: Source, shapes: Mapping[str, Sequence[int]], begin: int, end: int) -> list[Span]:
    """The spans of checkpoint tensors that make elements ``[begin, end)`` of the tensor ``source``
    builds, sorted by window offset, neighbours merged; they cover ``[0, end - begin)`` exactly once."""
    tree = _Shapes(shapes)
    numel = math.prod(tree.of(source))
    if not 0 <= begin <= end <= numel:
        raise SourceError(f"window [{begin}, {end}) is outside the {numel} elements {_describe(source)} builds")
    found: dict[str, list] = {}
    if end > begin:
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        _resolve(source, tree, one(begin), one(end - begin), one(0), found)
    spans = []
    for key, parts in found.items():
        start, count, offset = (np.concatenate(column) for column in zip(*parts))
        order = np.argsort(offset, kind="stable")
        start, count, offset = _merge(start[order], count[order], offset[order])
        spans.extend(Span(key, s, c, o) for s, c, o in zip(start.tolist(), count.tolist(), offset.tolist()))
    spans.sort(key=lambda span: span.offset)
    return spans
