"""Process-wide kernel state: triton imported only when a launch needs it, whether it interprets, the kernel
launches counted, and the background warm-ups a first launch waits for.

Readers in other modules reach ``WARMING`` and the counter through this module (``state.WARMING``), so that one
rebinding of them (a test's) is what every reader sees.
"""
from __future__ import annotations

import functools
import os
import threading
from contextlib import nullcontext
from types import SimpleNamespace

import torch

__all__ = ["INTERPRETER_LOCK", "WARMING", "await_warm_up", "count_launch", "interpreted", "interpreter_on",
           "jit_imported", "jit_kernels", "launches", "torch_copies_lock"]

# What triton takes for "on" in TRITON_INTERPRET.
_TRUTHY = ("1", "true", "on", "yes")


@functools.cache
def jit_kernels() -> SimpleNamespace:
    """The jit kernels and triton's integer types by name, imported by the first launch that goes through
    Triton's JIT (or asks whether the interpreter is on). A process whose launches all come from the compiled
    cache (``compiled.py``), or whose copies all go through torch's copies, never imports triton, a sizeable
    part of a fresh process's start."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from .copy import copy_words_kernel, gather_tile_kernel

    return SimpleNamespace(
        copy_words=copy_words_kernel, gather_tile=gather_tile_kernel,
        dtypes={"int64": tl.int64, "int32": tl.int32, "int16": tl.int16, "int8": tl.int8},
        # triton decides when a kernel is decorated (at its first import) whether it runs under the
        # interpreter (TRITON_INTERPRET=1); the environment variable read later could say otherwise.
        interpreted=not isinstance(copy_words_kernel, JITFunction))


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (imports triton, once)."""
    return jit_kernels().interpreted


def interpreter_on(ask=None) -> bool:
    """:func:`interpreted` (or ``ask()``), without importing triton to learn a "no" the environment already
    gives: importing the kernels while ``TRITON_INTERPRET`` reads "0" would fix that "no" for the life of the
    process (a caller may unset it briefly)."""
    if not jit_imported() and os.environ.get("TRITON_INTERPRET", "0").lower() not in _TRUTHY:
        return False
    return (ask or interpreted)()


def jit_imported() -> bool:
    """Whether :func:`jit_kernels` has imported triton and the kernels yet (asking does not import them)."""
    return jit_kernels.cache_info().currsize > 0


# The interpreter patches triton.language module-wide during a launch: two launches at once from two
# threads would undo each other's patches. Launches under it hold a lock.
INTERPRETER_LOCK = threading.Lock()


def torch_copies_lock():
    """The interpreter's lock for torch's copies once kernels may run under it (a launch on CUDA tensors copies
    dst's whole storage to the host and back: torch's copies beside it would be lost); nothing where triton is not
    even imported yet, since then no kernel can be running."""
    return INTERPRETER_LOCK if jit_imported() and interpreted() else nullcontext()


# Background warm-ups in flight, by CUDA device index (kernels/warmup.py registers them here).
WARMING: dict[int, threading.Thread] = {}
# A launch waits at most this long for one (a cold compile takes seconds); then it loads the kernel itself.
_WARM_UP_WAIT_S = 120.0

# Kernel launches issued by this process, however launched (compiled cache, JIT, interpreter), and by each
# thread: what a step's summary line reports is its own thread's (read before and after the step), so that a
# warm-up or another thread's work is not counted in it.
_launches = 0
_count_lock = threading.Lock()
_per_thread = threading.local()


def count_launch() -> None:
    global _launches
    with _count_lock:
        _launches += 1
    _per_thread.launches = getattr(_per_thread, "launches", 0) + 1


def launches() -> int:
    """Kernel launches this process has issued so far."""
    return _launches


def thread_launches() -> int:
    """Kernel launches the calling thread has issued so far."""
    return getattr(_per_thread, "launches", 0)


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
