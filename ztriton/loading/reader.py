"""The staged read-and-pack: checked jobs -> batches of byte ranges -> staging buffers -> ``out``.

The parts of all jobs are cut into *batches* that each fit one host staging buffer (from the
process's ring, :mod:`ztriton.staging`). A batch's byte ranges are sorted by file and offset and
neighbours merged, so each batch is a few ``preadv`` calls straight into the buffer. Reader threads
fill buffers ahead while the main thread moves the previous one on: to the device (a second stream,
into one of two device staging buffers), cast to ``out``'s dtype where the checkpoint's differs, and
written with the window kernel (``pack_slices``), which also zeroes a finished job's padding.

So on a GPU the disk reads, host-to-device copies and packs overlap. Beyond the outs, the device
holds two staging buffers (plus, when dtypes differ, the cast of one batch in ``out``'s dtype); the
host holds ``threads + 1`` buffers.

Atomicity: a job whose bytes fit one buffer is never split across batches, so it is written by one
launch, after all its bytes were read. A larger job is written batch by batch; if a read fails
halfway, the error names the jobs written in full, the one written in part (and how far), and says
that the others were left as they were.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ztriton import staging
from ztriton.kernels import pack_slices
from ztriton.layout import is_int
from ztriton.loading.checkpoint import CheckpointError, TensorInfo, close_files, open_files, read_into
from ztriton.loading.targets import Job
from ztriton.memory import kernels_run_on, synchronize
from ztriton.progress import bar as progress_bar

__all__ = ["DEFAULT_STAGING_BYTES", "DEFAULT_THREADS", "MAX_STAGING_BYTES", "MAX_THREADS", "MIN_STAGING_BYTES",
           "check_options", "run_jobs"]

MiB = 1 << 20
# One host staging buffer: large enough that a preadv and a host-to-device copy run at full speed
# (their fixed costs are tens of microseconds), small enough that threads + 1 of them stay a small
# fraction of host memory and two of them of device memory.
DEFAULT_STAGING_BYTES = 64 * MiB
# Below this the per-batch costs dominate; tests go that low to exercise batching on tiny tensors.
MIN_STAGING_BYTES = 64
# A byte count torch can allocate (int64); one buffer never exceeds what the load needs anyway.
MAX_STAGING_BYTES = 2**63 - 1
# Reader threads: one read runs while another buffer's bytes go to the device; a second keeps the
# disk busy through a read's fixed costs.
DEFAULT_THREADS = 2
# Each thread holds one staging buffer: far more than a disk's queue depth only takes host memory.
MAX_THREADS = 64
# Staged ranges start at multiples of 16 bytes: any dtype can be viewed there and the kernels move
# 16-byte words.
ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass
class _Item:
    """``count`` elements of ``tensor`` from ``start`` go to ``out[offset:]`` of job ``job``; they sit
    at byte ``pos`` of the staging buffer."""

    job: int
    tensor: TensorInfo
    start: int
    count: int
    offset: int
    pos: int = -1

    @property
    def nbytes(self) -> int:
        return self.count * self.tensor.dtype.itemsize

    @property
    def file_offset(self) -> int:
        return self.tensor.offset + self.start * self.tensor.dtype.itemsize


@dataclass
class _Read:
    file: Path
    offset: int
    nbytes: int
    pos: int


@dataclass
class _Batch:
    items: list[_Item]  # job by job, each job's items in out order
    reads: list[_Read] = field(default_factory=list)
    used: int = 0  # bytes of the staging buffer in use
    finishing: set[int] = field(default_factory=set)  # jobs whose last item is here

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


def _lay_out(batch: _Batch) -> _Batch:
    """Turn a batch's items into reads: sorted by file and offset, neighbours (and repeats) merged
    where the merged buffer position keeps every item aligned to its element size."""
    order = sorted(batch.items, key=lambda it: (str(it.tensor.file), it.file_offset))
    pos = 0
    current: _Read | None = None
    for item in order:
        begin, itemsize = item.file_offset, item.tensor.dtype.itemsize
        if (current is not None and current.file == item.tensor.file and current.offset <= begin
                <= current.offset + current.nbytes and (begin - current.offset) % itemsize == 0):
            current.nbytes = max(current.nbytes, begin + item.nbytes - current.offset)
        else:
            if current is not None:
                pos = current.pos + _aligned(current.nbytes)
            current = _Read(item.tensor.file, begin, item.nbytes, pos)
            batch.reads.append(current)
        item.pos = current.pos + begin - current.offset
    batch.used = current.pos + _aligned(current.nbytes) if current else 0
    return batch


def make_batches(jobs: list[Job], order: list[int], capacity: int) -> list[_Batch]:
    """Cut the jobs' parts (jobs in ``order``) into batches of at most ``capacity`` staged bytes."""
    batches: list[_Batch] = []
    items: list[_Item] = []
    room = capacity

    def close():
        nonlocal items, room
        if items:
            batches.append(_lay_out(_Batch(items)))
        items, room = [], capacity

    for j in order:
        job = jobs[j]
        need = sum(_aligned(p.count * p.tensor.dtype.itemsize) for p in job.parts)
        if need > room and need <= capacity:
            close()  # keep a job that fits one buffer in one batch: it is then written in one go
        for part in job.parts:
            itemsize = part.tensor.dtype.itemsize
            start, count, offset = part.start, part.count, part.offset
            while count:
                take = min(count, room // itemsize)
                if take == 0:
                    close()
                    continue
                items.append(_Item(j, part.tensor, start, take, offset))
                room -= _aligned(take * itemsize)
                start, count, offset = start + take, count - take, offset + take
    close()
    # A job finishes in the last batch that holds one of its items.
    last_batch: dict[int, _Batch] = {}
    for batch in batches:
        for item in batch.items:
            last_batch[item.job] = batch
    for j, batch in last_batch.items():
        batch.finishing.add(j)
    return batches


class _Events:
    """Several CUDA events as one, for a staging buffer read by copies to several devices."""

    def __init__(self, events: list):
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


class _DeviceStaging:
    """Two device staging buffers per CUDA device and a copy stream: batch k's host-to-device copy
    runs while batch k-1 is packed; a buffer is refilled only after the packs that read it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buffers: dict[torch.device, list[torch.Tensor]] = {}
        self.free_events: dict[torch.device, list] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.turn: dict[torch.device, int] = {}

    def prepare(self, device: torch.device) -> None:
        if device not in self.buffers:
            self.buffers[device] = [torch.empty(self.capacity, dtype=torch.uint8, device=device) for _ in range(2)]
            self.free_events[device] = [None, None]
            self.streams[device] = torch.cuda.Stream(device)
            self.turn[device] = 0

    def upload(self, host: torch.Tensor, used: int, device: torch.device):
        """Copy ``host[:used]`` to a device staging buffer; (device buffer, slot, copy-done event).

        The device's current stream waits for the copy, so work queued on it after this call sees
        the bytes."""
        slot = self.turn[device]
        self.turn[device] ^= 1
        target = self.buffers[device][slot]
        stream = self.streams[device]
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if self.free_events[device][slot] is not None:
                stream.wait_event(self.free_events[device][slot])
            target[:used].copy_(host[:used], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        torch.cuda.current_stream(device).wait_event(copied)
        return target, slot, copied

    def done(self, device: torch.device, slot: int) -> None:
        """Mark the end of the packs reading buffer ``slot`` (queued on the current stream)."""
        with torch.cuda.device(device):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self.free_events[device][slot] = event


class _Progress:
    """Which jobs are written, in full or in part: what an error midway must say."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.full: list[int] = []
        self.loaded: dict[int, int] = {}  # job -> elements written so far

    def describe(self) -> str:
        if not self.full and not self.loaded:
            return "nothing was written"
        full = [self.jobs[j].name for j in self.full]
        parts = [f"written in full: {full[:10]}{' ...' if len(full) > 10 else ''} ({len(full)} targets)"]
        partial = {j: n for j, n in self.loaded.items() if j not in set(self.full)}
        for j, n in partial.items():
            parts.append(f"written in part: {self.jobs[j].name!r} (elements [0, {n}) of its out hold checkpoint data, "
                         "the rest its old values)")
        untouched = len(self.jobs) - len(full) - len(partial)
        parts.append(f"the other {untouched} targets are as they were")
        return "; ".join(parts)


def _read_batch(batch: _Batch, buffer: torch.Tensor, fds: dict[Path, int]) -> None:
    view = memoryview(buffer.numpy())
    for read in batch.reads:
        read_into(fds[read.file], view[read.pos:read.pos + read.nbytes], read.offset, read.file)


def _write_job(job: Job, items: list[_Item], staged: torch.Tensor, finishing: bool) -> None:
    """Write one job's items of a batch (one contiguous range of ``out``); zero its padding if done."""
    out = job.out
    lo = items[0].offset
    slices = []
    for item in items:
        src = staged[item.pos:item.pos + item.nbytes].view(item.tensor.dtype)
        if src.dtype != out.dtype:
            src = src.to(out.dtype)
        slices.append((src, 0, item.count, item.offset - lo))
    if kernels_run_on(out.device):
        hi = items[-1].offset + items[-1].count
        pack_slices(out[lo:] if finishing else out[lo:hi], slices)
    else:  # CPU outs without the interpreter (e.g. offloaded params): torch copies
        for src, _, count, offset in slices:
            out[lo + offset:lo + offset + count].copy_(src)
        if finishing:
            out[job.count:].zero_()


def _zero(out: torch.Tensor) -> None:
    if kernels_run_on(out.device):
        pack_slices(out, [])
    else:
        out.zero_()


class _JobReader:
    def __init__(self, jobs: list[Job], capacity: int, threads: int, progress: bool):
        self.jobs = jobs
        self.capacity = capacity
        self.threads = threads
        self.progress = progress
        self.status = _Progress(jobs)
        self.device_staging = _DeviceStaging(capacity)
        self.bytes_read = 0

    def read_all(self) -> int:
        order = sorted(range(len(self.jobs)), key=lambda j: self.jobs[j].first_byte)
        batches = make_batches(self.jobs, order, self.capacity)
        devices = {job.out.device for job in self.jobs}
        cuda = [d for d in devices if d.type == "cuda"]
        for device in cuda:  # allocated before any write: running out of memory here changes nothing
            self.device_staging.prepare(device)
        files = sorted({read.file for batch in batches for read in batch.reads})
        bar = progress_bar(sum(b.nbytes for b in batches), "Loading checkpoint (ztriton)", wanted=self.progress)
        fds = open_files(files)
        try:
            self._stream(batches, fds, bar)
            for j, job in enumerate(self.jobs):
                if job.count == 0:
                    _zero(job.out)  # all padding (a ZeRO-3 rank past the end of a small tensor)
                    self.status.full.append(j)
            for device in devices:
                synchronize(device)
        except BaseException as exc:
            for device in devices:
                synchronize(device)
            explained = self._explain(exc)
            if explained is exc:
                raise
            raise explained from exc
        finally:
            close_files(fds)
            bar.close()
        return self.bytes_read

    def _stream(self, batches: list[_Batch], fds: dict, bar) -> None:
        ring = staging.ring(self.capacity, count=self.threads + 1)
        inflight: collections.deque = collections.deque()
        pending = iter(batches)
        upcoming = next(pending, None)
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ztriton-load") as pool:
            try:
                while upcoming is not None or inflight:
                    if upcoming is not None and len(inflight) <= self.threads:
                        # Never wait for a buffer while holding one: another user of the shared ring
                        # might be waiting for ours.
                        buffer = ring.acquire(block=not inflight)
                        if buffer is not None:
                            inflight.append((upcoming, buffer, pool.submit(_read_batch, upcoming, buffer, fds)))
                            upcoming = next(pending, None)
                            continue
                    batch, buffer, future = inflight.popleft()
                    try:
                        future.result()
                        self.bytes_read += batch.nbytes
                        event = self._write(batch, buffer)
                    except BaseException:
                        ring.release(buffer)
                        raise
                    ring.release(buffer, event)
                    bar.update(batch.nbytes)
            finally:
                for _, buffer, future in inflight:  # after an error: let the reads end, return buffers
                    future.exception()
                    ring.release(buffer)

    def _write(self, batch: _Batch, host: torch.Tensor):
        """Move a read batch to its devices and write every job's items; the host buffer's release event."""
        by_device: dict[torch.device, list[tuple[int, list[_Item]]]] = {}
        for j, items in itertools.groupby(batch.items, key=lambda it: it.job):
            by_device.setdefault(self.jobs[j].out.device, []).append((j, list(items)))
        events = []
        for device, groups in by_device.items():
            slot = None
            if device.type == "cuda":
                staged, slot, copied = self.device_staging.upload(host, batch.used, device)
                events.append(copied)
            else:
                staged = host
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                for j, items in groups:
                    finishing = j in batch.finishing
                    _write_job(self.jobs[j], items, staged, finishing)
                    self.status.loaded[j] = items[-1].offset + items[-1].count
                    if finishing:
                        self.status.full.append(j)
            if slot is not None:
                self.device_staging.done(device, slot)
        return _Events(events) if events else None

    def _explain(self, exc: BaseException) -> BaseException:
        """The error to raise: an I/O failure as a CheckpointError saying what was written."""
        status = self.status.describe()
        if isinstance(exc, (OSError, CheckpointError)):
            where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
            return CheckpointError(f"loading failed while reading the checkpoint{where}: {exc}; {status}")
        if hasattr(exc, "add_note"):
            exc.add_note(f"ztriton load: {status}")
        return exc



def check_options(*, staging_bytes: object, threads: object, progress: object) -> None:
    """Refuse a load's options before anything is opened, read or written (TypeError for the wrong
    type, ValueError out of range, each naming the argument)."""
    if staging_bytes is not None:
        if not is_int(staging_bytes):
            raise TypeError(f"staging_bytes must be an int or None (default {DEFAULT_STAGING_BYTES}), got "
                            f"{type(staging_bytes).__name__}")
        if not MIN_STAGING_BYTES <= staging_bytes <= MAX_STAGING_BYTES:
            raise ValueError(f"staging_bytes must be in [{MIN_STAGING_BYTES}, 2**63 - 1], got {staging_bytes}")
    if not is_int(threads):
        raise TypeError(f"threads must be an int (default {DEFAULT_THREADS}), got {type(threads).__name__}")
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be in [1, {MAX_THREADS}] (reader threads, each with a staging buffer), "
                         f"got {threads}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")


def staging_capacity(jobs: list[Job], staging_bytes: int | None) -> int:
    """Bytes of one staging buffer: the requested size (or the default), no more than the load needs."""
    if staging_bytes is None:
        staging_bytes = DEFAULT_STAGING_BYTES
    need = sum(_aligned(p.count * p.tensor.dtype.itemsize) for job in jobs for p in job.parts)
    return max(ALIGN, min(staging_bytes // ALIGN * ALIGN, need))


def run_jobs(jobs: list[Job], *, staging_bytes: int | None = None, threads: int = DEFAULT_THREADS,
             progress: bool = False) -> int:
    """Read and write every job; the number of checkpoint bytes read."""
    check_options(staging_bytes=staging_bytes, threads=threads, progress=progress)
    capacity = staging_capacity(jobs, staging_bytes)
    return _JobReader(jobs, capacity, threads, progress).read_all()
