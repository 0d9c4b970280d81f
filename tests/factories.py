"""The tests' small factories: arbitrary values (random bytes viewed as any dtype) and a recorder of calls."""
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


def record_calls(monkeypatch, calls: Sequence[tuple[object, str, str]]) -> list[str]:
    """Wrap each ``(owner, attribute, label)`` for the test: every call appends its label to the list returned (in
    the order the calls come), then goes through to the real one."""
    steps: list[str] = []
    for owner, name, label in calls:
        monkeypatch.setattr(owner, name, lambda *a, _real=getattr(owner, name), _label=label, **k:
                            steps.append(_label) or _real(*a, **k))
    return steps
