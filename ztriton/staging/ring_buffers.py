"""The staging ring: a few host buffers lent one at a time, and the copies between a device and
pageable host memory that go through it.

Moving data from disk or pageable memory to a GPU goes through host buffers; allocating pinned memory
costs milliseconds per call and fragments the host, so the process keeps a few buffers and lends them
out: :func:`ring` returns the shared :class:`StagingRing` (``count`` buffers of ``buffer_bytes``, pinned
when CUDA is available), allocating each buffer on its first use. A borrower hands a buffer back with
the CUDA event of the last copy that reads it; the next borrower waits for that event, so a buffer is
never overwritten while a copy is still reading it. The memory goes back to the system on
``staging.release()`` or after ``idle_s`` seconds without a loan.

:func:`copy_staged` is the one copy between a device and (pageable) host memory that goes through the
ring, in chunks, with the device side on a copy stream so that one chunk's transfer overlaps the next
one's host copy.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

import torch

from ztriton import memory
from ztriton.layout import is_int
from ztriton.staging.idle import DEFAULT_IDLE_S, start_idle_timer

__all__ = ["DEFAULT_CHUNK_BYTES", "StagingRing", "copy_staged", "free_shared_ring", "ring"]

# Bytes of one staging buffer for copies between a device and pageable host memory: a power of two
# (torch rounds pinned blocks up to one), big enough for full copy bandwidth.
DEFAULT_CHUNK_BYTES = 64 << 20


class StagingRing:
    """``count`` host buffers of ``buffer_bytes`` each, lent one at a time.

    :meth:`acquire` blocks until a buffer is free and any copy still reading it has finished;
    :meth:`release` returns it, with the event that marks the end of that copy (or None). Thread safe.
    """

    def __init__(self, buffer_bytes: int, count: int = 2, *, pin: bool | None = None,
                 idle_s: float | None = DEFAULT_IDLE_S):
        if not is_int(buffer_bytes) or buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be an int >= 1, got {buffer_bytes!r}")
        if not is_int(count) or count < 1:
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
        self._timer = start_idle_timer(self.idle_s, self._free_if_idle)

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


def free_shared_ring() -> None:
    """Free the shared ring's memory now (allocated again on its next use)."""
    with _shared_lock:
        if _shared is not None:
            _shared.free()


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


def _start_afresh_in_forked_child() -> None:
    """A forked child inherits the shared ring's lock in whatever state the parent's threads left it: it
    starts with no ring (the parent keeps its own) and no copy streams."""
    global _shared, _shared_lock
    _shared_lock = threading.Lock()
    _shared = None
    _copy_streams.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_afresh_in_forked_child)
