"""The kernels' variants: the constexprs and launch options (``meta``) of every launch the tables make, as plain
values, and the list of them a cache fill compiles.

A launch names its kernel and its meta by plain values (``WORD`` by the integer type's name), so that a launch
from the compiled cache needs no triton object; :func:`jit_kwargs` turns a meta into the JIT's keyword arguments.
Every variant the tables can produce comes from :func:`word_meta` or :func:`gather_meta`, so a fill that walks
:func:`every_variant` compiles exactly what launches ask for.
"""
from __future__ import annotations

from typing import Any, Iterator

from .descriptor import DESC_HEAD, MAX_DIMS
from .tuning import Tuning
from .words import word_bytes

__all__ = ["GATHER", "WORD_COPY", "common_variants", "every_variant", "gather_meta", "jit_kwargs", "word_meta"]

WORD_COPY = "copy_words_kernel"
GATHER = "gather_tile_kernel"
# The integer a word of each width moves as (16-byte words as pairs of int64).
_INT_NAME = {16: "int64", 8: "int64", 4: "int32", 2: "int16", 1: "int8"}
_WORD_UNITS = (16, 8, 4, 2, 1)
_ITEMSIZES = (8, 4, 2, 1)


def word_meta(unit: int, tuning: Tuning) -> dict[str, Any]:
    """The word copy's meta for words of ``unit`` bytes."""
    word = word_bytes(unit)
    return dict(WORD=_INT_NAME[unit], VEC=unit // word, BLOCK=tuning.step_bytes // word,
                CHUNK=tuning.program_bytes // word, STREAM=tuning.stream, num_warps=tuning.num_warps)


def gather_meta(itemsize: int, tile_class: tuple, tuning: Tuning) -> dict[str, Any]:
    """The gather's meta for elements of ``itemsize`` bytes and one tile class (``tables._tile_class``:
    P_UNIT, C_UNIT, SRC_ALIGN, DST_ALIGN, SIZE_ALIGN, SMALL)."""
    p_unit, c_unit, src_align, dst_align, size_align, small = tile_class
    return dict(WORD=_INT_NAME[itemsize], MAX_DIMS=MAX_DIMS, DESC_HEAD=DESC_HEAD, BLOCK_P=tuning.tile_p,
                BLOCK_C=tuning.tile_c, P_UNIT=bool(p_unit), C_UNIT=bool(c_unit), SRC_ALIGN=int(src_align),
                DST_ALIGN=int(dst_align), SIZE_ALIGN=int(size_align), SMALL=bool(small), num_warps=tuning.tile_warps)


def jit_kwargs(meta: dict[str, Any], dtypes: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as Triton's JIT takes it: ``WORD`` as the triton type of that name (``dtypes``)."""
    return dict(meta, WORD=dtypes[meta["WORD"]])


def _aligns(itemsize: int) -> list[int]:
    """Alignments in elements a tile class can name: powers of two up to 16 bytes' worth."""
    return [a for a in (1, 2, 4, 8, 16) if a * itemsize <= 16]


def every_variant(tuning: Tuning = Tuning()) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (kernel, meta) the tables can launch with ``tuning``: all word classes, every tile class of every
    element size (about 1,800 gathers: a full fill takes minutes)."""
    for unit in _WORD_UNITS:
        yield WORD_COPY, word_meta(unit, tuning)
    for itemsize in _ITEMSIZES:
        aligns = _aligns(itemsize)
        for p_unit in (False, True):
            for c_unit in (False, True):
                for src in aligns:
                    for dst in aligns:
                        for size in aligns:
                            for small in (True, False):
                                yield GATHER, gather_meta(itemsize, (p_unit, c_unit, src, dst, size, small), tuning)


def common_variants(tuning: Tuning = Tuning()) -> Iterator[tuple[str, dict[str, Any]]]:
    """The variants real jobs use most: every word class, and per element size the gathers of sources whose
    addresses, strides and sizes are 16-byte aligned (a model's transposed or sliced weights) or not aligned at
    all, each with either dim unit-strided. Any other variant is compiled by the first launch that needs it."""
    for unit in _WORD_UNITS:
        yield WORD_COPY, word_meta(unit, tuning)
    for itemsize in _ITEMSIZES:
        for align in sorted({1, _aligns(itemsize)[-1]}, reverse=True):
            for p_unit, c_unit in ((False, True), (True, False), (False, False)):
                yield GATHER, gather_meta(itemsize, (p_unit, c_unit, align, align, align, True), tuning)
