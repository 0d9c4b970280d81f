"""Getting the kernels ready before the first real launch needs them: the compiled cache's background fill, the
commonest variant loaded in a background thread, and torch's own cat kernel.

A launch comes from the compiled cache (``compiled.py``) when it holds the variant: a fresh process then loads
a binary in about a millisecond instead of paying Triton's first launch (importing triton, hashing its sources,
building the launcher; seconds with Triton's own cache empty). :func:`fill_in_background` fills the cache: the
first launch in a process that finds its variant missing (and so went through the JIT) starts, once per process,
``python -m ztriton compile`` in a separate low-priority process that sees no GPU and compiles the common
variants for this GPU's architecture, so that the next process finds them. A lock file in the cache folder lets
one rank of a node start it; ``ZTRITON_BACKGROUND_COMPILE=0`` turns it off.

:func:`warm_up_in_background` (the DeepSpeed key's ``warm_up_kernels``) runs one tiny real copy of the 16-byte
word class in a daemon thread, through the same planning as every launch: it loads that variant from the cache,
or compiles it through the JIT on a miss, off the caller's thread. A launch that needs a kernel meanwhile waits
for the thread rather than loading the kernel twice. Which route a job takes never depends on it.

:func:`load_torch_cat_in_background` does the same for torch's own cat kernel, which torch's route (a few
contiguous pieces side by side) launches.

The thread never picks a device on its own: creating a CUDA context on the wrong GPU would cost that
GPU memory on every rank. The caller names the device, or the thread is not started.
"""
from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
import time

import torch

from . import compiled, state
from .ops import pack_plan
from .state import WARMING
from .tuning import KERNELS_ONLY
from .variants import WORD_COPY, word_meta
from .words import word_unit

__all__ = ["fill_in_background", "load_torch_cat_in_background", "load_word_copies", "preload_in_background",
           "warm_up", "warm_up_in_background", "word_units"]

logger = logging.getLogger("ztriton")

_lock = threading.Lock()
_requested: set[int] = set()  # devices a warm-up was started for, once per process
_cat_started: dict[int, threading.Thread] = {}  # devices torch's cat kernel is loaded on (or being), once each
_preloaded: dict[int, threading.Thread] = {}  # devices the compiled word copies are preloaded on (or being), once each
# The word copy's classes in the order a flatten of bf16 params needs them: 16-byte bodies, then 2-byte heads and
# tails, then the others.
_PRELOAD_UNITS = (16, 2, 4, 8, 1)
# Pinned blocks that fill torch's pinned-memory cache, of each power-of-two size a plan's tables take (a row is
# 24 bytes; up to 1 MiB: a turn of thousands of pieces), so that a fresh process's first plans allocate none (each
# costs a cudaHostAlloc, ~1 ms). Two of each: a turn's upload waits on the stream behind the previous turn's
# kernels, so its block is still busy when the next turn, often of the same size, asks for one.
_PINNED_SIZES = tuple(1 << k for k in range(12, 21))
_PINNED_EACH = 2
_threads: list[threading.Thread] = []  # every warm-up started, for the wait at exit
# Inputs of the tiny cat that loads torch's kernel: as many as a batch of a flatten's cat (torch picks its kernel
# by the inputs' count, alignment and contiguity), 16 int64 words each.
_CAT_INPUTS = 200
# At exit, wait at most this long for a warm-up still loading (a cold compile takes seconds).
_EXIT_WAIT_S = 60.0
# A fill's lock file younger than this means another process is filling that folder: start none.
_FILL_LOCK_S = 600.0
_fill_started = False


def warm_up(device: torch.device, work=None) -> None:
    """Launch the 16-byte-word copy (or ``work(device)``) once on ``device`` (a CUDA device) and wait for it:
    its binary is then loaded in this process (from the compiled cache, or compiled by the JIT)."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)  # its own: waiting for it never waits for other threads' work
        with torch.cuda.stream(stream):
            (work or _copy_once)(device)
        stream.synchronize()


def fill_in_background(device_index: int) -> subprocess.Popen | None:
    """Start ``python -m ztriton compile`` for ``device_index``'s architecture in a separate process that sees no
    GPU, once per process, unless another process holds the cache folder's fill lock (younger than
    ``_FILL_LOCK_S``) or ``ZTRITON_BACKGROUND_COMPILE=0``. Returns the process, or None where none was started."""
    global _fill_started
    if _fill_started or os.environ.get("ZTRITON_BACKGROUND_COMPILE", "1").strip().lower() in ("0", "false", "off"):
        return None
    _fill_started = True
    from . import cache

    major, minor = torch.cuda.get_device_capability(device_index)
    folder = cache.key_dir(major * 10 + minor)
    if folder is None or not _take_fill_lock(folder / ".filling"):
        return None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # compiling needs no GPU: no context, no memory taken on any of them
    command = [sys.executable, "-m", "ztriton", "compile", "--arch", str(major * 10 + minor), "--background"]
    try:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        logger.debug("ztriton: could not start the compiled cache's fill (%s)", exc)
        return None


def _take_fill_lock(path) -> bool:
    """Create the fill's lock file; False if a fresh one exists (another process is filling)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if time.time() - path.stat().st_mtime < _FILL_LOCK_S:
                return False
            path.unlink()  # stale: its filler died or finished long ago
        except FileNotFoundError:
            pass
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except OSError:
        return False


def _copy_once(device: torch.device) -> None:
    """16 bytes copied, 16 zeroed: one launch of the 16-byte word class."""
    src = torch.arange(8, dtype=torch.int16, device=device)
    dst = torch.empty(16, dtype=torch.int16, device=device)
    pack_plan(dst, [src], [0], tuning=KERNELS_ONLY).launch()  # a launch even for one tiny piece


def warm_up_in_background(device: torch.device | int | str) -> threading.Thread | None:
    """Start :func:`warm_up` on ``device`` in a daemon thread, once per device and process.

    Returns the thread (the one already started for this device, if any), or None where there is
    nothing to load (not a CUDA device, or no CUDA, or the interpreter). A failure in the thread is logged at
    debug level and otherwise ignored: the first real launch then loads the kernel itself, as without warm-up.
    """
    device = _indexed_cuda(device, "warm_up_in_background")
    if device is None:
        return None
    # The interpreter compiles nothing. Asked without importing triton where the environment says no: the
    # thread imports it, off the caller's thread.
    if state.interpreter_on():
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

    Torch's route writes a few pieces side by side with one ``torch.cat`` over integer words
    (``Tuning.cat_items``), and torch loads that CUDA kernel on its first launch. Started under the key from the
    config's parse (or when a ZeRO optimizer begins building), the thread loads it while DeepSpeed's own set-up
    runs (the load releases the GIL). A failure is logged at debug level: the first real cat then loads the
    kernel, as without it."""
    device = _indexed_cuda(device, "load_torch_cat_in_background")
    return None if device is None else _once_per_device(_cat_started, "cat", device, _cat_once)


def preload_in_background(device: torch.device | int | str, element_size: int | None = None
                          ) -> threading.Thread | None:
    """Load the word copy's variants from the compiled cache (never through Triton's JIT: a miss stays a miss) and
    fill torch's pinned-memory cache with the blocks a plan's tables are uploaded from, on ``device`` (an indexed
    CUDA device), in a daemon thread, once per device and process; returns the thread, or None where there is
    nothing to load (not CUDA, the interpreter, ``ZTRITON_COMPILED=0``). ``element_size``: the bytes of the elements
    the coming copies move, where the caller knows them: only the word classes such copies can use are loaded
    (:func:`word_units`); None loads every class.

    A fresh process's first plans otherwise pay both in the caller's thread (a binary load per variant, a pinned
    allocation per table size). Started under the key from the config's parse (or when a ZeRO optimizer begins
    building), the thread works while DeepSpeed's own set-up runs (the driver's load and torch's allocation
    release the GIL); a launch that needs a variant the thread is loading waits for that load (``compiled.py``'s
    lock). A failure is logged at debug level only."""
    device = _indexed_cuda(device, "preload_in_background")
    if device is None or state.interpreter_on() or not compiled.direct_enabled():
        return None
    units = word_units(element_size)
    return _once_per_device(_preloaded, "preload", device, lambda device: _preload_once(device, units))


def _once_per_device(started: dict[int, threading.Thread], name: str, device: torch.device, work
                     ) -> threading.Thread:
    """The thread ``started`` holds for ``device``, else a new one running ``work`` there (recorded in ``started``).
    Starting may raise (no threads left): then nothing is recorded."""
    with _lock:
        if device.index not in started:
            started[device.index] = _start(name, device, work)
        return started[device.index]


def _preload_once(device: torch.device, units: tuple[int, ...]) -> None:
    load_word_copies(device, units)
    _fill_pinned_cache(device)


def word_units(element_size: int | None = None) -> tuple[int, ...]:
    """The word classes (bytes a word) a copy of whole elements of ``element_size`` bytes can use, in
    ``_PRELOAD_UNITS``' order: its pieces start, end and pad at multiples of the element size, so no head or tail is
    ever cut into narrower words (bf16 params never need the 1-byte class). That assumes storages aligned to their
    element size, as torch's allocators give (a ``torch.frombuffer`` at an odd offset is not: its copy then loads
    its class on the caller's thread). None (or no positive size): every class."""
    if element_size is None or element_size <= 0:
        return _PRELOAD_UNITS
    widest = word_unit(element_size)  # every address and length of such a copy divides by it
    return tuple(unit for unit in _PRELOAD_UNITS if unit >= widest)


def load_word_copies(device: torch.device, units: tuple[int, ...] = _PRELOAD_UNITS) -> None:
    """These word classes of the word copy from the compiled cache, in order (a miss stays a miss). Each load holds
    the driver's lock, which every CUDA call of the process's other threads waits for: none is loaded for nothing."""
    for unit in units:
        compiled.preload(device.index, WORD_COPY, word_meta(unit, KERNELS_ONLY))


def _fill_pinned_cache(device: torch.device) -> None:
    """``_PINNED_EACH`` pinned blocks of each of ``_PINNED_SIZES`` (all held at once: distinct blocks), freed into
    torch's cache, the process's first host-to-device copy from one of them, and its first device-to-device copy
    (the lead's ``copy_`` of bytes). The blocks name their device: under an entered ``zero.Init`` DeepSpeed's
    ``torch.empty`` puts a tensor without one on the accelerator, where nothing can be pinned."""
    blocks = [torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=True)
              for size in _PINNED_SIZES for _ in range(_PINNED_EACH)]
    on_device = blocks[0][:64].to(device, non_blocking=True)
    torch.empty_like(on_device).narrow(0, 0, 32).copy_(on_device.narrow(0, 32, 32))


def _cat_once(device: torch.device) -> None:
    # The inputs as views of one tensor: one call instead of one per input (each call is Python time the thread
    # takes from the caller's, and a wait for the GIL).
    parts = torch.zeros(_CAT_INPUTS, 16, dtype=torch.int64, device=device).unbind(0)
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
