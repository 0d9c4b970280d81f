"""What a load must write, checked in full before anything is read or written.

A :class:`Target` names a destination (``out``, one rank's window of a model tensor) and how that
tensor is built from checkpoint tensors (a :data:`~ztriton.loading.sources.Source`).
:func:`plan_targets` checks every target against the checkpoint and resolves each window to
:class:`Part` s (byte ranges of checkpoint files and where their elements go); any problem raises
:class:`~ztriton.loading.checkpoint.CheckpointError` naming the target, the tensor and the file.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ztriton import policy
from ztriton.layout import is_int
from ztriton.loading.checkpoint import Checkpoint, CheckpointError, TensorInfo
from ztriton.loading.sources import Concat, Key, Source, SourceError, Stack, built_shape, leaf_keys, resolve_window

__all__ = ["Target", "Part", "Job", "plan_targets"]


@dataclass(frozen=True)
class Target:
    """One destination this rank fills: elements ``[start, start + count)`` of the full tensor that
    ``source`` builds (shape ``shape``) go to ``out[:count]``; ``out[count:]`` is padding, zeroed.

    ``out`` is 1-D and contiguous, e.g. a ZeRO-3 partition or a whole flat param; the checkpoint's
    dtype is cast into ``out.dtype`` on ``out``'s device. ``count`` defaults to what fits:
    ``min(out.numel(), numel - start)`` (0 when ``start`` is past the end, as for a ZeRO-3 rank
    whose slice is all padding).
    """

    name: str
    source: Source
    shape: tuple[int, ...]
    out: torch.Tensor
    start: int = 0
    count: int | None = None


class Part(NamedTuple):
    """``count`` elements of checkpoint tensor ``tensor`` from element ``start`` go to ``out[offset:]``."""

    tensor: TensorInfo
    start: int
    count: int
    offset: int


@dataclass
class Job:
    """A checked target: its destination, how many elements it loads, the parts that make them."""

    name: str
    out: torch.Tensor
    count: int
    parts: list[Part]

    @property
    def nbytes(self) -> int:
        """Checkpoint bytes this job reads (before neighbouring reads are merged)."""
        return sum(p.count * p.tensor.dtype.itemsize for p in self.parts)

    @property
    def first_byte(self) -> tuple[str, int]:
        """Where its reads start (to order jobs so that files are read front to back)."""
        if not self.parts:
            return ("", 0)
        part = min(self.parts, key=lambda p: (str(p.tensor.file), p.tensor.offset + p.start * p.tensor.dtype.itemsize))
        return (str(part.tensor.file), part.tensor.offset + part.start * part.tensor.dtype.itemsize)



def _suggest(key: str, keys: list[str]) -> str:
    close = difflib.get_close_matches(key, keys, n=3)
    return f" (close names: {close})" if close else ""


def _check_out(target: Target, where: str) -> torch.Tensor:
    out = target.out
    if isinstance(out, torch.Tensor) and out.device.type == "meta":
        raise CheckpointError(f"{where}: out is on the meta device (it has no memory to load into); allocate it "
                              "first")
    policy.check_tensor(out, f"{where}: out")
    if out.dim() != 1 or not out.is_contiguous():
        raise CheckpointError(f"{where}: out must be a 1-D contiguous tensor, got shape {tuple(out.shape)} with "
                              f"strides {out.stride()}; pass a flat view (e.g. the ZeRO-3 partition ds_tensor)")
    return out.detach()


def _check_window(target: Target, numel: int, out: torch.Tensor, where: str) -> int:
    """The number of elements to load; checks start and count against the tensor and ``out``."""
    if not is_int(target.start) or target.start < 0:
        raise CheckpointError(f"{where}: start must be an int >= 0, got {target.start!r}")
    count = target.count
    if count is None:
        count = max(0, min(out.numel(), numel - target.start))
    if not is_int(count) or count < 0:
        raise CheckpointError(f"{where}: count must be an int >= 0, got {count!r}")
    if count > out.numel():
        raise CheckpointError(f"{where}: count={count} elements do not fit in out of {out.numel()} elements")
    if count and target.start + count > numel:
        raise CheckpointError(f"{where}: elements [{target.start}, {target.start + count}) are outside the tensor's "
                              f"{numel} elements")
    return count


_cast_ok: dict[tuple, bool] = {}


def _castable(src: torch.dtype, dst: torch.dtype, device: torch.device) -> bool:
    """Whether the device can cast ``src`` into ``dst`` without changing kind (no float -> int):
    torch's rule, then a one-element trial on the device (some casts, e.g. to some unsigned or fp8
    types, are not implemented everywhere), so that the load cannot fail on it halfway."""
    if src == dst:
        return True
    key = (src, dst, str(device))
    if key not in _cast_ok:
        ok = torch.can_cast(src, dst)
        if ok:
            try:
                torch.zeros(1, dtype=src, device=device).to(dst)
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _cast_ok[key] = ok
    return _cast_ok[key]


def _describe_files(infos: list[TensorInfo]) -> str:
    files = sorted({str(i.file) for i in infos})
    return files[0] if len(files) == 1 else f"files {files}"


def _plan_one(target: Target, checkpoint: Checkpoint, where: str) -> Job:
    if not isinstance(target.source, (Key, Stack, Concat)):
        raise TypeError(f"{where}: source must be a Key, Stack or Concat, got {type(target.source).__name__}")
    out = _check_out(target, where)
    keys = leaf_keys(target.source)
    for key in keys:
        if key not in checkpoint:
            raise CheckpointError(f"{where}: checkpoint tensor {key!r} is not in {checkpoint.path}"
                                  f"{_suggest(key, checkpoint.keys())}")
    infos = {key: checkpoint.info(key) for key in keys}
    shapes = {key: info.shape for key, info in infos.items()}
    try:
        shape = built_shape(target.source, shapes)
    except SourceError as exc:
        files = _describe_files(list(infos.values()))
        raise CheckpointError(f"{where}: {exc} (checkpoint tensors in {files})") from None
    want = tuple(target.shape)
    if shape != want:
        what = (f"checkpoint tensor {keys[0]!r}" if isinstance(target.source, Key)
                else f"its source ({len(keys)} tensors)")
        raise CheckpointError(f"{where}: {what} in {_describe_files(list(infos.values()))} has shape {shape} but the "
                              f"model expects {want}; the checkpoint does not match this model")
    for key, info in infos.items():
        if not _castable(info.dtype, out.dtype, out.device):
            raise CheckpointError(f"{where}: checkpoint tensor {key!r} in {info.file} is {info.dtype}, which cannot be "
                                  f"cast to the model's {out.dtype} on {out.device}")
    count = _check_window(target, math.prod(want), out, where)
    spans = resolve_window(target.source, shapes, target.start, target.start + count) if count else []
    parts = [Part(infos[s.key], s.start, s.count, s.offset) for s in spans]
    return Job(target.name, out, count, parts)


def plan_targets(targets: Sequence[Target], checkpoint: Checkpoint) -> list[Job]:
    """Check every target, then resolve each to the parts it reads. Raises on the first problem."""
    jobs = []
    for i, target in enumerate(targets):
        if not isinstance(target, Target):
            raise TypeError(f"targets[{i}] must be a ztriton.loading.Target, got {type(target).__name__}")
        jobs.append(_plan_one(target, checkpoint, f"target {target.name!r}"))
    _check_disjoint_outs(jobs)
    return jobs


def _check_disjoint_outs(jobs: list[Job]) -> None:
    """Refuse outs that overlap in memory: the result would depend on the order of writes."""
    spans = sorted((str(j.out.device), j.out.data_ptr(), j.out.data_ptr() + j.out.numel() * j.out.element_size(),
                    j.name) for j in jobs if j.out.numel())
    for (d0, b0, e0, n0), (d1, b1, e1, n1) in zip(spans, spans[1:]):
        if d0 == d1 and b1 < e0:
            raise CheckpointError(f"targets {n0!r} and {n1!r} have outs that overlap in memory; give each its own "
                                  "tensor (tied weights: load the tensor once)")
