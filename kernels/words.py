"""Word widths: the integers the copies move, and the widest of them that divides given offsets and sizes.

Copies move bits, never values: every dtype is viewed as integers of its width. A word is 16, 8, 4, 2 or 1
bytes; neither triton nor torch has a 16-byte integer, so 16-byte words travel as pairs of int64.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["INT_OF_WIDTH", "ITEMSIZES", "common_word", "integer_view", "units", "word_bytes", "word_unit"]

# Element sizes the kernels move as integers of that width (16-byte elements move as pairs of 8).
ITEMSIZES = (8, 4, 2, 1)
# Integer dtypes by width in bytes: the views torch copies through (integer copies never convert a bit).
INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def integer_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as integers of their width, in its shape and without a copy; 16-byte elements
    (complex128) as pairs of int64, flattened (copied only where they are not contiguous)."""
    if tensor.element_size() == 16:
        return tensor.reshape(-1).contiguous().view(torch.int64)
    return tensor.view(INT_OF_WIDTH[tensor.element_size()])


def word_unit(*values: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides every value."""
    unit = 16
    while unit > 1 and any(v % unit for v in values):
        unit //= 2
    return unit


def units(values: np.ndarray) -> np.ndarray:
    """Per element, the widest word (16, 8, 4, 2 or 1 bytes) dividing it: its lowest set bit, capped."""
    low = values & -values
    return np.where((low == 0) | (low > 16), 16, low)


def word_bytes(unit: int) -> int:
    """The integer a word class moves: 16-byte words travel as pairs of int64."""
    return 8 if unit == 16 else unit


def common_word(byte_values: np.ndarray) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every value (torch has no 16-byte integer to view as)."""
    bits = np.bitwise_or.reduce(byte_values.astype(np.int64), keepdims=True) if len(byte_values) else \
        np.zeros(1, dtype=np.int64)
    return min(8, int(units(bits)[0]))
