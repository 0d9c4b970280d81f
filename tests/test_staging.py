"""The process-wide ring of host staging buffers: loans, waits, events, freeing, sharing."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ztriton import staging
from ztriton.memory import OutOfMemory
from ztriton.staging import StagingRing


class FakeEvent:
    """Stands in for a CUDA event: records when the ring waits on it."""

    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_buffers_are_distinct_reused_and_allocated_on_first_loan():
    ring = StagingRing(100, count=3, idle_s=None)
    assert ring.allocated_bytes == 0 and not ring.pinned  # no CUDA here: pageable
    a, b = ring.acquire(), ring.acquire()
    assert a.dtype == torch.uint8 and a.shape == (100,) and b.shape == (100,)
    assert a.data_ptr() != b.data_ptr() and ring.allocated_bytes == 200 and ring.lent == 2
    ring.release(a)
    again = ring.acquire()
    assert again.data_ptr() == a.data_ptr()  # the same memory, not a new allocation
    assert ring.allocated_bytes == 200
    ring.release(again)
    ring.release(b)
    assert ring.lent == 0


def test_nonblocking_acquire_returns_none_when_all_are_lent():
    ring = StagingRing(8, count=2, idle_s=None)
    held = [ring.acquire(block=False), ring.acquire(block=False)]
    assert all(h is not None for h in held)
    assert ring.acquire(block=False) is None
    ring.release(held[0])
    assert ring.acquire(block=False).data_ptr() == held[0].data_ptr()


def test_blocking_acquire_waits_for_a_release():
    ring = StagingRing(8, count=1, idle_s=None)
    first = ring.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire()))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting: the only buffer is lent
    ring.release(first)
    waiter.join(timeout=5)
    assert got and got[0].data_ptr() == first.data_ptr()


def test_next_borrower_waits_for_the_release_event():
    ring = StagingRing(8, count=1, idle_s=None)
    event = FakeEvent()
    ring.release(ring.acquire(), event)
    assert event.waited == 0  # releasing does not wait
    ring.release(ring.acquire())
    assert event.waited == 1  # the next loan did, once
    ring.release(ring.acquire())
    assert event.waited == 1


def test_release_of_a_foreign_or_returned_buffer_is_refused():
    ring = StagingRing(8, count=1, idle_s=None)
    buffer = ring.acquire()
    with pytest.raises(ValueError, match="did not lend"):
        ring.release(torch.empty(8, dtype=torch.uint8))
    ring.release(buffer)
    with pytest.raises(ValueError, match="already got back"):
        ring.release(buffer)


def test_free_returns_memory_and_refuses_while_lent():
    ring = StagingRing(64, count=2, idle_s=None)
    buffer = ring.acquire()
    with pytest.raises(RuntimeError, match="still lent"):
        ring.free()
    event = FakeEvent()
    ring.release(buffer, event)
    ring.free()
    assert ring.allocated_bytes == 0 and event.waited == 1  # pending copies finished before freeing
    ring.release(ring.acquire())  # usable again: allocated anew
    assert ring.allocated_bytes == 64


def test_idle_ring_frees_itself_and_a_new_loan_cancels_that():
    ring = StagingRing(64, count=1, idle_s=0.2)
    ring.release(ring.acquire())
    buffer = ring.acquire()  # lent again before the timer fires: it must not free
    time.sleep(0.4)
    assert ring.allocated_bytes == 64
    ring.release(buffer)
    deadline = time.monotonic() + 5
    while ring.allocated_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ring.allocated_bytes == 0


def test_lend_context_returns_the_buffer():
    ring = StagingRing(8, count=1, idle_s=None)
    with ring.lend() as buffer:
        assert ring.lent == 1 and buffer.numel() == 8
    assert ring.lent == 0
    with pytest.raises(KeyError):
        with ring.lend():
            raise KeyError("boom")
    assert ring.lent == 0


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="buffer_bytes"):
        StagingRing(0)
    with pytest.raises(ValueError, match="count"):
        StagingRing(8, count=0)
    with pytest.raises(ValueError, match="buffer_bytes"):
        StagingRing(True)


def test_shared_ring_is_reused_grown_and_released(monkeypatch):
    staging.release()
    monkeypatch.setattr(staging.ring_buffers, "_shared", None)  # start without the ring earlier tests left
    small = staging.ring(128, count=2)
    assert staging.ring(64, count=1) is small  # big enough: the same ring, its buffers kept
    small.release(small.acquire())
    assert small.allocated_bytes == 128
    bigger = staging.ring(256, count=2)
    assert bigger is not small and bigger.buffer_bytes == 256
    assert small.allocated_bytes == 0  # the replaced ring gave its memory back
    held = bigger.acquire()
    private = staging.ring(512, count=2)  # the shared one is in use: a private ring, not a resize
    assert private is not bigger and private.buffer_bytes == 512 and staging.ring(256) is bigger
    bigger.release(held)
    staging.release()
    assert bigger.allocated_bytes == 0


def test_copy_staged_copies_chunk_by_chunk_and_returns_the_buffers(monkeypatch):
    """The ring copy for pageable memory (no caller in flatten or defragment since they use the spill): host to
    host here, the same steps as device <-> pageable host, through 1 MiB chunks of the shared ring."""
    staging.release()
    monkeypatch.setattr(staging.ring_buffers, "_shared", None)  # start without the ring earlier tests left
    src = torch.randint(0, 256, ((3 << 20) + 17,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    staging.copy_staged(dst.view(torch.uint8), src, chunk_bytes=1 << 20)
    shared = staging.ring_buffers._shared
    assert torch.equal(dst, src) and shared.lent == 0 and shared.buffer_bytes == 1 << 20
    with pytest.raises(ValueError, match="contiguous"):
        staging.copy_staged(dst[::2], src[::2])
    staging.release()


def test_exit_cancels_idle_timers_and_waits_for_one_freeing(monkeypatch):
    """At interpreter exit no idle timer may still run: a daemon thread stopped inside CUDA during the
    interpreter's finalisation can abort the process after the user's script has finished."""
    waiting = StagingRing(64, count=1, idle_s=3600)  # armed, far from firing
    waiting.release(waiting.acquire())
    freeing = StagingRing(64, count=1, idle_s=0.01)
    started, finished = threading.Event(), threading.Event()
    free = StagingRing.free

    def slow_free(self):
        started.set()
        time.sleep(0.3)
        free(self)
        finished.set()

    monkeypatch.setattr(StagingRing, "free", slow_free)
    freeing.release(freeing.acquire())
    assert started.wait(5)  # the short timer is inside its callback now
    begin = time.monotonic()
    staging.idle.stop_timers_at_exit()
    assert finished.is_set()  # waited for the one freeing memory
    assert not waiting._timer.is_alive()  # the long one was cancelled, not waited out
    assert time.monotonic() - begin < 5
    assert waiting.allocated_bytes == 64  # cancelling frees nothing: the process drops its memory at exit


def test_exit_stops_the_spill_pools_timer():
    pool = staging.SpillPool(pin=False, idle_s=3600)
    loan = pool.lend(16)
    del loan
    timer = pool._timer
    assert timer is not None and timer.is_alive()
    staging.idle.stop_timers_at_exit()
    timer.join(1)
    assert not timer.is_alive()
    pool.free()


def test_spill_copies_lands_each_source_back_to_back_in_one_loan():
    """One loan for all: each source's values in order, as contiguous 1-D views; a caller's own copy for
    strided sources; a copy that fails raises after the others finished, and nothing was re-pointed."""
    pool = staging.spill_pool()
    sources = [torch.arange(6.0).view(2, 3), torch.arange(10.0, 14.0), torch.arange(20.0, 29.0).view(3, 3).t()]
    before = pool.allocations
    copies = staging.spill_copies(sources, torch.device("cpu"), "test spill")
    assert [c.tolist() for c in copies] == [s.reshape(-1).tolist() for s in sources]
    assert all(c.dim() == 1 and c.is_contiguous() for c in copies)
    assert copies[1].data_ptr() == copies[0].data_ptr() + 6 * 4 and pool.allocations <= before + 1
    seen = []
    own = staging.spill_copies(sources, torch.device("cpu"), "test spill",
                               copy=lambda out, src: (seen.append(src.shape), out.copy_(src.reshape(-1))))
    assert [c.tolist() for c in own] == [c.tolist() for c in copies] and seen == [s.shape for s in sources]
    assert staging.spill_copies([], torch.device("cpu"), "test spill") == []

    def failing(out, src):
        if src.shape == (4,):
            raise RuntimeError("copy failed")
        out.copy_(src.reshape(-1))

    with pytest.raises(RuntimeError, match="copy failed"):
        staging.spill_copies(sources, torch.device("cpu"), "test spill", copy=failing)
    assert sources[1].tolist() == [10.0, 11.0, 12.0, 13.0]


def test_copy_staged_takes_contiguous_tensors_with_any_strides_on_size_one_dims():
    """torch calls a 1-element slice of stride 2 contiguous; its byte view needs stride 1."""
    src = torch.arange(8.0)[3::2][:1]
    dst = torch.zeros(16)[5::3][:1]
    assert src.is_contiguous() and dst.is_contiguous() and src.stride() == (2,)
    staging.copy_staged(dst, src)
    assert dst.item() == 3.0
    staging.release()


# ---------------------------------------------------------------------------------- staging retried smaller


class FailFirst:
    """``memory.fault_hook`` failing the first ``count`` allocations named ``what``; ``seen`` counts them all."""

    def __init__(self, what: str, count: int):
        self.what, self.left, self.seen = what, count, 0

    def __call__(self, what: str) -> None:
        if what == self.what:
            self.seen += 1
            if self.left:
                self.left -= 1
                raise OutOfMemory(f"injected: {what} #{self.seen}")


def test_staging_sizes_halve_from_the_data_down_to_one_element():
    from ztriton.policy import staging_numels

    assert staging_numels(1 << 20, 10 ** 9, 4) == [1 << 18, 1 << 17, 1 << 16] + [1 << k for k in range(15, -1, -1)]
    assert staging_numels(1 << 20, 100, 2) == [100, 50, 25, 12, 6, 3, 1]  # never more than the data
    assert staging_numels(1 << 20, 0, 8) == [1]


def test_a_staging_chunk_that_does_not_fit_is_allocated_smaller(monkeypatch):
    from ztriton import memory

    monkeypatch.setattr(memory, "fault_hook", FailFirst("staging chunk", 3))
    chunk = memory.empty_first_fitting([64, 32, 16, 8, 4], torch.float32, "cpu", "staging chunk")
    assert chunk.numel() == 8
    monkeypatch.setattr(memory, "fault_hook", FailFirst("staging chunk", 5))
    with pytest.raises(torch.OutOfMemoryError, match="staging chunk #5"):
        memory.empty_first_fitting([64, 32, 16, 8, 4], torch.float32, "cpu", "staging chunk")


@pytest.mark.parametrize("failures", [0, 3, 12])
def test_partition_scatter_staging_retries_smaller_down_to_one_element(monkeypatch, failures):
    """The scatter staging's first ``failures`` allocations fail: it is retried at half the size each time, below
    the 1 MiB a caller may ask for, where the first attempt is at most the data (here a world of one: the
    agreement is local)."""
    from ztriton import memory
    from ztriton.comm import World
    from ztriton.partitioning import _staging

    hook = FailFirst("scatter staging", failures)
    monkeypatch.setattr(memory, "fault_hook", hook)
    buffer = torch.empty(3 << 18, dtype=torch.float32)  # 3 MiB
    chunk, rows, recv = _staging(World(0, 1, None), 1 << 20, buffer)
    assert chunk == max(1, (1 << 18) >> failures) and rows.shape == (1, chunk) and recv is None
    assert hook.seen == failures + 1
    small = torch.empty(100, dtype=torch.float32)
    chunk, rows, _ = _staging(World(0, 1, None), 1 << 20, small)
    assert chunk == 100 and rows.shape == (1, 100), "a chunk larger than the data it stages"


def test_partition_scatter_staging_fails_every_rank_only_below_one_element(monkeypatch):
    from ztriton import memory
    from ztriton.comm import World
    from ztriton.partitioning import _staging

    monkeypatch.setattr(memory, "fault_hook", FailFirst("scatter staging", 10 ** 6))
    with pytest.raises(RuntimeError, match="cannot allocate even one element of staging.*no parameter was changed"):
        _staging(World(0, 1, None), 1 << 20, torch.empty(1000, dtype=torch.bfloat16))


def test_flatten_evict_tier_retries_its_staging_chunk_smaller(monkeypatch):
    """A strided param goes to host memory through a staging chunk (the kernels' copy): the chunk's first
    allocations failing make it smaller, not the tier fall through to the next one."""
    import ztriton
    from ztriton import memory
    from ztriton.memory import MemoryInfo

    values = torch.randint(-2**31, 2**31 - 1, (6, 5), dtype=torch.int32).view(torch.float32)
    params = [torch.nn.Parameter(values.clone().t()), torch.nn.Parameter(torch.ones(3))]
    hook = FailFirst("staging chunk", 2)
    monkeypatch.setattr(memory, "fault_hook", hook)
    monkeypatch.setattr(memory, "probe_memory", lambda d: MemoryInfo(str(d), 0, 0, 1 << 40, "test"))
    (fg,) = ztriton.flatten_groups([params], tier="evict", headroom_bytes=0)
    assert fg.tier.value == "evict" and hook.seen == 3
    assert torch.equal(fg.flat[:30].view(torch.int32), values.t().reshape(-1).view(torch.int32))
    staging.release()
