"""Process-wide kernel state: triton imported only when a launch needs it, whether it interprets, on which
devices the kernels are loaded, and the background warm-ups a first launch waits for.

Readers in other modules reach ``LOADED``, ``WARMING`` and :func:`kernels_loaded` through this module
(``state.LOADED``), so that one rebinding of them (a test's) is what every reader sees.
"""
from __future__ import annotations

import functools
import threading
from contextlib import nullcontext
from types import SimpleNamespace

import torch

__all__ = ["INTERPRETER_LOCK", "LOADED", "WARMING", "await_warm_up", "interpreted", "jit_imported", "jit_kernels",
           "kernels_loaded", "torch_turn"]


@functools.cache
def jit_kernels() -> SimpleNamespace:
    """The jit kernels and triton's integer types, imported by the first plan that launches a kernel (or asks
    whether the interpreter is on). A process whose copies all go through torch's copies never imports triton,
    a sizeable part of a fresh process's start."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from .copy import copy_words_kernel, gather_tile_kernel

    return SimpleNamespace(
        copy_words=copy_words_kernel, gather_tile=gather_tile_kernel,
        word_types={16: tl.int64, 8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8},
        int_for_itemsize={8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8},
        # triton decides when a kernel is decorated (at its first import) whether it runs under the
        # interpreter (TRITON_INTERPRET=1); the environment variable read later could say otherwise.
        interpreted=not isinstance(copy_words_kernel, JITFunction))


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (imports triton, once)."""
    return jit_kernels().interpreted


def jit_imported() -> bool:
    """Whether :func:`jit_kernels` has imported triton and the kernels yet (asking does not import them)."""
    return jit_kernels.cache_info().currsize > 0


# The interpreter patches triton.language module-wide during a launch: two launches at once from two
# threads would undo each other's patches. Launches under it take turns.
INTERPRETER_LOCK = threading.Lock()


def torch_turn():
    """The interpreter's lock for torch's copies once kernels may run under it (a launch on CUDA tensors copies
    dst's whole storage to the host and back: torch's copies beside it would be lost); nothing where triton is not
    even imported yet, since then no kernel can be running."""
    return INTERPRETER_LOCK if jit_imported() and interpreted() else nullcontext()


# Background warm-ups in flight, by CUDA device index (kernels/warmup.py registers them here).
WARMING: dict[int, threading.Thread] = {}
# A launch waits at most this long for one (a cold compile takes seconds); then it loads the kernel itself.
_WARM_UP_WAIT_S = 120.0

# CUDA devices on which a kernel launch has returned in this process: the first launch there paid the
# kernels' load (Triton's cache key, the cubin, the launcher: a fraction of a second with Triton's cache
# warm, seconds with it cold), later ones do not.
LOADED: set[int] = set()


def kernels_loaded(device: torch.device) -> bool:
    """Whether a kernel launch on ``device`` has already paid the kernels' load (always, off CUDA: the
    interpreter loads nothing)."""
    return device.type != "cuda" or device.index in LOADED


def await_warm_up(device: torch.device) -> None:
    """Let a warm-up of ``device`` still loading the kernels finish rather than load them a second time
    beside it (Triton does not share a load in progress between threads)."""
    thread = _warm_up_elsewhere(device)
    if thread is None:
        return
    if thread.is_alive():
        thread.join(timeout=_WARM_UP_WAIT_S)
    WARMING.pop(device.index, None)  # waited once, finished or not: later launches never wait again


def _warm_up_elsewhere(device: torch.device) -> threading.Thread | None:
    """The warm-up registered for ``device``, unless there is none or it is the calling thread itself."""
    thread = WARMING.get(device.index) if device.type == "cuda" else None
    return None if thread is None or thread is threading.current_thread() else thread
