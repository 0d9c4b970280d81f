"""Fault-injection sweep (issue 16): the Nth allocation, then the Nth collective, fails; N = 1, 2, ...
until a call runs without reaching the fault.

Allocations fail through ``memory.fault_hook`` (every allocation of ``ztriton.memory``'s helpers and
of the staging ring), collectives through ``comm.fault_hook`` (every collective of ``ztriton.comm``).
After each call, either it succeeded (through a fallback tier) with the right bytes, or it raised and
every param / tensor still holds its original bytes and shape. On gloo the same N fails on every rank
(they take the same steps) or, for allocations, on one rank only (the ranks must agree, not hang: the
world's timeout fails the test). Packing uses the torch reference (TRITON_INTERPRET=0): what is under
test is the control flow around every allocation and collective, not the kernels.
"""
from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

import ztriton
from ds_reference import bits, bits_tensor
from worlds import fake_world
from ztriton import comm, memory
from ztriton.defragmenting import defragment
from ztriton.flatten import tiers as F
from ztriton.memory import MemoryInfo, OutOfMemory

SHAPES = [(5, 3), (7,), (2, 2, 2), (11,)]
MAX_STEPS = 80  # a call making more allocations or collectives than this is a bug of its own


class Fault(Exception):
    """A non-OOM failure (what a collective or the CPU allocator may raise)."""


class Injector:
    """Fails the ``at``-th event of one kind; ``hit`` says whether the call got that far."""

    def __init__(self, kind: str, at: int, error: type[BaseException], ranks=None, rank: int = 0):
        self.kind, self.at, self.error, self.count, self.hit = kind, at, error, 0, False
        self.active = ranks is None or rank in ranks

    def __call__(self, what: str) -> None:
        self.count += 1
        if self.active and self.count == self.at:
            self.hit = True
            raise self.error(f"injected: {self.kind} #{self.at} ({what})")


@contextlib.contextmanager
def injected(injector: Injector):
    name = "fault_hook"
    target = memory if injector.kind == "allocation" else comm
    with mock.patch.object(target, name, injector):
        yield injector


@contextlib.contextmanager
def torch_packing_and_memory(free_bytes: int):
    fake = lambda device: MemoryInfo(str(device), free_bytes, free_bytes, 1 << 40, "test")  # noqa: E731
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}), mock.patch.object(memory, "probe_memory", fake):
        yield


def _params(seed: int):
    return [torch.nn.Parameter(bits_tensor(s, torch.float32, seed, i).clone()) for i, s in enumerate(SHAPES)]


def _check_intact(params, before) -> None:
    for p, (values, shape) in zip(params, before):
        assert p.shape == shape and p.device.type == "cpu", "a param lost its shape or device"
        assert torch.equal(bits(p), values), "a param lost its values"


def _sweep_flatten(tier: str, free_bytes: int, kind: str, error, rank: int = 0, ranks=None,
                   fake: bool = False) -> int:
    """One sweep; returns how many faults were injected before a call ran clean."""
    expected = None
    for at in range(1, MAX_STEPS):
        params = _params(3)
        before = [(bits(p).clone(), p.shape) for p in params]
        if expected is None:
            with torch_packing_and_memory(1 << 30):
                expected = bits(ztriton.flatten_groups([_params(3)], headroom_bytes=0)[0].flat).clone()
        injector = Injector(kind, at, error, ranks, rank)
        patches = [mock.patch.object(F, "all_gather_bytes", _fake_gather(expected))] if fake else []
        with torch_packing_and_memory(free_bytes), injected(injector), contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            try:
                (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0)
            except Exception:  # noqa: BLE001 -- any failure: the values must be intact
                _check_intact(params, before)
            else:
                assert torch.equal(bits(fg.flat), expected), f"wrong bytes after fault {kind} #{at}"
                _check_intact(params, before)
        if not _hit_anywhere(injector.hit, fake):
            return at - 1
    raise AssertionError(f"{kind} sweep did not end within {MAX_STEPS} faults")


def _hit_anywhere(hit: bool, fake: bool) -> bool:
    """Whether any rank reached its fault (on gloo a fault may be on one rank only: all go on together)."""
    if fake or not torch.distributed.is_initialized():
        return hit
    flag = torch.tensor([int(hit)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _fake_gather(expected):
    """The fake group's all-gather (counted as a collective) as the other ranks, holding the same values,
    would make it: this rank's part in its slot, the other slots from the expected buffer."""
    def gather(out, part, world):
        comm._before_collective("all_gather")
        out.view(torch.int32).copy_(expected)
        out.narrow(0, world.rank * part.numel(), part.numel()).copy_(part)
    return gather


CASES = [("device", 1 << 30), ("distributed", 1 << 30), ("distributed", 0), ("evict", 0), ("host", 0)]


@pytest.mark.parametrize("tier, free", CASES, ids=[f"{t}-{'room' if f else 'tight'}" for t, f in CASES])
@pytest.mark.parametrize("kind, error", [("allocation", OutOfMemory), ("allocation", Fault), ("collective", Fault)])
def test_flatten_sweep_fake_world(tier, free, kind, error):
    with fake_world(2, 0):
        faults = _sweep_flatten(tier, free, kind, error, fake=True)
    assert faults >= 1  # the sweep reached at least one fault


def _gloo_sweeps(rank, world_size):
    counts = []
    for tier, free in CASES:
        counts.append(_sweep_flatten(tier, free, "collective", Fault, rank))
        counts.append(_sweep_flatten(tier, free, "allocation", OutOfMemory, rank))
        counts.append(_sweep_flatten(tier, free, "allocation", Fault, rank, ranks={1}))  # one rank alone fails
    return counts


def test_flatten_sweep_gloo(gloo_world):
    counts = gloo_world(_gloo_sweeps, 2, timeout=80)
    assert all(c >= 1 for c in counts[0])


def _partitions(seed: int):
    shared = bits_tensor((30,), torch.bfloat16, seed).clone()
    alone = bits_tensor((9,), torch.bfloat16, seed + 1).clone()
    piece = lambda start, n: torch.empty(0, dtype=torch.bfloat16).set_(shared.untyped_storage(), start, (n,))  # noqa: E731
    return [piece(10, 15), alone, piece(0, 10), piece(25, 5)]


@pytest.mark.parametrize("tier", ["device", "evict"])
@pytest.mark.parametrize("error", [OutOfMemory, Fault])
def test_defragment_sweep(tier, error):
    expected = torch.cat([bits(t) for t in _partitions(4)])
    for at in range(1, MAX_STEPS):
        tensors = _partitions(4)
        before = [(bits(t).clone(), t.shape) for t in tensors]
        injector = Injector("allocation", at, error)
        with torch_packing_and_memory(1 << 30), injected(injector):
            try:
                flat = defragment(tensors, tier=tier, headroom_bytes=0)
            except Exception:  # noqa: BLE001
                _check_intact(tensors, before)
            else:
                assert torch.equal(bits(flat), expected)
                _check_intact(tensors, before)
        if not injector.hit:
            assert at > 1 or tier == "device"
            return
    raise AssertionError("the defragment sweep did not end")
