"""Load the kernels' commonest variant in a background thread, before the first real launch needs it.

A fresh process pays for its first launch of a jit kernel even when Triton's cache holds the binary:
Triton hashes its own sources and ``libtriton`` (the cache key, once per process), loads the cubin and
the launcher stub, and on an empty cache compiles both: a fraction of a second with a warm cache, inside
the user's ``deepspeed.initialize`` (``bench/NOTES.md``, "Kernels: why the tuning is what it is"). Most of it is
hashing and file reads, which release the GIL, so a thread started when a caller first learns that
the kernels will be needed (a DeepSpeed config with the key) overlaps it with whatever the process
does next. The thread runs one tiny real copy through the same planning as every launch, so it loads
exactly the variant real copies use: 16-byte words, the class of every 16-byte aligned param. Until a
kernel is loaded on a device, copies of contiguous pieces on it go through torch's ``copy_`` instead (a few
microseconds a piece, no waiting: ``plan.BEFORE_LOAD_PIECES``); a launch that needs the kernel (strided
sources, thousands of pieces) waits for the thread instead of loading the kernel twice.

:func:`load_torch_cat_in_background` does the same for torch's own cat kernel, which torch's route (the copies
made before the copy kernel loads) launches for pieces side by side.

The thread never picks a device on its own: creating a CUDA context on the wrong GPU would cost that
GPU memory on every rank. The caller names the device, or the thread is not started.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time

import torch

from . import plan
from .ops import pack_plan
from .state import WARMING
from .tuning import KERNELS_ONLY

__all__ = ["load_torch_cat_in_background", "warm_up", "warm_up_in_background"]

logger = logging.getLogger("ztriton")

_lock = threading.Lock()
_requested: set[int] = set()  # devices a warm-up was started for, once per process
_cat_started: dict[int, threading.Thread] = {}  # devices torch's cat kernel is loaded on (or being), once each
_threads: list[threading.Thread] = []  # every warm-up started, for the wait at exit
# Inputs of the tiny cat that loads torch's kernel: as many as a batch of a flatten's cat (torch picks its kernel
# by the inputs' count, alignment and contiguity), 16 int64 words each.
_CAT_INPUTS = 200
# At exit, wait at most this long for a warm-up still loading (a cold compile takes seconds).
_EXIT_WAIT_S = 60.0


def warm_up(device: torch.device, work=None) -> None:
    """Launch the 16-byte-word copy (or ``work(device)``) once on ``device`` (a CUDA device) and wait for it."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)  # its own: waiting for it never waits for other threads' work
        with torch.cuda.stream(stream):
            (work or _copy_once)(device)
        stream.synchronize()


def _copy_once(device: torch.device) -> None:
    """16 bytes copied, 16 zeroed: one launch of the 16-byte word class."""
    src = torch.arange(8, dtype=torch.int16, device=device)
    dst = torch.empty(16, dtype=torch.int16, device=device)
    pack_plan(dst, [src], [0], tuning=KERNELS_ONLY).launch()  # a launch even for one tiny piece


def warm_up_in_background(device: torch.device | int | str) -> threading.Thread | None:
    """Start :func:`warm_up` on ``device`` in a daemon thread, once per device and process.

    Returns the thread (the one already started for this device, if any), or None where there is
    nothing to load (not a CUDA device, or no CUDA). A failure in the thread is logged at debug level
    and otherwise ignored: the first real launch then loads the kernel itself, as without warm-up.
    """
    device = _indexed_cuda(device, "warm_up_in_background")
    if device is None:
        return None
    # The interpreter compiles nothing. Asked without importing triton where the environment says no: the
    # thread imports it, off the caller's thread.
    if plan.interpreter_on():
        return None
    with _lock:
        if device.index in _requested:
            return WARMING.get(device.index)
        _requested.add(device.index)
        thread = _start("warm-up", device)  # may raise (no threads left): then launches never wait
        WARMING[device.index] = thread  # launches on this device wait for it once (state.await_warm_up)
    return thread


def load_torch_cat_in_background(device: torch.device | int | str) -> threading.Thread | None:
    """Load torch's cat kernel for integer words on ``device`` (an indexed CUDA device) in a daemon thread, once
    per device and process; returns the thread, or None where there is nothing to load (not CUDA).

    Before the copy kernel loads, torch's route writes pieces side by side with one ``torch.cat`` over integer
    words (``Tuning.cat_items``), and torch loads that CUDA kernel on its first launch, a noticeable part of a
    fresh process's flatten. Started when a ZeRO optimizer begins building, the thread loads
    it while DeepSpeed's own set-up runs (the load releases the GIL). A failure is logged at debug level: the first
    real cat then loads the kernel, as without it."""
    device = _indexed_cuda(device, "load_torch_cat_in_background")
    if device is None:
        return None
    with _lock:
        if device.index not in _cat_started:
            _cat_started[device.index] = _start("cat", device, _cat_once)
        return _cat_started[device.index]


def _cat_once(device: torch.device) -> None:
    parts = [torch.zeros(16, dtype=torch.int64, device=device) for _ in range(_CAT_INPUTS)]
    torch.cat(parts, out=torch.empty(16 * _CAT_INPUTS, dtype=torch.int64, device=device))


def _indexed_cuda(device: torch.device | int | str, caller: str) -> torch.device | None:
    """``device`` as a CUDA device with its index; None where there is nothing to load (not a CUDA device, or no
    CUDA). Raises for a CUDA device without an index: a thread must not guess one."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        raise ValueError(f"{caller} needs an indexed CUDA device (cuda:N): the thread must not guess one")
    return device


def _start(name: str, device: torch.device, work=None) -> threading.Thread:
    """(under ``_lock``) A daemon thread running ``work`` (default: the copy kernel's warm-up) on ``device``, waited
    for at exit. Starting may raise (no threads left): then nothing is registered."""
    thread = threading.Thread(target=_run, args=(device,) if work is None else (device, work),
                              name=f"ztriton-{name}-cuda{device.index}", daemon=True)
    thread.start()
    if not _threads:
        atexit.register(_finish_at_exit)
    _threads.append(thread)
    return thread


def _finish_at_exit() -> None:
    """Let a warm-up still loading finish before the interpreter shuts down. A daemon thread caught inside
    CUDA or Triton's C++ when Python finalises is unwound by force, and a C++ ``catch (...)`` on its way
    aborts the process ("FATAL: exception not rethrown", exit code -6) after the user's script has finished:
    a launcher such as torchrun would report the rank as failed (seen on an H200: ``bench/NOTES.md``, "Kernels:
    why the tuning is what it is")."""
    deadline = time.monotonic() + _EXIT_WAIT_S  # one bound for all of them, however many devices
    for thread in _threads:
        if thread.is_alive():
            logger.debug("ztriton: waiting for the kernel warm-up on %s to finish before exit", thread.name)
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _run(device: torch.device, work=None) -> None:
    try:
        warm_up(device, work)
    except Exception as exc:  # noqa: BLE001 -- best effort: the first real launch loads the kernel instead
        logger.debug("ztriton: kernel warm-up on %s failed (%s); the first copy loads the kernel instead", device, exc)
