"""Host staging memory, shared by the whole process: the staging ring (:mod:`.ring_buffers`: a few
buffers that data passes through between a device and pageable memory) and the spill pool
(:mod:`.spill_memory`: host memory params live in while a tier moves them off the device). Both keep their
memory between borrowers and free it on :func:`release` or after ``DEFAULT_IDLE_S`` seconds unused. This
package knows nothing of what is staged: buffers are flat ``uint8`` tensors.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from ztriton import memory
from ztriton.staging.idle import DEFAULT_IDLE_S
from ztriton.staging.ring_buffers import DEFAULT_CHUNK_BYTES, StagingRing, copy_staged, free_shared_ring, ring
from ztriton.staging.spill_memory import SPILL_GRANULE, SpillPool, spill_pool

__all__ = ["StagingRing", "SpillPool", "copy_staged", "ring", "release", "spill", "spill_copies", "spill_pool",
           "synchronized", "DEFAULT_IDLE_S", "DEFAULT_CHUNK_BYTES", "SPILL_GRANULE"]


def release() -> None:
    """Free the shared ring's and the spill pool's memory now (allocated again on the next use). Spill
    memory that tensors still point at stays theirs until they are gone (see :meth:`SpillPool.free`)."""
    free_shared_ring()
    spill_pool().free()


def spill(nbytes: int, device: torch.device | str | None = None, what: str = "host spill") -> torch.Tensor:
    """``nbytes`` of host memory from the process's :class:`SpillPool` for copies to and from ``device``
    (pinned for a CUDA device): a 1-D ``uint8`` tensor; view it as the dtype it holds.

    Copies into and out of it should be ``non_blocking`` (one DMA each, no host copy) inside
    :func:`synchronized`. The loan ends when the last tensor over this memory is gone; the memory is kept
    for the next borrower and freed by :func:`release` or after ``DEFAULT_IDLE_S`` seconds unused. ``what``
    names the memory in an allocation error (and for ``memory.fault_hook``).
    """
    return spill_pool().lend(nbytes, device, what)


def spill_copies(sources: list[torch.Tensor], device: torch.device, what: str,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
    """Copies of ``sources`` (one dtype, on ``device``) in one :func:`spill` loan, back to back: a contiguous
    1-D host view per source, in order, returned once every copy has landed. ``copy(out, src)`` queues one
    (default: ``out`` viewed as ``src``'s shape, one asynchronous DMA; a caller with strided sources it must
    not make contiguous on their device passes its own). The caller re-points its tensors at the views only
    now, with every copy complete: a failure on the way leaves them where they were."""
    if not sources:
        return []
    dtype = sources[0].dtype
    numels = [src.numel() for src in sources]
    staged = spill(sum(numels) * sources[0].element_size(), device, what).view(dtype)
    views, at = [], 0
    with synchronized(device):
        for src, n in zip(sources, numels):
            out = staged.narrow(0, at, n)
            if copy is None:
                out.view(src.shape).copy_(src, non_blocking=True)
            else:
                copy(out, src)
            views.append(out)
            at += n
    return views


@contextlib.contextmanager
def synchronized(device: torch.device | str) -> Iterator[None]:
    """Asynchronous copies queued inside (to or from spill memory) have finished when the block exits,
    normally or by an exception: nobody may read a copy's destination before, and its spill memory must
    not be freed or lent again under a copy still running."""
    try:
        yield
    finally:
        memory.synchronize(torch.device(device))
