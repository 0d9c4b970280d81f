"""Host staging memory, shared by the whole process: a ring of small buffers and a spill pool.

Moving data from disk or pageable memory to a GPU goes through host buffers; allocating pinned
memory costs milliseconds per call and fragments the host, so a process keeps a few buffers and
lends them out: :func:`ring` returns the shared :class:`StagingRing` (``count`` buffers of
``buffer_bytes``, pinned when CUDA is available), allocating each buffer on its first use.
A borrower hands a buffer back with the CUDA event of the last copy that reads it; the next
borrower waits for that event, so a buffer is never overwritten while a copy is still reading it.
The memory goes back to the system on :func:`release` or after ``idle_s`` seconds without a loan.

:func:`copy_staged` is the one copy between a device and (pageable) host memory that goes through the
ring, in chunks, with the device side on a copy stream so that one chunk's transfer overlaps the next
one's host copy.

:func:`spill` lends host memory that params live in while a tier moves them off the device (flatten's
evict and host tiers, defragment's evict path): pinned (registered with CUDA, exactly the size asked
for, rounded to 2 MiB, not torch's power of two), so that each param goes out and comes back with one
DMA and no host copy; kept by :class:`SpillPool` for the next call and freed like the ring's buffers.
A loan ends when the last tensor over its memory is gone, so memory a param still points at is never
lent again. This module knows nothing of what is staged: buffers are flat ``uint8`` tensors.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from typing import Callable, Iterator

import numpy as np
import torch

from ztriton import memory

__all__ = ["StagingRing", "SpillPool", "copy_staged", "ring", "release", "spill", "spill_copies", "spill_pool",
           "synchronized",
           "DEFAULT_IDLE_S", "DEFAULT_CHUNK_BYTES"]

# Bytes of one staging buffer for copies between a device and pageable host memory: a power of two
# (torch rounds pinned blocks up to one), big enough for full copy bandwidth.
DEFAULT_CHUNK_BYTES = 64 << 20

# Seconds a ring may sit unused before its memory is freed: long enough to survive the gap between
# two loads of one start-up, short enough not to hold gigabytes of pinned memory through training.
DEFAULT_IDLE_S = 30.0

# Every idle timer armed (rings and the spill pool), for the interpreter's exit to stop.
_TIMERS: "weakref.WeakSet[threading.Timer]" = weakref.WeakSet()
# At exit, wait at most this long for a timer already freeing (unregistering pinned memory takes milliseconds).
_EXIT_WAIT_S = 10.0


def _start_idle_timer(delay: float, callback) -> threading.Timer:
    """A started daemon timer calling ``callback(timer)`` after ``delay`` seconds, known to the exit's stop."""
    timer = threading.Timer(delay, callback)
    timer.args = (timer,)
    timer.name = "ztriton-staging-idle"
    timer.daemon = True
    _TIMERS.add(timer)
    timer.start()
    return timer


class StagingRing:
    """``count`` host buffers of ``buffer_bytes`` each, lent one at a time.

    :meth:`acquire` blocks until a buffer is free and any copy still reading it has finished;
    :meth:`release` returns it, with the event that marks the end of that copy (or None). Thread safe.
    """

    def __init__(self, buffer_bytes: int, count: int = 2, *, pin: bool | None = None,
                 idle_s: float | None = DEFAULT_IDLE_S):
        if not isinstance(buffer_bytes, int) or isinstance(buffer_bytes, bool) or buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be an int >= 1, got {buffer_bytes!r}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        self.idle_s = idle_s
        self._lock = threading.Condition()
        self._buffers: list[torch.Tensor | None] = [None] * count  # allocated on first loan
        self._free: list[int] = list(range(count))
        self._events: list[object | None] = [None] * count
        self._lent: dict[int, int] = {}  # data_ptr -> slot
        self._timer: threading.Timer | None = None

    # ---- loans ------------------------------------------------------------------------------

    def acquire(self, block: bool = True) -> torch.Tensor | None:
        """A free buffer (1-D ``uint8`` of ``buffer_bytes``), once no earlier copy reads it.

        With ``block=False``, None when every buffer is lent: a borrower holding buffers itself must
        not wait for one (two users of the shared ring would each wait for the other's), it should
        finish with one of its own first.
        """
        with self._lock:
            self._cancel_timer()
            while not self._free:
                if not block:
                    return None
                self._lock.wait()
            slot = self._free.pop()
            event, self._events[slot] = self._events[slot], None
            buffer = self._buffers[slot]
            if buffer is None:
                try:
                    buffer = memory.host_empty(self.buffer_bytes, torch.uint8, "staging buffer", pin=self.pinned)
                except BaseException:
                    self._free.append(slot)
                    raise
                self._buffers[slot] = buffer
            self._lent[buffer.data_ptr()] = slot
        if event is not None:
            event.synchronize()
        return buffer

    def release(self, buffer: torch.Tensor, event: object | None = None) -> None:
        """Give ``buffer`` back; ``event`` (e.g. a ``torch.cuda.Event``) marks the end of the last copy
        that reads it: the next borrower waits for it."""
        with self._lock:
            slot = self._lent.pop(buffer.data_ptr(), None)
            if slot is None:
                raise ValueError("release() of a buffer this ring did not lend (or already got back)")
            self._events[slot] = event
            self._free.append(slot)
            self._lock.notify()
            if not self._lent:
                self._arm_timer()

    @contextlib.contextmanager
    def lend(self) -> Iterator[torch.Tensor]:
        """``with ring.lend() as buffer:`` for borrowers that finish with the buffer inside the block."""
        buffer = self.acquire()
        try:
            yield buffer
        finally:
            self.release(buffer)

    # ---- memory -----------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._buffers if b is not None)

    @property
    def lent(self) -> int:
        with self._lock:
            return len(self._lent)

    def free(self) -> None:
        """Return every buffer's memory to the system now (after their pending copies). Refused while
        a buffer is lent: its borrower may still be writing into it."""
        with self._lock:
            if self._lent:
                raise RuntimeError(f"{len(self._lent)} staging buffer(s) are still lent; release them first")
            self._cancel_timer()
            events = [e for e in self._events if e is not None]
            self._events = [None] * self.count
            self._buffers = [None] * self.count
        for event in events:
            event.synchronize()

    def _arm_timer(self) -> None:
        if self.idle_s is None or not any(b is not None for b in self._buffers):
            return
        self._timer = _start_idle_timer(self.idle_s, self._free_if_idle)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _free_if_idle(self, timer: threading.Timer) -> None:
        with self._lock:
            if self._lent or self._timer is not timer:
                return  # lent again (or freed, or re-armed) since this timer was armed
            self._timer = None
        with contextlib.suppress(RuntimeError):  # lent again in between: not idle after all
            self.free()


_shared: StagingRing | None = None
_shared_lock = threading.Lock()


def ring(buffer_bytes: int, count: int = 2, *, pin: bool | None = None) -> StagingRing:
    """The process's shared ring, with at least ``count`` buffers of at least ``buffer_bytes``.

    The current ring is kept when it is big enough (its buffers stay allocated between users);
    otherwise, if none of its buffers is lent, it is freed and replaced by one of the requested size;
    if some are lent, a private ring is returned for this caller (so concurrent users never wait on
    each other's sizes).
    """
    global _shared
    want_pin = torch.cuda.is_available() if pin is None else bool(pin)
    with _shared_lock:
        current = _shared
        if (current is not None and current.buffer_bytes >= buffer_bytes and current.count >= count
                and current.pinned == want_pin):
            return current
        if current is not None and current.lent:
            return StagingRing(buffer_bytes, count, pin=want_pin)
        if current is not None:
            current.free()
        _shared = StagingRing(buffer_bytes, count, pin=want_pin)
        return _shared


def release() -> None:
    """Free the shared ring's and the spill pool's memory now (allocated again on the next use). Spill
    memory that tensors still point at stays theirs until they are gone (see :meth:`SpillPool.free`)."""
    with _shared_lock:
        if _shared is not None:
            _shared.free()
    _spill_pool.free()


# --------------------------------------------------------------------------------------------
# Copies through the ring.

_copy_streams: dict[torch.device, object] = {}


def _copy_stream(device: torch.device):
    """One side stream per CUDA device for staged copies (created once: streams are not freed)."""
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    return stream


def copy_staged(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int | None = None) -> None:
    """``dst.copy_(src)`` for two contiguous tensors of one dtype and numel, through the shared ring.

    For a device and pageable host memory (either direction; host to host works too, the same code
    the tests run on the CPU): each chunk goes through a ring buffer, at most two in flight, the
    device side on a side stream, so that chunk k's transfer overlaps chunk k+1's host copy. Returns
    once ``dst`` holds the values (device-to-host) or once the caller's stream is ordered after the
    copies (host-to-device). Nothing but the ring's buffers is allocated, and those only on its first use.
    """
    if dst.dtype != src.dtype or dst.numel() != src.numel() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"copy_staged needs two contiguous tensors of one dtype and numel, got {dst.dtype} "
                         f"{tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
    total = src.numel() * src.element_size()
    if total == 0:
        return
    out, inp = memory.flat_bytes(dst), memory.flat_bytes(src)
    size = min(chunk_bytes or DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_BYTES)
    shared = ring(min(size, max(1 << 20, 1 << (total - 1).bit_length())), count=2)
    cuda = next((t.device for t in (dst, src) if t.device.type == "cuda"), None)
    stream = _copy_stream(cuda) if cuda is not None else None
    buffers = [shared.acquire()]
    try:
        extra = shared.acquire(block=False)  # never wait for a second buffer while holding one
    except BaseException:  # its first allocation failed: the first buffer goes back, not leaked as lent
        shared.release(buffers[0])
        raise
    if extra is not None:
        buffers.append(extra)
    step = min(buffers[0].numel(), size)  # a bigger shared ring (the loader's) still copies in chunk_bytes
    events: list[object | None] = [None] * len(buffers)
    try:
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(cuda))  # the source was written on the caller's stream
        if src.device.type == "cuda" and dst.device.type != "cuda":
            _to_host(out, inp, buffers, events, step, stream)
        else:
            _to_device_or_host(out, inp, buffers, events, step, stream)
        if stream is not None:
            torch.cuda.current_stream(cuda).wait_stream(stream)  # later work on dst sees the copies
    finally:
        for buffer, event in zip(buffers, events):
            shared.release(buffer, event)


def _to_host(out, inp, buffers, events, step, stream) -> None:
    """Device -> ring buffer (side stream) -> host; chunk k+1's transfer runs while chunk k is copied out."""
    pending: list[tuple[int, int] | None] = [None] * len(buffers)

    def drain(slot: int) -> None:
        if pending[slot] is not None:
            start, n = pending[slot]
            events[slot].synchronize()
            out[start:start + n].copy_(buffers[slot][:n])
            pending[slot] = None

    for k, start in enumerate(range(0, inp.numel(), step)):
        slot, n = k % len(buffers), min(step, inp.numel() - start)
        drain(slot)
        with torch.cuda.stream(stream):
            buffers[slot][:n].copy_(inp[start:start + n], non_blocking=True)
            events[slot] = torch.cuda.Event()
            events[slot].record(stream)
        pending[slot] = (start, n)
    for slot in range(len(buffers)):
        drain(slot)
    events[:] = [None] * len(buffers)  # every copy has landed


def _to_device_or_host(out, inp, buffers, events, step, stream) -> None:
    """Host -> ring buffer -> device (side stream); a buffer is refilled once its last transfer ended.
    Without a device (host to host) the same steps run synchronously."""
    for k, start in enumerate(range(0, inp.numel(), step)):
        slot, n = k % len(buffers), min(step, inp.numel() - start)
        if events[slot] is not None:
            events[slot].synchronize()
        buffers[slot][:n].copy_(inp[start:start + n])
        if stream is None:
            out[start:start + n].copy_(buffers[slot][:n])
            continue
        with torch.cuda.stream(stream):
            out[start:start + n].copy_(buffers[slot][:n], non_blocking=True)
            events[slot] = torch.cuda.Event()
            events[slot].record(stream)


# --------------------------------------------------------------------------------------------
# The spill pool: pinned host memory that params live in while a tier moves them off the device.

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
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
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
        self._timer = _start_idle_timer(self.idle_s if delay is None else delay, self._free_idle)

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


_spill_pool = SpillPool()


def _start_afresh_in_forked_child() -> None:
    """A forked child inherits the shared ring's and the pool's locks in whatever state the parent's threads
    left them, their timers without threads, and pinned registrations of the parent's CUDA context: it
    starts with an empty ring and pool (the parent keeps its own; the child's copy of their memory is
    dropped without unregistering, which only the parent may do)."""
    global _shared, _shared_lock
    for block in _spill_pool._blocks:
        block.pinned = False
    _spill_pool._lock = threading.Lock()
    _spill_pool._timer = None
    _spill_pool._blocks = []
    _shared_lock = threading.Lock()
    _shared = None
    _copy_streams.clear()
    _TIMERS.clear()  # the parent's timers: no thread here, nothing for the child's exit to cancel


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_afresh_in_forked_child)


def _stop_timers_at_exit() -> None:
    """At interpreter exit: cancel the idle timers, and wait for one already freeing memory. The timers are
    daemon threads; one still inside CUDA (``cudaHostUnregister``, an event's wait) when the interpreter
    finalises is stopped where it stands, and a thread stopped inside C++ code can abort the whole process
    ("FATAL: exception not rethrown") after the user's script has finished. The memory itself is the
    process's to drop at exit. A cancelled timer that has not fired ends at once."""
    timers = [t for t in list(_TIMERS) if t is not threading.current_thread()]
    for timer in timers:
        timer.cancel()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for timer in timers:
        if timer.is_alive():
            timer.join(timeout=max(0.0, deadline - time.monotonic()))


atexit.register(_stop_timers_at_exit)


def spill_pool() -> SpillPool:
    """The process's spill pool (for its figures; borrowers call :func:`spill`)."""
    return _spill_pool


def spill(nbytes: int, device: torch.device | str | None = None, what: str = "host spill") -> torch.Tensor:
    """``nbytes`` of host memory from the process's :class:`SpillPool` for copies to and from ``device``
    (pinned for a CUDA device): a 1-D ``uint8`` tensor; view it as the dtype it holds.

    Copies into and out of it should be ``non_blocking`` (one DMA each, no host copy) inside
    :func:`synchronized`. The loan ends when the last tensor over this memory is gone; the memory is kept
    for the next borrower and freed by :func:`release` or after ``DEFAULT_IDLE_S`` seconds unused. ``what``
    names the memory in an allocation error (and for ``memory.fault_hook``).
    """
    return _spill_pool.lend(nbytes, device, what)


def spill_copies(sources: list[torch.Tensor], device: torch.device, what: str,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
    """Copies of ``sources`` (one dtype, on ``device``) in one :func:`spill` loan, back to back: a contiguous
    1-D host view per source, in order, returned once every copy has landed. ``copy(out, src)`` queues one
    (default: ``out`` viewed as ``src``'s shape, one asynchronous DMA; a caller with strided sources it must
    not make contiguous on their device passes its own). The caller re-points its tensors at the views only
    now, with every copy complete: a failure on the way leaves them where they were."""
    if not sources:
        return []
    dtype = sources[0].dtype
    numels = [src.numel() for src in sources]
    staged = spill(sum(numels) * sources[0].element_size(), device, what).view(dtype)
    views, at = [], 0
    with synchronized(device):
        for src, n in zip(sources, numels):
            out = staged.narrow(0, at, n)
            if copy is None:
                out.view(src.shape).copy_(src, non_blocking=True)
            else:
                copy(out, src)
            views.append(out)
            at += n
    return views


@contextlib.contextmanager
def synchronized(device: torch.device | str) -> Iterator[None]:
    """Asynchronous copies queued inside (to or from spill memory) have finished when the block exits,
    normally or by an exception: nobody may read a copy's destination before, and its spill memory must
    not be freed or lent again under a copy still running."""
    try:
        yield
    finally:
        memory.synchronize(torch.device(device))
