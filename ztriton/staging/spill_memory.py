"""The spill pool: host memory that params live in while a tier moves them off the device (flatten's
evict and host tiers, defragment's evict path).

Pinned for a CUDA device (registered with CUDA, exactly the size asked for, rounded to 2 MiB, not torch's
power of two), so that each param goes out and comes back with one DMA and no host copy; kept by
:class:`SpillPool` for the next borrower and freed on ``staging.release()`` or after ``idle_s`` seconds
unused. A loan ends when the last tensor over its memory is gone, so memory a param still points at is
never lent again.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import weakref

import numpy as np
import torch

from ztriton import memory
from ztriton.layout import is_int
from ztriton.staging.idle import DEFAULT_IDLE_S, start_idle_timer

__all__ = ["SPILL_GRANULE", "SpillPool", "spill_pool"]

# Spill blocks are whole multiples of this (page- and huge-page-aligned): a request of a few bytes more than
# the block cannot force a new one, and a 4.3 GiB request holds 4.3 GiB, where torch's pinned allocator
# would round it up to 8 GiB.
SPILL_GRANULE = 2 << 20
_PAGE = 4096
# cudaHostRegisterPortable: the pages count as pinned for every CUDA context, not only the registering one.
_PORTABLE = 1
# Spill memory whose unregistering failed: freeing it would hand registered pages back to the allocator,
# so it is kept for the life of the process (never expected to happen; each case is logged).
_UNFREEABLE: list[torch.Tensor] = []


def _host_register(address: int, nbytes: int, device_index: int) -> int | str:
    """``cudaHostRegister`` of ``[address, address + nbytes)``: 0 once pinned, else the CUDA error code (or
    the exception's text). Runs on a short-lived thread with ``device_index`` current: CUDA keeps a failed
    runtime call's error as its thread's last error, which torch's next kernel-launch check on the caller's
    thread would raise; the helper thread takes it with it. The device is set so that no context is created
    on device 0 for a process that uses another one."""
    result: list[int | str] = []

    def register() -> None:
        try:
            with torch.cuda.device(device_index):
                result.append(int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE)))
        except Exception as exc:  # noqa: BLE001 -- any failure to pin means pageable memory, said once
            result.append(f"{type(exc).__name__}: {exc}")

    helper = threading.Thread(target=register, name="ztriton-spill-pin", daemon=True)
    helper.start()
    helper.join()
    return result[0] if result else "no result"


def _host_unregister(address: int, device_index: int) -> int:
    """``cudaHostUnregister(address)`` with ``device_index`` current (the thread may be the idle timer's)."""
    with torch.cuda.device(device_index):
        return int(torch.cuda.cudart().cudaHostUnregister(address))


def _stamp(returned: list[float], _ref: object) -> None:
    """Weakref callback of a loan: when its last tensor went (lock-free: it may run inside any torch call)."""
    returned[0] = time.monotonic()


class _Block:
    """One spill allocation, and the owner of its memory.

    Lent tensors are ``torch.from_numpy`` of a numpy array whose base is this object, so the block lives
    as long as the pool or any tensor over its memory does (a param left pointing into it after a failure
    included). Only when the last of them is gone does :meth:`__del__` unregister the pages, and only then
    is the memory freed: registered memory must never go back to the allocator while registered.
    """

    def __init__(self, nbytes: int, pin_device: int | None, what: str):
        self._memory = memory.empty(nbytes + _PAGE, torch.uint8, "cpu", what)  # one page of slack to align
        start = self._memory.data_ptr()
        self.address = start + (-start) % _PAGE  # whole pages: registering never touches a neighbour's page
        self.nbytes = nbytes
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.address, False),
                                    "version": 3}
        self.pinned = self.pin_failed = False
        self.device_index = pin_device
        self.loan: weakref.ref | None = None  # the current loan's numpy array
        self.returned = [time.monotonic()]  # when the last loan ended
        if pin_device is not None:
            self._pin(pin_device, what)

    def _pin(self, device_index: int, what: str) -> None:
        error = _host_register(self.address, self.nbytes, device_index)
        if error == 0:
            self.pinned = True
            return
        self.pin_failed = True
        memory.logger.warning("ztriton: could not pin %s of host memory for the %s (cudaHostRegister: %s); using "
                              "pageable memory, its copies are slower", memory.format_bytes(self.nbytes), what, error)

    @property
    def lent(self) -> bool:
        return self.loan is not None and self.loan() is not None

    def lend(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over the first ``nbytes``; the loan lasts while any tensor over this memory does."""
        array = np.asarray(self)
        self.loan = weakref.ref(array, functools.partial(_stamp, self.returned))
        return torch.from_numpy(array)[:nbytes]

    def __del__(self) -> None:
        # Unpinned, or its allocation failed in __init__; at interpreter exit the process's end unpins it all.
        if not getattr(self, "pinned", False) or sys.is_finalizing():
            return
        try:
            error = _host_unregister(self.address, self.device_index)
        except Exception as exc:  # noqa: BLE001 -- e.g. in a forked child, where CUDA cannot start again
            error = f"{type(exc).__name__}: {exc}"
        if error != 0:
            _UNFREEABLE.append(self._memory)
            with contextlib.suppress(Exception):
                memory.logger.warning("ztriton: could not unregister %s of pinned spill memory (%s); it is kept "
                                      "until the process exits", memory.format_bytes(self.nbytes), error)


class SpillPool:
    """Host blocks lent whole to one borrower at a time, kept between borrowers. Thread safe.

    :meth:`lend` returns a free block that holds the request (the smallest), else allocates one: pinned
    for a CUDA device (by registering ordinary host memory, so it holds what was asked for), pageable for
    the CPU or where pinning fails (one warning). A loan ends when the last tensor over its memory is gone
    (the borrower drops it, or re-points the params that alias it): there is no explicit return to forget
    or to get wrong, and memory a param still points at, after a failure, is never lent to anyone else.
    A concurrent borrower, or one that finds every block lent, gets a block of its own. Free blocks that do
    not fit a request are freed before a new one is allocated (the pool grows by replacement); every free
    block is freed after ``idle_s`` seconds unused, or on :meth:`free`.
    """

    def __init__(self, *, pin: bool | None = None, idle_s: float | None = DEFAULT_IDLE_S):
        self.pin = pin  # None: pinned exactly for CUDA devices
        self.idle_s = idle_s
        self.allocations = 0  # blocks allocated so far (the tests count reuse with it)
        self._lock = threading.Lock()
        self._blocks: list[_Block] = []
        self._timer: threading.Timer | None = None

    def lend(self, nbytes: int, device: torch.device | str | None = None, what: str = "host spill") -> torch.Tensor:
        """A 1-D ``uint8`` host tensor of exactly ``nbytes`` for copies to and from ``device``."""
        if not is_int(nbytes) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        pin_device = self._pin_device(None if device is None else torch.device(device))
        with self._lock:
            block = self._fitting(nbytes, pin_device is not None)
            if block is None:
                # None fits: the free ones go first (the host need not hold old and new at once).
                self._blocks = [b for b in self._blocks if b.lent]
                block = _Block(-(-nbytes // SPILL_GRANULE) * SPILL_GRANULE, pin_device, what)
                self._blocks.append(block)
                self.allocations += 1
            loan = block.lend(nbytes)
            self._arm_timer()
        return loan

    def _pin_device(self, device: torch.device | None) -> int | None:
        """The CUDA device to register new blocks with; None for pageable blocks."""
        cuda = device is not None and device.type == "cuda"
        if not (self.pin if self.pin is not None else cuda and torch.cuda.is_available()):
            return None
        if cuda and device.index is not None:
            return device.index
        return torch.cuda.current_device() if torch.cuda.is_available() else 0

    def _fitting(self, nbytes: int, pinned: bool) -> _Block | None:
        """The smallest free block that holds ``nbytes`` (and is pinned, if asked, unless pinning failed)."""
        fits = [b for b in self._blocks
                if b.nbytes >= nbytes and not b.lent and (b.pinned or b.pin_failed or not pinned)]
        return min(fits, key=lambda b: b.nbytes, default=None)

    # ---- memory -----------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks the pool holds (lent or not)."""
        with self._lock:
            return sum(b.nbytes for b in self._blocks)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the pool's blocks that are not lent: host memory the next borrower gets without
        allocating (a memory probe counts it as used)."""
        with self._lock:
            return sum(b.nbytes for b in self._blocks if not b.lent)

    @property
    def lent(self) -> int:
        """How many of the pool's blocks are lent."""
        with self._lock:
            return sum(b.lent for b in self._blocks)

    def free(self) -> None:
        """Drop every block now. A free block's memory goes back at once; a lent one stays its borrower's
        (its tensors own it) and goes when they do, never to be lent again."""
        with self._lock:
            blocks, self._blocks = self._blocks, []
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        del blocks

    def _arm_timer(self, delay: float | None = None) -> None:
        """Under the lock: one timer at a time, while the pool holds blocks."""
        if self.idle_s is None or self._timer is not None or not self._blocks:
            return
        self._timer = start_idle_timer(self.idle_s if delay is None else delay, self._free_idle)

    def _free_idle(self, timer: threading.Timer) -> None:
        """Timer: free the blocks unused for ``idle_s``; come back for the others while any is held."""
        with self._lock:
            if self._timer is not timer:
                return  # cancelled (freed) since it was armed
            self._timer = None
            now = time.monotonic()
            idle = [b for b in self._blocks if not b.lent and now - b.returned[0] >= self.idle_s]
            self._blocks = [b for b in self._blocks if b not in idle]
            waits = [self.idle_s if b.lent else self.idle_s - (now - b.returned[0]) for b in self._blocks]
            self._arm_timer(max(0.01, min(waits, default=0.0)))
        del idle  # freed (unregistered first) outside the lock

_shared_pool = SpillPool()


def spill_pool() -> SpillPool:
    """The process's spill pool (for its figures; borrowers call ``staging.spill``)."""
    return _shared_pool


def _start_afresh_in_forked_child() -> None:
    """A forked child inherits the pool's lock in whatever state the parent's threads left it, its timer
    without a thread, and pinned registrations of the parent's CUDA context: it starts with an empty pool
    (the child's copy of the parent's blocks is dropped without unregistering, which only the parent may do)."""
    for block in _shared_pool._blocks:
        block.pinned = False
    _shared_pool._lock = threading.Lock()
    _shared_pool._timer = None
    _shared_pool._blocks = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_afresh_in_forked_child)
