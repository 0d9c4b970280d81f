"""The tests' one factory of arbitrary values: random bytes viewed as any dtype."""
from __future__ import annotations

import math
from typing import Sequence

import torch


def random_bits(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """A CPU tensor of ``shape`` whose bytes are random (NaNs, infinities and raw bool bytes included): every
    element distinct with high probability, so an off-by-one copy shows, and no float arithmetic is needed."""
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * width,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(tuple(shape))
