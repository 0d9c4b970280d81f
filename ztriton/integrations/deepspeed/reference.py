"""DeepSpeed's own code paths, called as they are, for comparisons (benchmarks, the demo, tests)."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["deepspeed_flatten"]


def deepspeed_flatten(tensors: Sequence[torch.Tensor], paddings: Sequence[int], alignment: int) -> torch.Tensor:
    """DeepSpeed's on-device ZeRO-1/2 flatten: fresh pad tensors after each param, align, ``torch.cat`` (the
    releases without ``parameter_alignment`` pad nothing between params: all ``paddings`` zero)."""
    from torch._utils import _flatten_dense_tensors

    from deepspeed.runtime.utils import align_dense_tensors

    padded = []
    for t, pad in zip(tensors, paddings):
        padded.append(t)
        if pad:
            padded.append(torch.zeros(pad, dtype=t.dtype, device=t.device))
    return _flatten_dense_tensors(align_dense_tensors(padded, alignment))
