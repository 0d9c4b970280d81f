"""Launching one kernel variant: its binary from the compiled cache when the cache holds it, else Triton's JIT.

The rule: a CUDA launch whose arguments meet the cached variant's assumptions (every pointer 16-byte aligned,
every integer a 32-bit one) and whose variant is in the cache (``cache.py``) loads that binary once per process
and device and launches it through the driver (``driver.py``), without importing triton. Anything else goes
through Triton's JIT, which compiles or loads the same variant: a miss, a binary that fails to load, other
arguments, the interpreter, ``ZTRITON_COMPILED=0``. A JIT launch of aligned arguments stores the variant it
compiled in the cache, and the first such miss in a process starts a background fill of the common variants
(``warmup.fill_in_background``), so that the next process finds them. Both routes run the same machine code.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from . import cache, state

__all__ = ["direct_enabled", "launch", "loaded_variants", "preload"]

logger = logging.getLogger("ztriton")

_INT32 = (-(2 ** 31), 2 ** 31)
_lock = threading.Lock()
# (device index, variant) -> the loaded function, or None where this process found no usable entry.
_functions: dict[tuple[int, str], Any] = {}
_saved: set[str] = set()  # variants this process stored from its JIT launches
# (device index, kernel, *meta items) -> _functions' entry for that variant (meta dicts are built in one key order).
_by_meta: dict[tuple, Any] = {}
_UNSEEN = object()


def direct_enabled() -> bool:
    """Whether launches may come from the compiled cache (``ZTRITON_COMPILED=0`` turns it off: JIT only)."""
    return os.environ.get("ZTRITON_COMPILED", "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def _folder(device_index: int) -> Path | None:
    """The cache folder of this triton, ``device_index``'s architecture and these kernels (None without triton)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return cache.key_dir(major * 10 + minor)


def loaded_variants() -> list[tuple[int, str]]:
    """(device index, variant) of every binary this process has loaded from the cache."""
    return sorted(k for k, v in _functions.items() if v is not None)


def preload(device_index: int, kernel: str, meta: dict[str, Any]) -> bool:
    """Load this variant's binary from the cache on the device now, as its first launch would; whether it loaded.
    A miss is not remembered: the entry may still be written (another rank's JIT, the background fill) before the
    first launch asks."""
    return _function(device_index, kernel, meta, remember_miss=False) is not None


def launch(kernel: str, grid: tuple, args: tuple, meta: dict[str, Any], stream: torch.cuda.Stream | None) -> None:
    """Launch ``kernel`` (a name in ``variants.py``) with ``meta`` over ``grid`` on ``stream`` (None: the CPU,
    under the interpreter), counted in ``state.launches``."""
    state.count_launch()
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else int(a) for a in args]
    fits = _fits(args, values)
    if stream is not None and fits and direct_enabled() and not state.interpreter_on():
        function = _function(stream.device.index, kernel, meta)
        if function is not None:
            function.launch(grid, stream.cuda_stream, values)
            return
    compiled = _jit_launch(kernel, grid, args, meta)
    if stream is not None and fits and compiled is not None:
        _keep(stream.device.index, kernel, meta, compiled)


def _fits(args: tuple, values: list[int]) -> bool:
    """Whether the arguments meet a cached variant's assumptions: pointers 16-byte aligned (what Triton
    specialises on), integers 32-bit (the kernels' integers are never specialised on their value: ``copy.py``)."""
    for arg, value in zip(args, values):
        if isinstance(arg, torch.Tensor):
            if value % 16:
                return False
        elif not _INT32[0] <= value < _INT32[1]:
            return False
    return True


def _function(device_index: int, kernel: str, meta: dict[str, Any], remember_miss: bool = True):
    """The loaded function of this variant on this device, loading it from the cache the first time; None on a
    miss or a failed load (remembered unless ``remember_miss`` is false: the process asks the disk once per
    variant). Found by the meta's values first: naming the variant hashes its meta, host time that every launch
    would pay again."""
    key = (device_index, kernel, *meta.items())
    function = _by_meta.get(key, _UNSEEN)
    if function is not _UNSEEN:
        return function
    slot = (device_index, cache.variant_name(kernel, meta))
    with _lock:
        function = _functions[slot] if slot in _functions else _load(device_index, slot[1])
        if function is not None or remember_miss:
            _functions[slot] = _by_meta[key] = function
    return function


def _load(device_index: int, variant: str):
    folder = _folder(device_index)
    entry = None if folder is None else cache.read_entry(folder, variant)
    if entry is None:
        return None
    try:
        from .driver import load

        return load(device_index, entry.binary, entry["name"], entry["arg_types"], entry["scratch_args"],
                    entry["num_warps"], entry["shared"])
    except Exception as exc:  # noqa: BLE001 -- a binary the driver refuses is a miss: the JIT compiles it
        logger.debug("ztriton: compiled kernel %s did not load (%s): compiling it instead", variant, exc)
        return None


def _jit_launch(kernel: str, grid: tuple, args: tuple, meta: dict[str, Any]):
    """Launch through Triton's JIT (imports triton, once); returns what the JIT returns (its compiled kernel)."""
    from .variants import jit_kwargs

    jit = state.jit_kernels()
    fn = jit.copy_words if kernel == "copy_words_kernel" else jit.gather_tile
    return fn[grid](*args, **jit_kwargs(meta, jit.dtypes))


def _keep(device_index: int, kernel: str, meta: dict[str, Any], compiled: Any) -> None:
    """Store a JIT-compiled variant in the cache (once per process and variant) and, on the process's first
    miss, start the background fill of the common variants. Failures are logged at debug level only."""
    variant = cache.variant_name(kernel, meta)
    if variant in _saved:
        return
    _saved.add(variant)
    try:
        from .build import entry_of

        folder = _folder(device_index)
        entry = entry_of(compiled)
        if folder is None or entry is None:
            return
        if cache.read_entry(folder, variant) is None:
            cache.write_entry(folder, variant, *entry)
            from .warmup import fill_in_background

            fill_in_background(device_index)
    except Exception as exc:  # noqa: BLE001 -- the cache is an optimisation: the launch itself has succeeded
        logger.debug("ztriton: could not store compiled kernel %s (%s)", variant, exc)
