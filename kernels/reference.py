"""The torch reference of every launch function: the same contract, the same checks, plain torch.

Two jobs, one implementation: the entry points fall back to it where the kernels cannot run (CPU
tensors without ``TRITON_INTERPRET=1``, or sources on another device than the destination), and the
tests use it as the oracle the kernels are compared with. Unlike the kernels it accepts sources on
any device (``copy_`` moves them; to or from pinned host memory asynchronously: synchronise before
reading the result on the host or letting the sources go).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .ops import chunk_piece
from .pieces import Piece, pack_pieces, slices_to_pieces
from .validation import validate
from .words import integer_view

__all__ = ["bits", "torch_copy_chunk", "torch_pack", "torch_pack_slices", "torch_run"]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements, flattened, as same-width integers: how a result is compared with the
    reference (``torch.equal`` on these; NaN-safe, -0.0-safe, and alike for bf16, fp8 and bool)."""
    return integer_view(tensor.detach().contiguous().view(-1))


def torch_run(dst: torch.Tensor, pieces: Sequence[Piece], zero_ranges: Sequence[tuple[int, int]] = (),
              what: str = "sources") -> torch.Tensor:
    """Copy every piece into ``dst`` and zero ``zero_ranges``, after the kernels' own checks."""
    srcs, zeros = validate(dst, pieces, zero_ranges, same_device=False, what=what)
    with torch.no_grad():  # bits move as the kernels move them: a source that requires grad is not recorded
        _copy_pieces(dst, pieces, srcs, zeros)
    return dst


def _copy_pieces(dst: torch.Tensor, pieces: Sequence[Piece], srcs, zeros) -> None:
    for offset, count in zeros.tolist():
        dst.narrow(0, offset, count).zero_()
    for (src, *_), start, count, offset in zip(pieces, srcs.start.tolist(), srcs.count.tolist(), srcs.offset.tolist()):
        if count:
            part = src.reshape(-1).narrow(0, start, count)
            dst.narrow(0, offset, count).copy_(part, non_blocking=part.is_pinned() or dst.is_pinned())


def torch_copy_chunk(src: torch.Tensor, dst: torch.Tensor, start: int = 0, count: int | None = None) -> torch.Tensor:
    """:func:`ztriton.kernels.copy_chunk` in torch."""
    return torch_run(dst, [chunk_piece(src, dst, start, count)], what="src")


def torch_pack(dst: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
               window: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`ztriton.kernels.pack` in torch."""
    return torch_run(dst, *pack_pieces(dst, sources, offsets, window))


def torch_pack_slices(dst: torch.Tensor, slices: Sequence[tuple[torch.Tensor, int, int, int]]) -> torch.Tensor:
    """:func:`ztriton.kernels.pack_slices` in torch."""
    return torch_run(dst, *slices_to_pieces(dst, slices), what="slices")
