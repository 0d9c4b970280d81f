"""Launch parameters (:class:`Tuning`): what the kernels' programs move, and which plans torch's copies take
instead. The measurements behind each default: ``bench/NOTES.md``, "Kernels: why the tuning is what it is".
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KERNELS_ONLY", "Tuning"]


@dataclass(frozen=True)
class Tuning:
    """Launch parameters: bytes a word-copy program moves per loop step (``step_bytes``) and in all
    (``program_bytes``), its warps and whether it streams; the gather's tile (elements along dim p and along
    the last dim), its warps."""

    # The best worst case on an H200 over a large copy, a pack of thousands of tensors, its window and the LLM
    # mix; square tiles for a transposed source.
    step_bytes: int = 32 * 1024
    program_bytes: int = 32 * 1024
    num_warps: int = 2
    stream: bool = False
    tile_p: int = 128
    tile_c: int = 128
    tile_warps: int = 4
    # Up to this many pieces, all contiguous, are copied by torch (and the gaps zeroed by it): a contiguous run
    # moves at copy bandwidth either way, and a few copy_ calls cost the host less than a plan's tables. Most
    # small jobs (zero.Init's per-module partitions, small loader jobs) fit; the kernels take every job of more
    # pieces (flatten, defragment) and every strided source. 0: always launch the kernels.
    torch_pieces: int = 16
    # In such torch copies, a piece of at least this many bytes gets a copy_ of its own (a memcpy at copy
    # bandwidth); the others go in torch._foreach_copy_ calls per word width, cheaper on the host but slower on
    # the device. Bigger thresholds were slower on a flatten of large pieces.
    own_copy_bytes: int = 16 << 20
    # Under run_now, a _foreach_copy_ is issued each time this many pieces of one word width are ready, so that
    # the device starts while the host still makes the next pieces' views.
    batch_pieces: int = 64
    # torch's _foreach_copy_ and _foreach_zero_ only for more pieces (gaps) than this; fewer get a copy_ (zero_)
    # each: a process's first _foreach_copy_ loads a CUDA kernel, a copy_ is a memcpy with none to load.
    foreach_from: int = 1024
    # Runs (and gaps) that follow one another in dst, at least this many, are written by one torch.cat(out=) of
    # their sources (and zeros) instead of a copy_ / _foreach_copy_ each: one call of host time for any number
    # of pieces, which a fresh process's flatten is bound by. 0: never. The cat moves integer words: in bf16 a
    # span of more than 2^31 elements makes torch.cat copy each input with a memcpy in a C++ loop, which is slower.
    cat_items: int = 2
    # A gap joins such a cat (as a view of one zero buffer) only up to this many bytes: the buffer is device memory
    # beside dst, so a long gap (the evict tier's evicted params) is zeroed apart instead. Pads are a few elements.
    cat_gap_bytes: int = 64 << 10


# Launch the kernels whatever the pieces (the kernel tests and benchmarks, the warm-up).
KERNELS_ONLY = Tuning(torch_pieces=0)
