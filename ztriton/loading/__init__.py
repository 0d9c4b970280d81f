"""Shard-on-read loading: each rank reads only the checkpoint bytes of its own windows.

::

    from ztriton.loading import Key, Stack, Concat, Target, load_into

    report = load_into([Target("w", Key("w"), (1024, 512), partition, start=rank * psize)], "model.safetensors")

A :class:`Target` is one destination (a ZeRO-3 partition, a whole param) and the :data:`Source`
its full tensor is built from (:class:`Key`, :class:`Stack`, :class:`Concat` of checkpoint
tensors). :func:`load_into` checks every target first and raises :class:`CheckpointError` before
anything is written; then it reads only the byte ranges each window needs through the process's
staging ring and writes them with the window kernels, casting on ``out``'s device. No collective:
every rank reads for itself. The ZeRO-3 module wrapper is
``ztriton.integrations.zero3_loading.load_checkpoint``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from ztriton.loading.checkpoint import Checkpoint, CheckpointError, TensorInfo
from ztriton.loading.reader import DEFAULT_STAGING_BYTES, DEFAULT_THREADS, check_options, run_jobs
from ztriton.loading.sources import Concat, Key, Source, Span, Stack, built_shape, leaf_keys, resolve_window
from ztriton.loading.targets import Target, plan_targets

__all__ = ["Key", "Stack", "Concat", "Source", "Span", "Target", "Checkpoint", "TensorInfo", "CheckpointError",
           "LoadReport", "load_into", "built_shape", "leaf_keys", "resolve_window", "DEFAULT_STAGING_BYTES",
           "DEFAULT_THREADS", "check_options"]


@dataclass
class LoadReport:
    """What a load did on this rank.

    ``bytes_read``: checkpoint bytes this process read (exactly, merged neighbours counted once);
    ``loaded``: target names written; ``missing_keys``: model tensors the checkpoint lacks (left as
    they were); ``unexpected_keys``: checkpoint tensors nothing read (the module wrapper fills both).
    """

    bytes_read: int = 0
    loaded: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def load_into(targets: Sequence[Target], checkpoint: Checkpoint | str | os.PathLike, *,
              staging_bytes: int | None = None, threads: int = DEFAULT_THREADS,
              progress: bool = False) -> LoadReport:
    """Fill every target's ``out`` with its window of the checkpoint.

    Checks everything first (each key exists; the source builds the target's shape; the checkpoint
    dtype casts to ``out.dtype``; the window fits the tensor and ``out``; ``out`` is 1-D contiguous;
    outs do not overlap) and raises :class:`CheckpointError` naming the target, tensor and file
    before anything is written. Then reads only the needed byte ranges into host staging buffers of
    ``staging_bytes`` (default 64 MiB; ``threads`` reader threads, ``threads + 1`` buffers), copies
    them to ``out``'s device and writes them with ``pack_slices``; ``out[count:]`` is zeroed.
    ``progress``: a tqdm bar over bytes.

    A read that fails midway raises CheckpointError saying which targets were written (a target
    whose bytes fit one staging buffer is written all at once, after its reads).
    """
    check_options(staging_bytes=staging_bytes, threads=threads, progress=progress)
    if isinstance(targets, (str, bytes)) or not hasattr(targets, "__iter__"):
        raise TypeError(f"targets must be a sequence of ztriton.loading.Target, got {type(targets).__name__}")
    targets = list(targets)
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint(checkpoint)
    jobs = plan_targets(targets, checkpoint)
    bytes_read = run_jobs(jobs, staging_bytes=staging_bytes, threads=threads, progress=progress)
    return LoadReport(bytes_read=bytes_read, loaded=[t.name for t in targets])
