"""Tensor-memory helpers shared by the entry points (partitioning, flatten, defragment, loading, sharded init)."""
from __future__ import annotations

import os

import torch


def kernels_run_on(device: torch.device) -> bool:
    """The Triton kernels run on CUDA tensors, and on CPU tensors only under the interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (non-blocking copies included); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alias(storage: torch.UntypedStorage, offset: int, numel: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """A 1-D tensor of its own over ``storage[offset:offset + numel]``, not an autograd view.

    DeepSpeed re-points partitions (``ds_tensor.data = ...``); a view would keep its base, and so the
    whole old buffer, alive through ``_base`` after every partition had moved.
    """
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (numel,))
