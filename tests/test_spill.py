"""The staging spill pool (ztriton/staging.py): host memory that params live in while flatten's evict and
host tiers and defragment's evict path move them off the device.

A block is allocated on first use and lent again to later calls; it grows by replacement, is freed by
``staging.release()`` or after the idle timeout, and is never lent while a tensor still points into it
(concurrent borrowers, params left in it by a failed call). On CUDA it is registered with cudaHostRegister;
here (no CUDA) the registration is faked to check when it is undone.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

import ztriton
from ds_reference import bits, bits_tensor
from test_kernels import run_in_threads
from ztriton import memory, staging
from ztriton.memory import MemoryInfo, OutOfMemory
from ztriton.staging import SPILL_GRANULE, SpillPool

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _empty_pool():
    """Each test starts and ends with the process's pool empty (earlier tests leave a block in it)."""
    staging.release()
    yield
    staging.release()


@contextmanager
def free_memory(free_bytes: int):
    """The memory probe reports ``free_bytes`` free on the device (0: the evict tier evicts every param)."""
    fake = lambda device: MemoryInfo(str(device), free_bytes, free_bytes, 1 << 40, "test")  # noqa: E731
    with mock.patch.object(memory, "probe_memory", fake):
        yield


@contextmanager
def spied_loans():
    """Every ``staging.spill`` loan as (what, address, nbytes): addresses only, so the loans can end."""
    loans, real = [], staging.spill

    def spy(nbytes, device=None, what="host spill"):
        loan = real(nbytes, device, what)
        loans.append((what, loan.data_ptr(), nbytes))
        return loan

    with mock.patch.object(staging, "spill", spy):
        yield loans


def _params(seed: int, shapes=((5, 3), (7,), (2, 2, 2), (11,))):
    return [torch.nn.Parameter(bits_tensor(s, torch.float32, seed, i).clone()) for i, s in enumerate(shapes)]


def _inside(ptr: int, loans) -> bool:
    return any(start <= ptr < start + n for _, start, n in loans)


# ---------------------------------------------------------------------------------------------- the pool


def test_a_loan_is_exactly_the_request_and_its_block_is_reused():
    pool = SpillPool(idle_s=None)
    hook = []
    with mock.patch.object(memory, "fault_hook", hook.append):
        loan = pool.lend(1000, "cpu", "test spill")
        assert loan.dtype == torch.uint8 and loan.shape == (1000,) and loan.data_ptr() % 4096 == 0
        address = loan.data_ptr()
        assert pool.lent == 1 and pool.allocated_bytes == SPILL_GRANULE
        loan.fill_(7)
        del loan
        assert pool.lent == 0
        again = pool.lend(SPILL_GRANULE, "cpu", "test spill")  # up to the whole block: the same memory
    assert again.data_ptr() == address and pool.allocations == 1 and hook == ["test spill"]


def test_blocks_hold_what_was_asked_rounded_to_the_granule_not_a_power_of_two():
    pool = SpillPool(idle_s=None)
    loan = pool.lend(5 * MiB + 1)
    assert loan.numel() == 5 * MiB + 1 and pool.allocated_bytes == 6 * MiB  # torch's pinned allocator: 8 MiB


def test_the_pool_grows_by_replacing_a_free_block_that_is_too_small():
    pool = SpillPool(idle_s=None)
    small = pool.lend(MiB)
    block = weakref.ref(pool._blocks[0])
    del small
    big = pool.lend(3 * MiB)
    gc.collect()
    assert block() is None, "the small block was not freed"
    assert pool.allocations == 2 and pool.allocated_bytes == 4 * MiB
    del big
    assert pool.lend(MiB).data_ptr() == pool._blocks[0].address  # the big one serves a small request
    assert pool.allocations == 2


def test_a_block_is_lent_while_any_tensor_points_into_it():
    """Views, dtype views, ``.data`` re-pointing and ``set_`` aliases all keep the loan: it ends with the last."""
    pool = SpillPool(idle_s=None)
    loan = pool.lend(4096)
    address = loan.data_ptr()
    param = torch.nn.Parameter(torch.zeros(4))
    param.data = loan.view(torch.float32)[:4]
    alias = torch.empty(0).set_(param.data.untyped_storage(), 8, (2,))
    del loan
    other = pool.lend(4096)
    assert other.data_ptr() != address and pool.allocations == 2  # the first block is still in use
    del other
    param.data = torch.zeros(4)
    assert pool.lent == 1  # ``alias`` still points into the first block
    del alias
    assert pool.lent == 0
    assert {pool.lend(4096).data_ptr() for _ in range(2)} <= {b.address for b in pool._blocks}
    assert pool.allocations == 2


def test_concurrent_borrowers_get_distinct_memory():
    pool = SpillPool(idle_s=None)
    barrier = threading.Barrier(3)
    ranges = []

    def borrow(t):
        loan = pool.lend(MiB + t)
        loan.fill_(t)
        ranges.append((loan.data_ptr(), loan.data_ptr() + loan.numel()))
        barrier.wait(timeout=10)  # every loan is held at once here
        assert bool((loan == t).all()), "another borrower wrote into this loan"

    run_in_threads(borrow, 3)
    ranges.sort()
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), ranges
    assert pool.allocations == 3 and pool.lent == 0
    pool.lend(MiB)
    assert pool.allocations == 3  # the blocks stay for later borrowers


def test_free_releases_free_blocks_now_and_lent_ones_with_their_last_tensor():
    pool = SpillPool(idle_s=None)
    held = pool.lend(100)
    held[:] = 5
    spare = pool.lend(100)
    blocks = [weakref.ref(b) for b in pool._blocks]
    del spare
    pool.free()
    gc.collect()
    assert pool.allocated_bytes == 0 and [b() is None for b in blocks] == [False, True]
    assert bool((held == 5).all())  # the borrower's memory is still its own
    fresh = pool.lend(100)
    assert fresh.data_ptr() != held.data_ptr()  # never lent again
    del held
    gc.collect()
    assert blocks[0]() is None


def test_release_frees_the_process_pool():
    loan = staging.spill(1000, "cpu")
    del loan
    assert staging.spill_pool().allocated_bytes == SPILL_GRANULE
    staging.release()
    assert staging.spill_pool().allocated_bytes == 0


def test_idle_blocks_are_freed_after_the_timeout_but_not_while_lent():
    pool = SpillPool(idle_s=0.2)
    held = pool.lend(100)
    time.sleep(0.45)
    assert pool.allocated_bytes == SPILL_GRANULE  # lent: kept however long
    del held
    deadline = time.monotonic() + 5
    while pool.allocated_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.allocated_bytes == 0
    pool.lend(100)
    assert pool.allocations == 2


def test_a_failed_allocation_leaves_the_pool_usable():
    pool = SpillPool(idle_s=None)

    def refuse(what):
        raise OutOfMemory(f"injected ({what})")

    with mock.patch.object(memory, "fault_hook", refuse), pytest.raises(torch.OutOfMemoryError, match="injected"):
        pool.lend(100, what="evicted params")
    assert pool.allocated_bytes == 0 and pool.allocations == 0
    assert pool.lend(100).numel() == 100 and pool.allocations == 1


def test_zero_bytes_and_bad_sizes():
    pool = SpillPool(idle_s=None)
    assert pool.lend(0).numel() == 0 and pool.allocations == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            pool.lend(bad)


def test_synchronized_exits_on_an_exception_too():
    with pytest.raises(KeyError):
        with staging.synchronized("cpu"):
            raise KeyError("boom")


# ---------------------------------------------------------------------------------------------- pinning


@contextmanager
def fake_cuda_registration(register_error=0, unregister_error=0):
    """cudaHostRegister / cudaHostUnregister replaced: returns what they were called with."""
    calls = []

    def register(address, nbytes, device_index):
        calls.append(("register", address, nbytes))
        return register_error

    def unregister(address, device_index):
        calls.append(("unregister", address))
        return unregister_error

    with mock.patch.object(staging.spill_memory, "_host_register", register), \
            mock.patch.object(staging.spill_memory, "_host_unregister", unregister):
        yield calls


def test_pinned_memory_is_unregistered_only_when_its_last_tensor_is_gone():
    pool = SpillPool(pin=True, idle_s=None)
    with fake_cuda_registration() as calls:
        loan = pool.lend(5000, "cpu")
        address = loan.data_ptr()
        assert calls == [("register", address, SPILL_GRANULE)] and pool._blocks[0].pinned
        view = loan[100:200]
        del loan
        pool.free()  # abandoned while a view lives: still registered
        gc.collect()
        assert calls == [("register", address, SPILL_GRANULE)]
        view.fill_(1)
        del view
        gc.collect()
        assert calls[1:] == [("unregister", address)]


def test_a_block_that_cannot_be_pinned_is_pageable_with_one_warning(caplog):
    pool = SpillPool(pin=True, idle_s=None)
    with fake_cuda_registration(register_error=2) as calls, caplog.at_level(logging.WARNING, logger="ztriton"):
        loan = pool.lend(100, "cpu", "evicted params")
        loan.fill_(3)
        del loan
        pool.lend(200, "cpu")  # the pageable block serves: no second attempt to pin
        pool.free()
        gc.collect()
    assert [c[0] for c in calls] == ["register"]  # never registered: nothing to unregister
    assert caplog.text.count("could not pin") == 1 and "evicted params" in caplog.text


def test_memory_that_cannot_be_unregistered_is_never_freed(caplog):
    pool = SpillPool(pin=True, idle_s=None)
    kept = len(staging.spill_memory._UNFREEABLE)
    with fake_cuda_registration(unregister_error=1), caplog.at_level(logging.WARNING, logger="ztriton"):
        pool.lend(100, "cpu")
        pool.free()
        gc.collect()
    assert len(staging.spill_memory._UNFREEABLE) == kept + 1 and "could not unregister" in caplog.text
    del staging.spill_memory._UNFREEABLE[kept:]


def test_cpu_requests_are_pageable_and_cuda_ones_ask_for_pinned_memory():
    pool = SpillPool(idle_s=None)  # pin=None: pinned exactly for CUDA devices
    assert pool._pin_device(torch.device("cpu")) is None and pool._pin_device(None) is None
    if not torch.cuda.is_available():
        assert pool._pin_device(torch.device("cuda", 1)) is None  # no CUDA: pageable everywhere
    else:
        assert pool._pin_device(torch.device("cuda", 0)) == 0


# ---------------------------------------------------------------------------------------------- the callers


def test_repeated_flattens_and_defragments_reuse_one_block():
    pool = staging.spill_pool()
    start = pool.allocations
    with spied_loans() as loans, free_memory(0):
        for seed in range(3):
            params = _params(seed)
            (fg,) = ztriton.flatten_groups([params], tier="evict", headroom_bytes=0)
            assert all(p.untyped_storage().data_ptr() == fg.flat.untyped_storage().data_ptr() for p in params)
            tensors = [bits_tensor((n,), torch.bfloat16, seed, n).clone() for n in (40, 7, 30)]
            ztriton.defragment(tensors, tier="evict")
            assert pool.lent == 0
    assert pool.allocations == start + 1 and len({address for _, address, _ in loans}) == 1 and len(loans) == 6


def test_two_threads_flattening_at_once_get_their_own_bytes():
    results = [None, None]

    def flatten(t):
        params = _params(10 + t, shapes=((64, 33), (129,), (5, 5)))
        values = [bits(p).clone() for p in params]
        (fg,) = ztriton.flatten_groups([params], tier="evict", headroom_bytes=0)
        results[t] = (values, [bits(p) for p in params], fg)

    with free_memory(0):
        run_in_threads(flatten, 2)
    for values, now, _ in results:
        assert all(torch.equal(a, b) for a, b in zip(values, now))
    assert staging.spill_pool().lent == 0


@contextmanager
def _failing(*names):
    """Allocations named ``names`` fail. The ztriton logger is off meanwhile: its warnings carry the tiers'
    exceptions, and a handler that keeps records (pytest's does) keeps their tracebacks' frames, whose
    locals hold spill memory lent."""
    def hook(what):
        if what in names:
            raise OutOfMemory(f"injected: {what}")
    with mock.patch.object(memory, "fault_hook", hook), mock.patch.object(logging.getLogger("ztriton"), "disabled",
                                                                          True):
        yield


def test_params_left_in_the_spill_by_a_failure_keep_it_and_the_next_call_uses_other_memory():
    """Every tier fails (no flat buffer) and no param can go back (no memory for it): the params stay in spill
    memory with their bytes. That block is not lent to the next call, which would overwrite them; once the
    params leave it, it is lent again."""
    pool = staging.spill_pool()
    params = _params(1)
    before = [bits(p).clone() for p in params]
    with spied_loans() as failed, free_memory(0), _failing("flat buffer", "param moved back"):
        with pytest.raises(torch.OutOfMemoryError, match="live in host memory"):
            ztriton.flatten_groups([params], tier="evict", headroom_bytes=0)
    gc.collect()  # the error's traceback frames (a cycle) hold the tiers' locals: spill memory too
    assert all(torch.equal(bits(p), b) for p, b in zip(params, before))
    assert all(_inside(p.data_ptr(), failed) for p in params) and pool.lent == 1
    stuck = {p.data_ptr() for p in params}

    with spied_loans() as later, free_memory(0):
        others = _params(2)
        (fg,) = ztriton.flatten_groups([others], tier="host", headroom_bytes=0)
        tensors = [bits_tensor((n,), torch.bfloat16, 3, n).clone() for n in (40, 7, 30)]
        ztriton.defragment(tensors, tier="evict")
    assert later and not any(_inside(ptr, later) for ptr in stuck), "memory params live in was lent again"
    assert all(torch.equal(bits(p), b) for p, b in zip(params, before))
    assert pool.lent == 1

    for p in params:  # the user moves them back, as the error says
        p.data = p.data.clone()
    gc.collect()
    assert pool.lent == 0


def test_defragment_tensors_left_in_the_spill_keep_it():
    """No flat buffer: the evicted tensors stay in spill memory (here the CPU is their device, so they are
    "home" there; on CUDA they go back unless that fails too), and the next call does not get that memory."""
    pool = staging.spill_pool()
    tensors = [bits_tensor((n,), torch.bfloat16, 4, n).clone() for n in (40, 7, 30)]
    before = [bits(t).clone() for t in tensors]
    with spied_loans() as failed, _failing("flat buffer", "partition moved back"):
        with pytest.raises(torch.OutOfMemoryError, match="Every tensor keeps its values"):
            ztriton.defragment(tensors, tier="evict")
    gc.collect()
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before))
    assert all(_inside(t.data_ptr(), failed) for t in tensors) and pool.lent == 1
    with spied_loans() as later:
        ztriton.defragment([bits_tensor((n,), torch.bfloat16, 5, n).clone() for n in (9, 3)], tier="evict")
    assert later and not any(_inside(t.data_ptr(), later) for t in tensors)
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before))


def test_the_tier_choice_counts_the_pools_idle_memory_as_available_host_memory():
    """The memory probe sees the pool's idle blocks as used host memory; the flatten's decision adds them
    back, so a recent large spill does not push the next call to a worse tier (or refuse it)."""
    from ztriton import policy

    pool = staging.spill_pool()
    with free_memory(0):
        ztriton.flatten_groups([_params(1)], tier="evict", headroom_bytes=0)
    idle = pool.idle_bytes
    assert idle >= SPILL_GRANULE and pool.lent == 0
    seen = []
    real = policy.choose_flatten_tier

    def spy(group_bytes, world_size, free, host, *args, **kwargs):
        seen.append(host)
        return real(group_bytes, world_size, free, host, *args, **kwargs)

    probe = lambda device: MemoryInfo(str(device), 1 << 30, 1 << 30, 1000, "test")  # noqa: E731 -- 1000 host bytes
    with mock.patch.object(memory, "probe_memory", probe), mock.patch.object(policy, "choose_flatten_tier", spy):
        ztriton.flatten_groups([_params(2)])
    assert seen == [1000 + idle]


def test_a_forked_child_starts_with_an_empty_pool_and_ring():
    """Whatever the parent's pool and ring held (and their locks' state), a forked child borrows afresh;
    the parent keeps its blocks."""
    import multiprocessing

    pool = staging.spill_pool()
    held = staging.spill(3 * SPILL_GRANULE, "cpu")  # lent in the parent
    staging.copy_staged(torch.empty(64), torch.ones(64))  # the shared ring is allocated
    pool._lock.acquire()  # as if a parent thread held it at fork time
    try:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child_borrows, args=(queue,))
        child.start()
        child.join(60)
    finally:
        pool._lock.release()
    assert child.exitcode == 0 and queue.get(timeout=5) == (0, 0, True)
    assert pool.lent == 1 and held.numel() == 3 * SPILL_GRANULE


def _child_borrows(queue) -> None:
    pool = staging.spill_pool()
    before = (pool.lent, pool.allocated_bytes)
    loan = staging.spill(1024, "cpu")
    out = torch.empty(16)
    staging.copy_staged(out, torch.full((16,), 2.0))
    queue.put((*before, bool(loan.numel() == 1024 and torch.equal(out, torch.full((16,), 2.0)))))
