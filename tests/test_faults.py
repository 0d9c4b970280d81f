"""Fault-injection sweep (issue 16): the Nth allocation, then the Nth collective, fails; N = 1, 2, ...
until a call runs without reaching the fault.

Allocations fail through ``memory.fault_hook`` (every allocation of ``ztriton.memory``'s helpers, of
the staging ring and of the spill pool), collectives through ``comm.fault_hook`` (every collective of ``ztriton.comm``).
After each call, either it succeeded (through a fallback tier) with the right bytes, or it raised and
every param / tensor still holds its original bytes and shape. On gloo the same N fails on every rank
(they take the same steps) or, for allocations, on one rank only (the ranks must agree, not hang: the
world's timeout fails the test). A call that fails although no rank reached its fault fails the sweep
(an unrelated error must not pass for a handled fault).
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
from ztriton import comm, memory, staging
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
def free_memory(free_bytes: int):
    """The memory probe reports ``free_bytes`` free (which picks the flatten tier and chunk sizes).

    The kernels run as everywhere in the suite (under the interpreter on the CPU): triton reads
    TRITON_INTERPRET once, at its import, so flipping it here would not pick torch's copies but make
    the interpreter's lazy imports fail (an AssertionError the sweeps would mistake for an injected fault)."""
    fake = lambda device: MemoryInfo(str(device), free_bytes, free_bytes, 1 << 40, "test")  # noqa: E731
    with mock.patch.object(memory, "probe_memory", fake):
        yield


def _params(seed: int):
    """Contiguous params, a transposed one (the kernels' check of a strided param allocates a scratch) and a
    1-element slice of stride 2 right before its neighbour in memory (contiguous, yet no byte view of it)."""
    params = [torch.nn.Parameter(bits_tensor(s, torch.float32, seed, i).clone()) for i, s in enumerate(SHAPES)]
    strided = bits_tensor((4, 3), torch.float32, seed, len(SHAPES)).clone().t()
    pair = bits_tensor((8,), torch.float32, seed, len(SHAPES) + 1).clone()
    return params + [torch.nn.Parameter(strided), torch.nn.Parameter(pair[3::2][:1]), torch.nn.Parameter(pair[4:])]


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
            with free_memory(1 << 30):
                expected = bits(ztriton.flatten_groups([_params(3)], headroom_bytes=0)[0].flat).clone()
        injector = Injector(kind, at, error, ranks, rank)
        staging.release()  # the spill pool allocates its block again, where the sweep sees it
        patches = [mock.patch.object(F, "all_gather_bytes", _fake_gather(expected))] if fake else []
        with free_memory(free_bytes), injected(injector), contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            try:
                (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0)
            except Exception as exc:  # noqa: BLE001 -- any failure: the values must be intact
                _check_intact(params, before)
                failure = exc
            else:
                assert torch.equal(bits(fg.flat), expected), f"wrong bytes after fault {kind} #{at}"
                _check_intact(params, before)
                failure = None
        hit = _hit_anywhere(injector.hit, fake)
        assert failure is None or hit, f"{kind} #{at}: failed without any rank reaching the fault: {failure!r}"
        if not hit:
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
        counts += _sweeps_alone(tier, free, rank, world_size)
    return counts


def _sweeps_alone(tier: str, free: int, rank: int, world_size: int) -> list[int]:
    """One rank alone fails, each in turn: an error that is not an OOM (which no tier takes), and where a tier
    is collective an OOM too (that rank's fall-through must become every rank's)."""
    errors = [Fault, OutOfMemory] if tier == "distributed" else [Fault]
    return [_sweep_flatten(tier, free, "allocation", error, rank, ranks={alone})
            for alone in range(world_size) for error in errors]


# W = 3: the cases whose steps are collective (the checks' agreement, the distributed tier), one rank alone failing.
CASES_W3 = [("device", 1 << 30), ("distributed", 0)]


def _gloo_sweeps_alone(rank, world_size):
    """Flatten's collective cases, then partition's scatter path (each rank alone failing, each in turn)."""
    flatten = [count for tier, free in CASES_W3 for count in _sweeps_alone(tier, free, rank, world_size)]
    partition = [_sweep_partition("allocation", Fault, world_size, rank, ranks={alone}) for alone in range(world_size)]
    return flatten, partition


def test_flatten_sweep_gloo(gloo_world):
    """Every allocation and collective of every tier fails on every rank, and every allocation on one rank
    alone (each in turn): no rank hangs (the world's timeout fails the test), and every param keeps its
    values or the result is complete."""
    counts = gloo_world(_gloo_sweeps, 2, timeout=120)
    assert all(c >= 1 for c in counts[0])


@pytest.mark.slow
def test_sweeps_gloo_three_ranks_one_failing(gloo_world):
    """W = 3, one rank alone failing each allocation in turn, in flatten and in partition: no rank hangs."""
    results = gloo_world(_gloo_sweeps_alone, 3, timeout=150)
    flatten, partition = results[0]
    assert all(c >= 1 for c in flatten) and all(r == results[0] for r in results), results
    # every rank: a buffer per dtype and the kernels' check scratch; rank 0 also its scatter staging per dtype
    assert partition == [5, 3, 3], partition


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
        staging.release()  # the spill pool allocates its block again, where the sweep sees it
        with free_memory(1 << 30), injected(injector):
            try:
                flat = defragment(tensors, tier=tier, headroom_bytes=0)
            except Exception as exc:  # noqa: BLE001
                _check_intact(tensors, before)
                assert injector.hit, f"allocation #{at}: failed without reaching the fault: {exc!r}"
            else:
                assert torch.equal(bits(flat), expected)
                _check_intact(tensors, before)
        if not injector.hit:
            assert at > 1 or tier == "device"
            return
    raise AssertionError("the defragment sweep did not end")


# ---------------------------------------------------------------------------------------------- partition


# Two dtypes (two per-rank buffers), odd numels (padded partitions), and one param of more than two staging chunks
# (policy.MIN_CHUNK_BYTES) per rank at W = 2, so that the scatter path agrees and scatters chunk by chunk.
PARTITION_PARAMS = [((5, 3), torch.float32), ((7,), torch.bfloat16), ((2, 3, 3), torch.bfloat16),
                    ((640_001,), torch.float32), ((11,), torch.float32)]
PARTITION_CHUNK_BYTES = 1 << 20


class _Params(torch.nn.Module):
    """PARTITION_PARAMS, then a transposed param and a 1-element slice of stride 2 (contiguous, yet no byte view
    of it) right before its neighbour in memory."""

    def __init__(self, seed: int):
        super().__init__()
        params = [torch.nn.Parameter(bits_tensor(s, d, seed, i).clone()) for i, (s, d) in enumerate(PARTITION_PARAMS)]
        strided = bits_tensor((4, 3), torch.float32, seed, len(params)).clone().t()
        pair = bits_tensor((8,), torch.float32, seed, len(params) + 1).clone()
        params += [torch.nn.Parameter(strided), torch.nn.Parameter(pair[3::2][:1]), torch.nn.Parameter(pair[4:])]
        self.params = torch.nn.ParameterList(params)


def _check_partitioned(module, want, world_size: int, rank: int) -> None:
    """Every param is a ZeRO-3 param whose partition holds ``rank``'s slice of ``want`` (bits), padding zero."""
    for i, (p, values) in enumerate(zip(module.parameters(), want)):
        assert hasattr(p, "ds_id") and tuple(p.ds_shape) == tuple(values.shape), f"param {i} is not partitioned"
        size = -(-values.numel() // world_size)
        start = rank * size
        count = max(0, min(start + size, values.numel()) - start)
        assert p.ds_tensor.numel() == size, f"param {i}: partition of {p.ds_tensor.numel()} elements, not {size}"
        assert torch.equal(bits(p.ds_tensor)[:count], bits(values).reshape(-1)[start:start + count]), f"param {i}"
        assert not bits(p.ds_tensor)[count:].any(), f"param {i}: padding is not zero"


def _sweep_partition(kind: str, error, world_size: int, rank: int, ranks=None, fake: bool = False) -> int:
    """``ztriton.partition`` with the Nth event of ``kind`` failing, N = 1, 2, ...; returns how many faults were
    injected before a call ran clean. Values are rank 0's (scatter) or each rank's own (local, fake world)."""
    want = list(_Params(0 if not fake else rank).parameters())
    for at in range(1, MAX_STEPS):
        module = _Params(rank)
        before = [(bits(p).clone(), p.shape) for p in module.parameters()]
        injector = Injector(kind, at, error, ranks, rank)
        with injected(injector):  # chunk_bytes given: no memory probe
            try:
                result = ztriton.partition(module, chunk_bytes=PARTITION_CHUNK_BYTES)
            except Exception as exc:  # noqa: BLE001 -- any failure: nothing may have changed
                params = list(module.parameters())
                assert not any(hasattr(p, "ds_id") for p in params), f"{kind} #{at}: a param was converted"
                _check_intact(params, before)
                failure = exc
            else:
                assert result.path.value == ("local" if fake else "scatter")
                _check_partitioned(module, want, world_size, rank)
                failure = None
        hit = _hit_anywhere(injector.hit, fake)
        assert failure is None or hit, f"{kind} #{at}: failed without any rank reaching the fault: {failure!r}"
        if not hit:
            return at - 1
    raise AssertionError(f"{kind} sweep of partition did not end within {MAX_STEPS} faults")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind, error", [("allocation", OutOfMemory), ("allocation", Fault), ("collective", Fault)])
def test_partition_sweep_local_path(kind, error, rank):
    """The local path (a fake world: each rank slices its own values) makes no collective of its own."""
    with fake_world(2, rank):
        faults = _sweep_partition(kind, error, 2, rank, fake=True)
    # a buffer per dtype, and the scratch of the kernels' check of the transposed param
    assert faults == (len({d for _, d in PARTITION_PARAMS}) + 1 if kind == "allocation" else 0)


def _gloo_partition_sweeps(rank, world_size):
    counts = [_sweep_partition("collective", Fault, world_size, rank),  # every rank's Nth collective fails
              _sweep_partition("allocation", OutOfMemory, world_size, rank),
              # one rank alone fails, each in turn (rank 0: its scatter staging too)
              *[_sweep_partition("allocation", Fault, world_size, rank, ranks={alone}) for alone in range(world_size)]]
    _staging_fails_first(STAGING_FAILURES, world_size, rank)
    return counts


class _StagingFaults:
    """Fails rank 0's first ``count`` scatter staging allocations (every other allocation goes through)."""

    def __init__(self, count: int, rank: int):
        self.left, self.hit = (count if rank == 0 else 0), 0

    def __call__(self, what: str) -> None:
        if what == "scatter staging" and self.left:
            self.left -= 1
            self.hit += 1
            raise OutOfMemory(f"injected: scatter staging #{self.hit}")


STAGING_FAILURES = 3  # from one 1 MiB chunk down to 128 KiB: below the smallest chunk_bytes a caller may ask for


def _staging_fails_first(count: int, world_size: int, rank: int) -> None:
    """``ztriton.partition`` whose first ``count`` staging allocations fail: it retries smaller and completes."""
    module, want = _Params(rank), list(_Params(0).parameters())
    faults = _StagingFaults(count, rank)
    with mock.patch.object(memory, "fault_hook", faults):
        result = ztriton.partition(module, chunk_bytes=PARTITION_CHUNK_BYTES)
    assert result.path.value == "scatter"
    _check_partitioned(module, want, world_size, rank)
    assert faults.hit == (count if rank == 0 else 0)


@pytest.mark.slow
def test_partition_sweep_scatter_path_gloo(gloo_world):
    """The scatter path (rank 0 scatters its values): every failure, on every rank or on one, is agreed; no rank
    hangs (the world's timeout fails the test). Staging that does not fit is retried smaller."""
    counts = gloo_world(_gloo_partition_sweeps, 2, timeout=150)
    # collectives: the checks' agreement, then per dtype the buffer's, the staging's and each chunk's (2 + 1 chunks);
    # allocations: per dtype the buffer (every rank), rank 0's scatter staging, the kernels' check scratch
    assert counts[0] == counts[1] and counts[0][0] >= 8, counts
    assert all(c >= least for c, least in zip(counts[0][1:], [5, 5, 3])), counts


# ---------------------------------------------------------------------------------------------- loader


class _Loadable(torch.nn.Module):
    """Params of odd sizes (padded partitions at W = 2), one spanning several 64-byte staging buffers, and a
    persistent buffer (loaded whole)."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Parameter(bits_tensor((11, 7), torch.float32, 5, 0).clone())
        self.small = torch.nn.Parameter(bits_tensor((5,), torch.float32, 5, 1).clone())
        self.short = torch.nn.Parameter(bits_tensor((3, 3), torch.bfloat16, 5, 2).clone())
        self.register_buffer("steps", torch.arange(3, dtype=torch.int64))


def _loader_checkpoint(folder) -> tuple[str, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    tensors = {"big": bits_tensor((11, 7), torch.float32, 9, 0), "small": bits_tensor((5,), torch.float32, 9, 1),
               "short": bits_tensor((3, 3), torch.bfloat16, 9, 2), "steps": torch.arange(3, dtype=torch.int64) + 70}
    path = str(folder / "m.safetensors")
    save_file(tensors, path)
    return path, tensors


def _outs(module) -> dict[str, torch.Tensor]:
    """Each target's ``out``: a param's partition, a buffer whole."""
    outs = {n: p.ds_tensor for n, p in module.named_parameters()}
    outs.update(dict(module.named_buffers()))
    return outs


def _loaded(name: str, out: torch.Tensor, tensors, world_size: int, rank: int) -> torch.Tensor:
    """The bits ``out`` holds after a complete load of ``name``."""
    full = bits(tensors[name]).reshape(-1)
    if name == "steps":
        return full
    start = rank * out.numel()
    count = max(0, min(start + out.numel(), full.numel()) - start)
    return torch.cat([full[start:start + count], torch.zeros(out.numel() - count, dtype=full.dtype)])


def _stated(error: BaseException) -> tuple[list[str], dict[str, int]] | None:
    """What a failed load says it wrote: (targets written in full, {target written in part: elements}); None when
    it says nothing (then nothing may have been written)."""
    import ast
    import re

    text = " ".join([str(error), *getattr(error, "__notes__", [])])
    if "nothing was written" in text:
        return [], {}
    full = re.search(r"written in full: (\[[^\]]*\])", text)
    parts = {m[0]: int(m[1]) for m in re.findall(r"written in part: '([^']+)' \(elements \[0, (\d+)\)", text)}
    if full is None and not parts:
        return None
    return (ast.literal_eval(full[1]) if full else []), parts


def _sweep_loader(path, tensors, world_size: int, rank: int, kind: str, threads: int) -> int:
    for at in range(1, MAX_STEPS):
        with fake_world(world_size, rank):
            module = _Loadable()
            ztriton.partition(module)
            outs = _outs(module)
            for out in outs.values():
                out.view(torch.uint8).fill_(0x5A)  # not the checkpoint's bytes, nor zeros
            before = {n: bits(o).clone() for n, o in outs.items()}
            staging.release()  # the ring allocates its buffers again, where the sweep sees it
            faults = _failing_reads(Injector("read", at, OSError)) if kind == "read" else injected(
                Injector("allocation", at, OutOfMemory))
            with faults as active:
                try:
                    ztriton.load_checkpoint(module, path, staging_bytes=64, threads=threads, progress=False)
                except Exception as exc:  # noqa: BLE001 -- the state must be what the error says
                    assert active.hit, f"{kind} #{at}: failed without reaching the fault: {exc!r}"
                    stated = _stated(exc)
                    full, parts = stated if stated is not None else ([], {})
                    for name, out in outs.items():
                        want = _loaded(name, out, tensors, world_size, rank)
                        if name in full:
                            assert torch.equal(bits(out), want), f"{kind} #{at}: {name} said written, is not"
                        elif name in parts:
                            n = parts[name]
                            assert torch.equal(bits(out)[:n], want[:n]), f"{kind} #{at}: {name}'s written part"
                            assert torch.equal(bits(out)[n:], before[name][n:]), f"{kind} #{at}: {name}'s rest"
                        else:
                            assert torch.equal(bits(out), before[name]), f"{kind} #{at}: {name} changed ({exc})"
                else:
                    for name, out in outs.items():
                        assert torch.equal(bits(out), _loaded(name, out, tensors, world_size, rank)), name
            if not active.hit:
                return at - 1
    raise AssertionError(f"{kind} sweep of the loader did not end within {MAX_STEPS} faults")


@contextlib.contextmanager
def _failing_reads(injector: Injector):
    """``os.preadv`` and ``os.pread`` (the loader's reads) fail at the injector's count, from any reader thread."""
    import threading

    lock = threading.Lock()
    real = {"preadv": os.preadv, "pread": os.pread}

    def wrap(name):
        def read(*args):
            with lock:
                injector(name)
            return real[name](*args)
        return read

    with mock.patch.object(os, "preadv", wrap("preadv")), mock.patch.object(os, "pread", wrap("pread")):
        yield injector


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind, threads", [("read", 1), ("read", 2), ("allocation", 2)])
def test_loader_sweep(kind, threads, rank, tmp_path):
    path, tensors = _loader_checkpoint(tmp_path)
    faults = _sweep_loader(path, tensors, 2, rank, kind, threads)
    assert faults >= (3 if kind == "read" else 1), faults  # several batches read; the ring's buffers allocated
