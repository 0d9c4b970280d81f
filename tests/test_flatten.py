"""ztriton.flatten_groups against DeepSpeed 0.19.8's ZeRO-1/2 flat buffers, every tier, on CPU.

The reference is ``DeepSpeedZeroOptimizer.bit16_groups_flat`` from ``deepspeed.initialize``
(``ds_reference.zero12_reference``); params hold arbitrary bit patterns, compared as integers. Tiers
are forced, and the memory probe is replaced by fixed figures so that the evict tier really evicts
and the distributed tier takes both of its paths (flat buffer before / after freeing the params).
On the fake process group collectives move nothing, so the distributed tier is checked on this
rank's window there (every rank in turn) and on the whole buffer under gloo.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import pickle
import weakref
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ztriton
from ds_reference import (BitsModule, bits, bits_tensor, groups_of, has_parameter_alignment, keeps_empty_params_in_groups,
                          zero12_reference)
from factories import record_calls
from worlds import fake_world
from ztriton import memory, policy, staging
from ztriton.flatten import tiers as F
from ztriton.layout import zero12_group_layout
from ztriton.memory import MemoryInfo, OutOfMemory
from ztriton.policy import Tier

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TIERS = [Tier.DEVICE, Tier.DISTRIBUTED, Tier.EVICT, Tier.HOST]
PRIMES = [2, 3, 5, 7, 11, 13, 17, 31, 37, 61]

ds_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _memory(free_bytes: int | None, host_bytes: int = 1 << 40):
    """Make the memory probe report ``free_bytes`` free on the device (None: the real probe)."""
    if free_bytes is None:
        yield
        return
    fake = lambda device: MemoryInfo(str(device), free_bytes, free_bytes, host_bytes, "test")  # noqa: E731
    with mock.patch.object(memory, "probe_memory", fake):
        yield


@contextlib.contextmanager
def _packer(kernels: bool):
    """Pack with the Triton kernels (interpreter) or with flatten's plain-torch path."""
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1" if kernels else "0"}):
        yield


def _own_slot_gather(out, part, world):
    """The all-gather as the fake process group should be read: this rank's part lands in its own slot
    (what a real gather does too); the other slots are not checked. (torch 2.13's fake group copies the
    part into every slot, older ones may leave the output alone: pinned down here either way.)"""
    out.narrow(0, world.rank * part.numel(), part.numel()).copy_(part)


@contextlib.contextmanager
def _world(world_size: int, rank: int, use_world: bool = True):
    """A fake world, or none at all for a world of one (flatten_groups then runs without torch.distributed)."""
    if use_world:
        with fake_world(world_size, rank), mock.patch.object(F, "all_gather_bytes", _own_slot_gather):
            yield
    else:
        assert world_size == 1
        yield


class _Spy:
    """Counts what the evict tier evicts and which allocations happen."""

    def __init__(self):
        self.evicted = 0
        self.freed = 0

    @contextlib.contextmanager
    def active(self):
        evict, point_at = F._evict, F._point_at

        def spy_evict(g, positions, *args):
            self.evicted += len(positions)
            return evict(g, positions, *args)

        def spy_free(g, *args, **kwargs):  # the params leave the device: pointed at a host copy
            self.freed += 1
            return point_at(g, *args, **kwargs)

        with mock.patch.object(F, "_evict", spy_evict), mock.patch.object(F, "_point_at", spy_free):
            yield self


def _snapshot(groups):
    """Per group, per param: (the param, its bits, its data_ptr, its shape) before flattening."""
    return [[(p, bits(p).clone(), p.data_ptr(), p.shape) for p in g["params"]] for g in groups]


def _check_against_reference(result, reference, before, world_size, rank, tier, whole=True):
    """flatten_groups' groups against DeepSpeed's: layout, bytes (whole buffer or this rank's window),
    aliasing, untouched frozen/empty params, partitions."""
    assert len(result) == len(reference) == len(before)
    for fg, ref, snap in zip(result, reference, before):
        assert isinstance(fg, ztriton.FlatGroup)
        assert fg.tier is tier
        assert fg.order == ref.order
        assert fg.offsets == ref.offsets
        assert fg.paddings == ref.paddings
        assert fg.flat.dtype == ref.flat.dtype and fg.flat.dim() == 1
        assert fg.flat.numel() == ref.flat.numel()
        assert fg.layout.partition_numel == ref.partition_numel
        assert fg.world_size == world_size and fg.rank == rank
        assert not fg.flat.requires_grad and fg.flat.grad_fn is None  # detached
        w0, w1 = ref.windows[rank] if not whole else (0, ref.flat.numel())
        assert torch.equal(bits(fg.flat)[w0:w1], bits(ref.flat)[w0:w1]), f"tier {tier}: bytes differ in [{w0}, {w1})"
        assert [id(p) for p in fg.params] == [id(snap[j][0]) for j in fg.order]
        for i, (param, values, ptr, shape) in enumerate(snap):
            if ref.aliases[i] is None:  # frozen or empty: untouched
                assert param.data_ptr() == ptr and torch.equal(bits(param), values), f"params[{i}] was touched"
                continue
            assert param.untyped_storage().data_ptr() == fg.flat.untyped_storage().data_ptr(), f"params[{i}]"
            offset = param.storage_offset() - fg.flat.storage_offset()
            assert offset == ref.aliases[i]
            assert param.shape == shape and param.is_contiguous()
            lo, hi = max(offset, w0), min(offset + param.numel(), w1)
            if lo < hi:  # the param's values inside the checked range
                assert torch.equal(bits(param)[lo - offset:hi - offset], values[lo - offset:hi - offset])
        for r in range(world_size):
            part = fg.partition(r)
            assert part.storage_offset() - fg.flat.storage_offset() == ref.windows[r][0]
            assert part.numel() == ref.windows[r][1] - ref.windows[r][0]


def _run_flatten(factory, sizes, world_size, rank, tier, *, round_robin, alignment, free_bytes=None,
                 kernels=True, use_world=True, **options):
    """Build the model, flatten its groups as ``rank`` of a fake world; return (result, snapshot, groups)."""
    with _world(world_size, rank, use_world), _memory(free_bytes), _packer(kernels):
        model = factory()
        groups = groups_of(model, sizes)
        before = _snapshot(groups)
        result = ztriton.flatten_groups(groups, round_robin=round_robin, parameter_alignment=alignment,
                                        tier=tier, headroom_bytes=0, **options)
    return result, before, groups


def _element_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _group_bytes(shapes, frozen, sizes, world_size, dtype, round_robin, alignment):
    """Sum over groups of the flat buffers' bytes."""
    total, first = 0, 0
    for size in sizes:
        idx = range(first, first + size)
        numels = [int(torch.Size(shapes[i]).numel()) for i in idx]
        layout = zero12_group_layout(numels, world_size, element_size=_element_size(dtype),
                                     trainable=[i not in frozen for i in idx], round_robin=round_robin,
                                     parameter_alignment=alignment)
        total += layout.total_numel * _element_size(dtype)
        first += size
    return total


# --------------------------------------------------------------- conformance with DeepSpeed (fake pg)


@st.composite
def shapes_of(draw, numel):
    """A 1-D or 2-D shape with ``numel`` elements (never 0-d: DeepSpeed 0.19.8 fails on those)."""
    if not draw(st.booleans()):
        return (numel,)
    rows = draw(st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0] or [1, 3]))
    return (rows, numel // rows)


@st.composite
def zero12_models(draw):
    """Shapes, frozen indices and group sizes; every group has a trainable non-empty param (DeepSpeed fails
    on a group without one); frozen and zero-size params mixed in."""
    numel = st.one_of(st.just(0), st.just(1), st.sampled_from(PRIMES), st.integers(0, 60))
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    numels, frozen = [], []
    for size in sizes:
        group = draw(st.lists(numel, min_size=size, max_size=size))
        flags = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        keep = draw(st.integers(0, size - 1))
        group[keep], flags[keep] = max(group[keep], 1), False
        frozen += [len(numels) + k for k in range(size) if flags[k]]
        numels += group
    shapes = [draw(shapes_of(n)) for n in numels]
    return shapes, tuple(frozen), sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alignment", [False, True], ids=["noalign", "align"])
@pytest.mark.parametrize("round_robin", [False, True], ids=["seq", "rr"])
@pytest.mark.parametrize("stage", [1, 2])
@settings(ds_settings, max_examples=10)
@given(model=zero12_models(), world_size=st.sampled_from([1, 2, 3, 4, 8]), data=st.data(), seed=st.integers(0, 2**20))
def test_flatten_matches_deepspeed(stage, round_robin, alignment, dtype, model, world_size, data, seed):
    """Every tier's flat buffer is DeepSpeed's, byte for byte, and the params alias it.

    Memory is drawn (so eviction takes some, all or none of the params), and so is the packer
    (Triton kernels under the interpreter, or the plain-torch path for CPU without the interpreter).
    """
    shapes, frozen, sizes = model
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    factory = functools.partial(BitsModule, shapes, seed, dtype, frozen)
    reference = zero12_reference(factory, world_size, rank, stage, round_robin, alignment, dtype,
                                 param_groups_fn=functools.partial(groups_of, sizes=sizes))
    total = _group_bytes(shapes, frozen, sizes, world_size, dtype, round_robin, alignment)
    for tier in TIERS:
        if tier is Tier.DISTRIBUTED and world_size == 1:
            continue
        free = data.draw(st.integers(0, 2 * total + 8), label=f"free bytes ({tier.value})")
        kernels = data.draw(st.booleans(), label=f"kernels ({tier.value})")
        use_world = world_size > 1 or data.draw(st.booleans(), label="fake world at W=1")
        result, before, _ = _run_flatten(factory, sizes, world_size, rank, tier, round_robin=round_robin,
                                         alignment=alignment, free_bytes=free, kernels=kernels, use_world=use_world)
        whole = tier is not Tier.DISTRIBUTED  # fake collectives: only this rank's window is real
        _check_against_reference(result, reference, before, world_size, rank, tier, whole=whole)


# A fixed model with everything in it: frozen, empty, 1-element, odd sizes, two groups.
FIXED_SHAPES = [(5,), (3,), (0,), (7, 2), (1,), (2,), (9,), (4, 3), (11,), (6, 5), (13,)]
FIXED_FROZEN = (1, 7)
FIXED_SIZES = [4, 7]


@functools.lru_cache(maxsize=None)
def _fixed_reference(world_size, dtype=torch.bfloat16, round_robin=True, alignment=True):
    factory = functools.partial(BitsModule, FIXED_SHAPES, 3, dtype, FIXED_FROZEN)
    return zero12_reference(factory, world_size, 0, 2, round_robin, alignment, dtype,
                            param_groups_fn=functools.partial(groups_of, sizes=FIXED_SIZES))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("tier", TIERS, ids=[t.value for t in TIERS])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_tier_every_world(world_size, tier, kernels):
    """Each tier at each world size, on every rank; a budget of half the params makes eviction partial and
    sends the distributed tier down its free-the-params-first path."""
    if tier is Tier.DISTRIBUTED and world_size == 1:
        pytest.skip("distributed needs W > 1 (covered by test_distributed_needs_a_world)")
    reference = _fixed_reference(world_size)
    factory = functools.partial(BitsModule, FIXED_SHAPES, 3, torch.bfloat16, FIXED_FROZEN)
    total = _group_bytes(FIXED_SHAPES, FIXED_FROZEN, FIXED_SIZES, world_size, torch.bfloat16, True, True)
    free = 0 if tier is Tier.DISTRIBUTED else total // 4
    for rank in range(world_size) if tier is Tier.DISTRIBUTED else [world_size - 1]:
        with _Spy().active() as spy:
            result, before, _ = _run_flatten(factory, FIXED_SIZES, world_size, rank, tier, round_robin=True,
                                             alignment=True, free_bytes=free, kernels=kernels)
        _check_against_reference(result, reference, before, world_size, rank, tier,
                                 whole=tier is not Tier.DISTRIBUTED)
        if tier is Tier.EVICT:
            assert 0 < spy.evicted < sum(len(g.params) for g in result), "eviction should be partial"
        if tier is Tier.DISTRIBUTED:
            assert spy.freed == len(result), "the params should be freed before the flat buffer is allocated"


@pytest.mark.parametrize("world_size", [2, 8])
def test_distributed_allocates_before_freeing_when_room(world_size):
    """With room for everything, the flat buffer comes before the params are freed (they never are)."""
    factory = functools.partial(BitsModule, FIXED_SHAPES, 3, torch.bfloat16, FIXED_FROZEN)
    reference = _fixed_reference(world_size)
    with _Spy().active() as spy:
        result, before, _ = _run_flatten(factory, FIXED_SIZES, world_size, 1, Tier.DISTRIBUTED, round_robin=True,
                                         alignment=True, free_bytes=1 << 30)
    _check_against_reference(result, reference, before, world_size, 1, Tier.DISTRIBUTED, whole=False)
    assert spy.freed == 0


@pytest.mark.parametrize("world_size, free_fraction, expected", [
    (1, 4.0, Tier.DEVICE),       # room for the flat buffer beside the params
    (4, 0.5, Tier.DISTRIBUTED),  # only for a 1/W window
    (1, 0.5, Tier.EVICT),        # W = 1: no distributed tier
    (4, 0.1, Tier.EVICT),        # not even a window
])
def test_tier_chosen_from_free_memory(world_size, free_fraction, expected):
    """Without a forced tier, the probe's figures decide (here: one group, so one decision)."""
    shapes, sizes = [(64,), (33,), (8, 8)], [3]
    factory = functools.partial(BitsModule, shapes, 1, torch.bfloat16, ())
    total = _group_bytes(shapes, (), sizes, world_size, torch.bfloat16, False, False)
    reference = zero12_reference(factory, world_size, 0, 1, False, False, torch.bfloat16)
    result, before, _ = _run_flatten(factory, sizes, world_size, 0, None, round_robin=False, alignment=False,
                                     free_bytes=int(total * free_fraction))
    _check_against_reference(result, reference, before, world_size, 0, expected,
                             whole=expected is not Tier.DISTRIBUTED)
    assert result[0].decision.tier is expected


def test_host_tier_chosen_when_host_memory_is_short():
    shapes = [(64,), (33,)]
    factory = functools.partial(BitsModule, shapes, 1, torch.float16, ())
    reference = zero12_reference(factory, 1, 0, 1, False, False, torch.float16)
    fake = lambda device: MemoryInfo(str(device), 0, 0, 0, "test")  # noqa: E731
    staging.release()  # idle spill memory counts as host memory the tiers can use: none here
    with mock.patch.object(memory, "probe_memory", fake):
        model = factory()
        groups = [list(model.parameters())]
        before = _snapshot([{"params": groups[0]}])
        result = ztriton.flatten_groups(groups, headroom_bytes=0)
    _check_against_reference(result, reference, before, 1, 0, Tier.HOST)


# ------------------------------------------------------------------------ what DeepSpeed cannot show


def _expected_flat(values, layout, dtype):
    """The flat buffer by hand: ``values`` (per param of the group, as handed in) at the layout's offsets."""
    flat = torch.zeros(layout.total_numel, dtype=dtype)
    for j, offset, numel in zip(layout.order, layout.offsets, layout.numels):
        flat[offset:offset + numel] = values[j].reshape(-1)
    return flat


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.EVICT, Tier.HOST], ids=lambda t: t.value)
def test_strided_and_scalar_params(tier, kernels):
    """Transposed, sliced and 0-d params (which DeepSpeed's engine cannot take) flatten row-major."""
    base = bits_tensor((6, 10), torch.bfloat16, 9)
    params = [torch.nn.Parameter(base.t()), torch.nn.Parameter(bits_tensor((), torch.bfloat16, 9, 1)),
              torch.nn.Parameter(bits_tensor((8, 6), torch.bfloat16, 9, 2)[::2, 1:]),
              torch.nn.Parameter(bits_tensor((3,), torch.bfloat16, 9, 3))]
    values = [p.detach().clone() for p in params]
    assert not params[0].is_contiguous() and not params[2].is_contiguous()
    with _memory(sum(v.numel() for v in values)), _packer(kernels):
        (fg,) = ztriton.flatten_groups([params], tier=tier, parameter_alignment=True, headroom_bytes=0)
    layout = zero12_group_layout([v.numel() for v in values], 1, element_size=2, parameter_alignment=True)
    assert torch.equal(bits(fg.flat), bits(_expected_flat(values, layout, torch.bfloat16)))
    for p, v in zip(params, values):
        assert p.shape == v.shape and p.is_contiguous() and torch.equal(bits(p), bits(v))
        assert p.untyped_storage().data_ptr() == fg.flat.untyped_storage().data_ptr()


def test_params_alias_the_buffer_both_ways():
    """Writes through the buffer show in the params and the other way round; grads are unaffected."""
    params = [torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3)),
              torch.nn.Parameter(torch.arange(5, dtype=torch.float32))]
    (fg,) = ztriton.flatten_groups([{"params": params}])
    fg.flat.fill_(7)
    assert torch.equal(params[0].detach(), torch.full((2, 3), 7.0))
    with torch.no_grad():
        params[1].fill_(3)
    assert torch.equal(fg.flat[6:11], torch.full((5,), 3.0))
    assert all(p.requires_grad and isinstance(p, torch.nn.Parameter) for p in params)
    (params[0].sum() * 2).backward()
    assert torch.equal(params[0].grad, torch.full((2, 3), 2.0)) and fg.flat.grad is None


def test_flat_group_is_read_only_and_says_what_it_holds():
    """A FlatGroup's fields cannot be set or deleted (as a frozen dataclass's), it compares by identity, and its
    repr names every field."""
    params = [torch.nn.Parameter(torch.arange(6, dtype=torch.float32))]
    (fg,) = ztriton.flatten_groups([{"params": params}])
    for name in ("flat", "params", "layout", "tier", "rank", "decision"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(fg, name, None)
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(fg, name)
        assert f"{name}=" in repr(fg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fg.other = 1
    assert fg.params == (params[0],) and fg.rank == 0 and fg.tier is Tier.DEVICE and fg.decision is not None
    (again,) = ztriton.flatten_groups([{"params": [torch.nn.Parameter(torch.arange(6, dtype=torch.float32))]}])
    assert fg == fg and fg != again
    for copied in (copy.copy(fg), copy.deepcopy(fg), pickle.loads(pickle.dumps(fg))):  # as a frozen dataclass's
        assert type(copied) is ztriton.FlatGroup and copied is not fg and torch.equal(copied.flat, fg.flat)
        assert copied.layout == fg.layout and copied.tier is fg.tier and copied.rank == fg.rank
        assert copied.decision == fg.decision and len(copied.params) == 1
    assert copy.copy(fg).flat is fg.flat and copy.deepcopy(fg).flat is not fg.flat
    assert weakref.ref(fg)() is fg
    match fg:
        case ztriton.FlatGroup(flat, params, layout, tier, rank, decision):
            assert flat is fg.flat and tier is fg.tier and decision is fg.decision

    class Tagged(ztriton.FlatGroup):  # a subclass may carry attributes of its own; its fields stay read-only
        pass

    tagged = Tagged(fg.flat, fg.params, fg.layout, fg.tier, fg.rank, fg.decision)
    tagged.note = "mine"
    assert tagged.note == "mine" and tagged.flat is fg.flat and "Tagged(flat=" in repr(tagged)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tagged.rank = 1


def test_every_kind_of_param_is_repointed_into_the_buffer():
    """Params, plain tensors, a tensor from .detach() and a view of another tensor: each
    keeps its identity and values and ends up a contiguous view of the flat buffer with its shape (in place
    where torch allows it, through .data where not)."""
    leaf = torch.arange(40, dtype=torch.float32).requires_grad_()
    params = [torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3)),
              torch.arange(4, dtype=torch.float32).requires_grad_(),
              torch.nn.Parameter(torch.arange(5, dtype=torch.float32)).detach().requires_grad_(),
              leaf[10:18].view(2, 4),  # a view (of a leaf that is not flattened)
              torch.nn.Parameter(torch.arange(30, dtype=torch.float32)[20:30])]
    assert params[3]._is_view()
    before = [p.detach().clone() for p in params]
    ids, versions = [id(p) for p in params], [p._version for p in params]
    loss = sum((p * p).sum() for p in params)  # a graph built before the flatten, as DeepSpeed allows
    (fg,) = ztriton.flatten_groups([params])
    storage = fg.flat.untyped_storage().data_ptr()
    for p, v, i, offset in zip(params, before, ids, fg.offsets):
        assert id(p) == i and p.shape == v.shape and p.is_contiguous() and torch.equal(p.detach(), v)
        assert p.untyped_storage().data_ptr() == storage and p.storage_offset() == fg.flat.storage_offset() + offset
    assert [p._version for p in params] == versions  # re-pointed like `.data =`, not modified in place
    loss.backward()
    assert torch.equal(params[0].grad, 2 * before[0])


def test_evicted_params_go_through_the_spill_pool(monkeypatch):
    """Evict and host tiers: params go to the process's spill memory and come back from it, one copy each,
    not through the staging ring; only the first call allocates host memory (the pool's block is reused),
    and none stays lent once the params alias the flat buffer."""
    from ztriton import staging

    staging.release()
    loans, allocations = [], []
    real = staging.spill

    def spy(nbytes, device=None, what="host spill"):
        loan = real(nbytes, device, what)
        loans.append(loan.data_ptr())  # the address only: holding the tensor would keep the loan
        return loan

    monkeypatch.setattr(staging, "spill", spy)
    monkeypatch.setattr(staging, "copy_staged", mock.Mock(side_effect=AssertionError("copied through the ring")))
    monkeypatch.setattr(memory, "fault_hook", allocations.append)
    pool = staging.spill_pool()
    before = pool.allocations
    for call, tier in enumerate(["evict", "host", "evict", "host"]):
        params = [torch.nn.Parameter(bits_tensor((37,), torch.float16, 2, i)) for i in range(4)]
        values = [p.detach().clone() for p in params]
        allocations.clear()
        with _memory(0):
            (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0, chunk_bytes=1 << 20)
        layout = zero12_group_layout([37] * 4, 1, element_size=2)
        assert torch.equal(bits(fg.flat), bits(_expected_flat(values, layout, torch.float16)))
        assert pool.lent == 0
        spilled = {"evicted params", "host copy of the params"} & set(allocations)
        assert spilled == ({"evicted params"} if call == 0 else set()), allocations
    assert pool.allocations == before + 1 and len(set(loans)) == 1 and len(loans) == 4  # one block, every call


def test_torch_path_used_without_interpreter(caplog):
    """CPU tensors without TRITON_INTERPRET=1: the kernels are not called, and the log says so."""
    params = [torch.nn.Parameter(torch.arange(5, dtype=torch.float32))]
    with _packer(False), mock.patch.object(F, "pack", side_effect=AssertionError("kernels called")), \
            caplog.at_level("INFO", logger="ztriton"):
        (fg,) = ztriton.flatten_groups([params])
    assert fg.flat[:5].tolist() == [0, 1, 2, 3, 4] and fg.flat[5:].tolist() == [0]
    assert "packing with torch" in caplog.text


@pytest.mark.parametrize("tier", ["device", "evict", "host"])
def test_repoint_false_leaves_only_the_device_tiers_params_for_the_caller(tier):
    """``repoint=False`` (the DeepSpeed hook: its optimizer re-points every param itself right after): the
    buffer's bytes are those of a re-pointing call; on the device tier every param keeps its own memory for the
    caller to re-point; the tiers that make room moved the values out of the params' memory and re-point them
    anyway, so a caller that fails before its own re-pointing leaves no param in host memory."""
    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(s, generator=generator).bfloat16() for s in [(7, 5), (3,), (16, 9), (2, 2, 2)]]
    results = {}
    for repoint in (True, False):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        before = [(bits(p).clone(), p.data_ptr()) for p in params]
        with _memory(0):
            (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0, repoint=repoint)
        results[repoint] = bits(fg.flat).clone()
        assert fg.tier is Tier(tier)
        for p, (held, ptr) in zip(params, before):
            assert torch.equal(bits(p), held)
            in_flat = p.untyped_storage().data_ptr() == fg.flat.untyped_storage().data_ptr()
            assert in_flat is (repoint or tier != "device")
            if not repoint and tier == "device":
                assert p.data_ptr() == ptr  # untouched
    assert torch.equal(results[True], results[False])


def test_decision_is_logged(caplog):
    params = [torch.nn.Parameter(torch.ones(4))]
    with caplog.at_level("INFO", logger="ztriton"):
        ztriton.flatten_groups([params], tier="host")
    assert "flatten group 0: host -- forced by the caller" in caplog.text
    assert "flattened by tier host" in caplog.text


# ---------------------------------------------------------------------- allocation failures fall through


@contextlib.contextmanager
def _failing_allocations(fail):
    """Make ``memory.empty`` (as the tiers call it, directly or through ``try_empty``) raise an OOM when
    ``fail(what, count_of_that_what)`` says so. The spill pool starts empty, so that its host memory is
    allocated (and can fail) in the call, not reused from an earlier test."""
    from ztriton import staging

    staging.release()
    real, counts = memory.empty, {}

    def empty(numel, dtype, device, what):
        counts[what] = counts.get(what, 0) + 1
        if fail(what, counts[what]):
            raise OutOfMemory(f"test: no memory for the {what}")
        return real(numel, dtype, device, what)

    with mock.patch.object(F, "empty", empty), mock.patch.object(memory, "empty", empty):
        yield counts


def _fixed_model(dtype=torch.bfloat16):
    return functools.partial(BitsModule, FIXED_SHAPES, 3, dtype, FIXED_FROZEN)


@pytest.mark.parametrize("start, fails, expected", [
    (Tier.DEVICE, 1, Tier.EVICT),   # device -> evict (the probe says nothing needs evicting; the retry fits)
    (Tier.DEVICE, 3, Tier.HOST),    # device, evict (twice) -> host
    (Tier.EVICT, 1, Tier.EVICT),    # evict's first try fails, it evicts the rest and succeeds
    (Tier.EVICT, 2, Tier.HOST),
])
def test_oom_falls_through(start, fails, expected):
    reference = _fixed_reference(1)
    with _failing_allocations(lambda what, n: what == "flat buffer" and n <= fails):
        result, before, _ = _run_flatten(_fixed_model(), FIXED_SIZES, 1, 0, start, round_robin=True, alignment=True,
                                         use_world=False)
    # each group sees its own failures: only group 0 falls through
    assert result[0].tier is expected and result[1].tier is start
    for fg, ref, snap in zip(result, reference, before):
        _check_against_reference([fg], [ref], [snap], 1, 0, fg.tier)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fails, expected", [(1, Tier.DISTRIBUTED), (2, Tier.EVICT)])
def test_distributed_oom_falls_through(world_size, fails, expected):
    """Distributed tier, fake world, room for everything: group 0's flat buffer fails before the params
    are freed (they are freed, and the retry fits), or before and after (the params are rebuilt from
    the partitions in host memory and the evict tier copies them in). Group 1 is not affected."""
    reference = _fixed_reference(world_size)
    rank = world_size - 1
    with _Spy().active() as spy, _failing_allocations(lambda what, n: what == "flat buffer" and n <= fails):
        result, before, _ = _run_flatten(_fixed_model(), FIXED_SIZES, world_size, rank, Tier.DISTRIBUTED,
                                         round_robin=True, alignment=True, free_bytes=1 << 30)
    assert [fg.tier for fg in result] == [expected, Tier.DISTRIBUTED]
    assert spy.freed == 1  # group 0 only: group 1's flat buffer fits before its params are freed
    for fg, ref, snap in zip(result, reference, before):
        _check_against_reference([fg], [ref], [snap], world_size, rank, fg.tier, whole=False)


def test_distributed_partition_oom_falls_through():
    reference = _fixed_reference(3)
    with _failing_allocations(lambda what, n: what == "partition buffer"):
        result, before, _ = _run_flatten(_fixed_model(), FIXED_SIZES, 3, 2, Tier.DISTRIBUTED, round_robin=True,
                                         alignment=True)
    _check_against_reference(result, reference, before, 3, 2, Tier.EVICT)


def test_distributed_keeps_params_without_host_room():
    """Freeing the params is only safe if host memory could take the recovery copy; otherwise fall through."""
    reference = _fixed_reference(2)
    staging.release()  # idle spill memory counts as host memory the tiers can use: none here
    with _Spy().active() as spy:
        with _world(2, 0), mock.patch.object(memory, "probe_memory",
                                                 lambda d: MemoryInfo(str(d), 0, 0, 10, "test")):
            model = _fixed_model()()
            groups = groups_of(model, FIXED_SIZES)
            before = _snapshot(groups)
            result = ztriton.flatten_groups(groups, round_robin=True, parameter_alignment=True,
                                            tier="distributed", headroom_bytes=0)
    assert spy.freed == 0
    _check_against_reference(result, reference, before, 2, 0, Tier.EVICT, whole=True)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_every_tier_out_of_memory_keeps_values(kernels):
    """When nothing fits, OutOfMemoryError names the state; every param keeps its values and shape."""
    with _failing_allocations(lambda what, n: what == "flat buffer"), _packer(kernels):
        model = _fixed_model()()
        groups = groups_of(model, FIXED_SIZES)
        before = _snapshot(groups)
        with pytest.raises(torch.OutOfMemoryError, match=r"every tier ran out of memory.*keep their values"):
            ztriton.flatten_groups(groups, round_robin=True, parameter_alignment=True, tier="device")
    for snap in before:
        for param, values, _, _ in snap:
            assert torch.equal(bits(param), values) and param.device.type == "cpu"
    shapes = [p.shape for p in model.parameters()]
    assert shapes == [torch.Size(s) for s in FIXED_SHAPES]


# ------------------------------------------------------------------------------------------- bad input


def _p(*shape, dtype=torch.float32, requires_grad=True, device="cpu"):
    return torch.nn.Parameter(torch.ones(shape, dtype=dtype, device=device), requires_grad=requires_grad)


def test_mixed_dtypes_rejected_before_anything_moves():
    good = [_p(3), _p(4)]
    ptrs = [p.data_ptr() for p in good]
    with pytest.raises(TypeError, match=r"param_groups\[1\] mixes dtypes: params\[0\] is torch.float32, params\[2\] "
                                        r"is torch.bfloat16.*cast the model"):
        bad = [_p(2), _p(0, dtype=torch.int8, requires_grad=False), _p(3, dtype=torch.bfloat16)]
        ztriton.flatten_groups([good, bad])
    assert [p.data_ptr() for p in good] == ptrs  # group 0 was not flattened either


def test_mixed_dtypes_among_frozen_params_are_fine():
    frozen = _p(2, dtype=torch.float16, requires_grad=False)
    (fg,) = ztriton.flatten_groups([[_p(3), frozen, _p(0, dtype=torch.int64, requires_grad=False)]])
    assert fg.flat.dtype == torch.float32 and fg.flat.numel() == 4


def test_mixed_devices_rejected():
    with pytest.raises(ValueError, match=r"mixes devices: params\[0\] is on cpu, params\[1\] on meta.*model.to"):
        ztriton.flatten_groups([[_p(3), _p(3, device="meta")]])


def test_meta_params_rejected():
    with pytest.raises(ValueError, match=r"params\[0\] is on the meta device.*materialise"):
        ztriton.flatten_groups([[_p(3, device="meta")]])


def test_sparse_params_rejected():
    sparse = torch.nn.Parameter(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"params\[0\] has layout torch.sparse_coo.*dense"):
        ztriton.flatten_groups([[sparse]])


def test_param_listed_twice_rejected():
    p = _p(4)
    with pytest.raises(ValueError, match=r"params\[0\] and .*params\[2\] are the same tensor.*pass a shared param"):
        ztriton.flatten_groups([[p, _p(2), p]])


def test_param_in_two_groups_rejected():
    p = _p(4)
    with pytest.raises(ValueError, match=r"param_groups\[0\] params\[1\] and param_groups\[1\] params\[0\] are the"):
        ztriton.flatten_groups([[_p(2), p], [p]])


def test_tied_params_in_a_large_group_are_rejected_with_every_param_untouched():
    """The no-shared-memory check runs while the device tier's pack copies (it only reads the params into
    a new buffer): still before any param is re-pointed, for every group."""
    params = [_p(5) for _ in range(120)]
    params.append(params[70])  # listed twice, past the first pack batches
    before = [(p.data_ptr(), p.detach().clone()) for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[1\] params\[10\] and param_groups\[1\] params\[60\] are the same"):
        ztriton.flatten_groups([params[:60], params[60:]], tier="device")
    for p, (ptr, values) in zip(params, before):
        assert p.data_ptr() == ptr and torch.equal(p.detach(), values)


def _raw_bits(p: torch.Tensor) -> torch.Tensor:
    """The bits a param reads as (a lazy negation resolved), as a copy."""
    return bits(p.detach().resolve_neg()).clone()


def _lead_job(fault: str | None):
    """Two groups: the first with one param big enough to lead (LEAD_BYTES lowered to 32 floats) among small ones,
    the second with ``fault`` in its last param (None: none)."""
    first = [torch.nn.Parameter(bits_tensor((n,), torch.float32, 40, k)) for k, n in enumerate([5, 48, 3, 7])]
    second = [torch.nn.Parameter(bits_tensor((4,), torch.float32, 41, k)) for k in range(2)]
    if fault == "dtype":
        second[-1] = torch.nn.Parameter(bits_tensor((4,), torch.float64, 42))
    elif fault == "negated":
        second[-1] = torch.nn.Parameter(bits_tensor((4,), torch.float32, 42)._neg_view())
    return first, second


@pytest.mark.parametrize("fault", [None, "dtype", "negated"])
def test_the_device_tiers_param_checks_run_while_its_lead_copies(monkeypatch, fault):
    """The checks of the params themselves (one dtype and device per group, values the kernels copy) guard what
    moves, not the device tier's copies into its fresh buffer: they run, for every group, once the device has the
    first group's lead, before the rest of its job is planned. A bad param in a later group is then named with no
    param re-pointed and every byte as it was."""
    from ztriton.flatten import groups as groups_module
    from ztriton.kernels import turns as turns_module

    monkeypatch.setattr(turns_module, "LEAD_BYTES", 32 * 4)
    steps = record_calls(monkeypatch, [(owner, name, name) for owner, name in (
        (turns_module, "_copy_lead"), (turns_module, "pack_pieces"), (turns_module, "run_plan"),
        (groups_module, "_check_params"))])
    first, second = _lead_job(fault)
    before = [(p, p.data_ptr(), _raw_bits(p)) for p in first + second]
    if fault is None:
        result = ztriton.flatten_groups([first, second], tier="device")
        assert steps == ["_copy_lead", "pack_pieces", "_check_params", "run_plan", "pack_pieces", "run_plan"]
        for fg in result:
            for p, offset in zip(fg.params, fg.offsets):
                _, _, values = next(b for b in before if b[0] is p)
                assert torch.equal(bits(fg.flat[offset:offset + p.numel()]), values)
        return
    message = {"dtype": r"param_groups\[1\] mixes dtypes: params\[0\] is torch.float32, params\[1\] is torch.float64",
               "negated": r"param_groups\[1\] params\[1\] is a lazy conjugate or negated view"}[fault]
    with pytest.raises((TypeError, ValueError), match=message):
        ztriton.flatten_groups([first, second], tier="device")
    assert steps == ["_copy_lead", "pack_pieces", "_check_params"]  # during group 0's lead, before its plan
    for p, ptr, values in before:
        assert p.data_ptr() == ptr and torch.equal(_raw_bits(p), values)


@pytest.mark.parametrize("fault", ["dtype", "negated", "meta"])
def test_a_bad_param_in_the_first_turn_is_named_by_the_flatten(monkeypatch, fault):
    """A group that goes in turns, its bad param among the first turn's: the kernels' plan refuses it before the
    device tier's checks ran, and the flatten's own error (naming the group and param) is the one raised, with every
    param as it was. dtype: a TypeError; negated, meta: ValueErrors."""
    from ztriton.kernels import turns as turns_module

    monkeypatch.setattr(turns_module, "MIN_MEAN_BYTES", 0)
    params = [torch.nn.Parameter(bits_tensor((1 + k % 5,), torch.float32, 43, k)) for k in range(200)]
    params[3] = torch.nn.Parameter({"dtype": lambda: bits_tensor((40,), torch.float64, 44),
                                    "negated": lambda: bits_tensor((40,), torch.float32, 44)._neg_view(),
                                    "meta": lambda: torch.empty(40, device="meta")}[fault]())
    planned = []  # the sources of each plan the pack makes
    real = turns_module.make_plan
    monkeypatch.setattr(turns_module, "make_plan", lambda dst, pieces, *a, **k:
                        planned.append([id(s) for s in pieces.sources]) or real(dst, pieces, *a, **k))
    before = [(p, p.data_ptr(), None if p.is_meta else _raw_bits(p)) for p in params]
    message = {"dtype": r"param_groups\[0\] mixes dtypes: params\[0\] is torch.float32, params\[3\] is torch.float64",
               "negated": r"param_groups\[0\] params\[3\] is a lazy conjugate or negated view",
               "meta": r"param_groups\[0\] mixes devices: params\[0\] is on cpu, params\[3\] on meta"}[fault]
    with pytest.raises(TypeError if fault == "dtype" else ValueError, match=message):
        ztriton.flatten_groups([params], tier="device")
    assert id(params[3]) in planned[0]  # the biggest: in the first turn, whose plan refused it
    for p, ptr, values in before:
        assert p.data_ptr() == ptr and (values is None or torch.equal(_raw_bits(p), values))


def test_a_check_that_runs_out_of_memory_is_raised_not_taken_for_the_tiers(monkeypatch, caplog):
    """The kernels' check of a strided param allocates a scratch element; if that fails while the device tier
    copies, the error is the check's, raised as it is: no tier is tried after it and no param moved."""
    params = [_p(5), torch.nn.Parameter(torch.randn(8, 8).t()), _p(3)]
    before = [(p, p.data_ptr(), bits(p).clone()) for p in params]

    def no_scratch(what):
        if what == "kernel check scratch":
            raise OutOfMemory("could not allocate the kernel check scratch (injected)")

    monkeypatch.setattr(memory, "fault_hook", no_scratch)
    with caplog.at_level("WARNING", logger="ztriton"), pytest.raises(torch.OutOfMemoryError, match="check scratch"):
        ztriton.flatten_groups([params])
    assert "trying the next tier" not in caplog.text
    for p, ptr, values in before:
        assert p.data_ptr() == ptr and torch.equal(bits(p), values)


def _check_fails_on_one_gloo_rank(rank, world_size):
    """Rank 1 alone holds a param of another dtype in its group: it raises the check's error with no param moved,
    rank 0 a RuntimeError saying it failed on another rank; neither hangs. Rank 0 checked its own params while its
    lead copied and may have re-pointed its first group by then: every param there keeps its values."""
    from ztriton.kernels import turns as turns_module

    turns_module.LEAD_BYTES = 32 * 4  # this rank's own process
    first, second = _lead_job("dtype" if rank == 1 else None)
    before = [(p, p.data_ptr(), bits(p).clone()) for p in first + second]
    try:
        ztriton.flatten_groups([first, second], tier="device")
    except (TypeError, RuntimeError) as exc:
        caught = (type(exc).__name__, str(exc))
    else:
        caught = None
    same_values = all(torch.equal(bits(p), values) for p, _, values in before)
    same_memory = all(p.data_ptr() == ptr for p, ptr, _ in before)
    return caught, same_values, same_memory


def test_a_param_check_failing_on_one_rank_fails_every_rank_and_keeps_every_value(gloo_world):
    (error0, values0, _), (error1, values1, memory1) = gloo_world(_check_fails_on_one_gloo_rank, 2, timeout=120)
    assert values0 and values1 and memory1
    assert error1[0] == "TypeError" and "mixes dtypes" in error1[1]
    assert error0[0] == "RuntimeError" and "flatten group 0 failed on another rank" in error0[1]


def test_tied_views_rejected():
    base = torch.ones(10)
    a, b = torch.nn.Parameter(base[0:6]), torch.nn.Parameter(base[4:10])
    with pytest.raises(ValueError, match=r"share memory \(tied weights, or overlapping views\).*untie"):
        ztriton.flatten_groups([[a, _p(1), b]])
    # a view inside a long one is caught even when a third range starts in between
    c, d, e = (torch.nn.Parameter(base[0:10]), torch.nn.Parameter(base[2:3]), torch.nn.Parameter(base[5:6]))
    with pytest.raises(ValueError, match="share memory"):
        ztriton.flatten_groups([[c], [e, d]])


def test_disjoint_views_of_one_tensor_are_fine():
    """Params that are separate views of one buffer (e.g. already flattened once) flatten again."""
    base = bits_tensor((10,), torch.float32, 5)
    a, b = torch.nn.Parameter(base[0:4].view(2, 2)), torch.nn.Parameter(base[4:10])
    (fg,) = ztriton.flatten_groups([[a, b]])
    assert torch.equal(bits(fg.flat), bits(base)) and a.shape == (2, 2)
    (again,) = ztriton.flatten_groups([[a, b]])  # a second flatten of the same params
    assert torch.equal(bits(again.flat), bits(base)) and a.data_ptr() == again.flat.data_ptr()


def test_frozen_param_may_share_memory():
    base = torch.ones(10)
    a, frozen = torch.nn.Parameter(base[0:6]), torch.nn.Parameter(base[4:10], requires_grad=False)
    (fg,) = ztriton.flatten_groups([[a, frozen]])
    assert fg.flat.numel() == 6 and frozen.data_ptr() == base.data_ptr() + 16


def test_empty_groups_give_empty_flat_buffers():
    """Groups with nothing to optimise keep their place in the result, with an empty buffer and tier None."""
    frozen = _p(3, requires_grad=False)
    ptr = frozen.data_ptr()
    result = ztriton.flatten_groups([[], [frozen, _p(0)], {"params": [_p(2)]}, {"params": []}])
    assert [fg.tier for fg in result] == [None, None, Tier.DEVICE, None]
    assert [fg.flat.numel() for fg in result] == [0, 0, 2, 0]
    assert result[1].flat.dtype == torch.float32 and result[1].params == ()
    assert result[1].partition(0).numel() == 0 and frozen.data_ptr() == ptr


@pytest.mark.parametrize("groups, error, pattern", [
    ([_p(3), _p(2)], TypeError, r"param_groups\[0\] is a tensor, not a group.*\[list\(params\)\]"),
    (_p(3), TypeError, r"param_groups must be a list of groups"),
    ({"params": [_p(3)]}, TypeError, r"param_groups must be a list of groups"),
    ([{"lr": 1.0}], TypeError, r"param_groups\[0\] is a dict without 'params'"),
    ([[_p(3), "x"]], TypeError, r"param_groups\[0\] params\[1\] is a str, not a tensor"),
    ([{"params": None}], TypeError, r"param_groups\[0\]\['params'\] must be a list of tensors.*got NoneType"),
    ([{"params": 3}], TypeError, r"param_groups\[0\]\['params'\] must be a list of tensors.*got int"),
    ([{"params": "w"}], TypeError, r"param_groups\[0\]\['params'\] must be a list of tensors.*got str"),
    ([{"params": {_p(3)}}], TypeError, r"param_groups\[0\]\['params'\] must be a list of tensors.*got set"),
    ([{"params": {"w": _p(3)}}], TypeError, r"param_groups\[0\]\['params'\] must be a list of tensors.*got dict"),
    ([[_p(3)], None], TypeError, r"param_groups\[1\] must be a list of tensors.*got NoneType"),
    ([[_p(3)], 7], TypeError, r"param_groups\[1\] must be a list of tensors.*got int"),
    ("groups", TypeError, r"param_groups must be a list of groups.*got str"),
    ({_p(3)}, TypeError, r"param_groups must be a list of groups.*got set"),
])
def test_bad_groups_rejected(groups, error, pattern):
    """A group or its params of the wrong kind: refused naming it, before any group moves (the first
    group, valid, keeps its memory)."""
    first = [g for g in groups if isinstance(g, list) and g and isinstance(g[0], torch.Tensor)] \
        if isinstance(groups, list) else []
    before = [(p, p.data_ptr()) for g in first for p in g if isinstance(p, torch.Tensor)]
    with pytest.raises(error, match=pattern):
        ztriton.flatten_groups(groups)
    assert all(p.data_ptr() == ptr for p, ptr in before)


def test_single_tensor_params_entry_is_one_param():
    p = _p(3)
    (fg,) = ztriton.flatten_groups([{"params": p}])
    assert fg.params == (p,) and fg.flat.numel() == 4


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(tier="gpu"), r"tier must be one of \['device', 'distributed', 'evict', 'host'\]"),
    (dict(tier="distributed"), r"tier='distributed' needs a world of more than one rank"),
    (dict(headroom_bytes=-1), r"headroom_bytes must be an int >= 0"),
    (dict(chunk_bytes=1000), r"chunk_bytes=1000 is below the minimum"),
    (dict(group=object()), r"group= was given but torch.distributed is not initialised"),
])
def test_bad_options_rejected(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ztriton.flatten_groups([[_p(3)]], **kwargs)


def test_distributed_needs_a_world(fake_world):
    with fake_world(1, 0):
        with pytest.raises(ValueError, match="needs a world of more than one rank"):
            ztriton.flatten_groups([[_p(3)]], tier=Tier.DISTRIBUTED)


# ------------------------------------------------------------------------------------------ gloo (W = 2)


def _gloo_model():
    """The fixed model's shapes, frozen indices and group sizes for a DeepSpeed that can build it: one that keeps
    trainable empty params in its groups gets the model without its empty param."""
    if not keeps_empty_params_in_groups():
        return FIXED_SHAPES, FIXED_FROZEN, FIXED_SIZES
    empty = FIXED_SHAPES.index((0,))
    return (FIXED_SHAPES[:empty] + FIXED_SHAPES[empty + 1:], tuple(i - (i > empty) for i in FIXED_FROZEN),
            [FIXED_SIZES[0] - 1, *FIXED_SIZES[1:]])


def _flatten_on_gloo_rank(rank, world_size, combos):
    """One gloo rank: for each (stage, round_robin, alignment, dtype), DeepSpeed's flat groups from
    deepspeed.initialize, then the device and distributed tiers on fresh models; plus the distributed
    tier's two failure paths. Asserts here; returns how many checks ran."""
    checks = 0
    shapes, frozen, sizes = _gloo_model()
    for stage, round_robin, alignment, dtype in combos:
        factory = functools.partial(BitsModule, shapes, 3, dtype, frozen)
        reference = zero12_reference(factory, world_size, rank, stage, round_robin, alignment, dtype,
                                     param_groups_fn=functools.partial(groups_of, sizes=sizes))
        flats = {}
        for tier, free in [(Tier.DEVICE, None), (Tier.DISTRIBUTED, 1 << 30), (Tier.DISTRIBUTED, 0)]:
            with _memory(free):
                model = factory()
                groups = groups_of(model, sizes)
                before = _snapshot(groups)
                result = ztriton.flatten_groups(groups, round_robin=round_robin, parameter_alignment=alignment,
                                                tier=tier, headroom_bytes=0)
            _check_against_reference(result, reference, before, world_size, rank, tier)
            flats[tier, free] = [fg.flat for fg in result]
            checks += 1
        for a, b in zip(flats[Tier.DEVICE, None], flats[Tier.DISTRIBUTED, 0]):
            assert torch.equal(bits(a), bits(b)), "distributed and device tiers differ"
    # Failure paths: the flat buffer fails after the params were freed (recovery from the partitions),
    # and one rank alone fails its partition (both ranks must fall through together).
    dtype, alignment = torch.bfloat16, has_parameter_alignment()
    factory = functools.partial(BitsModule, shapes, 3, dtype, frozen)
    reference = zero12_reference(factory, world_size, rank, 2, True, alignment, dtype,
                                 param_groups_fn=functools.partial(groups_of, sizes=sizes))
    for fail in [lambda what, n: what == "flat buffer" and n <= 1,
                 lambda what, n: what == "partition buffer" and rank == 1]:
        with _memory(0), _failing_allocations(fail):
            model = factory()
            groups = groups_of(model, sizes)
            before = _snapshot(groups)
            result = ztriton.flatten_groups(groups, round_robin=True, parameter_alignment=alignment,
                                            tier="distributed", headroom_bytes=0)
        assert result[0].tier is Tier.EVICT
        _check_against_reference(result[:1], reference[:1], before[:1], world_size, rank, Tier.EVICT)
        checks += 1
    return checks


def test_flatten_gloo(gloo_world):
    """W = 2 on real gloo ranks, across stage x round robin x alignment x dtype: the distributed tier's
    whole buffer (gathered for real) equals the device tier's and DeepSpeed's."""
    alignments = (False, True) if has_parameter_alignment() else (False,)
    combos = [(stage, rr, align, dtype) for stage in (1, 2) for rr in (False, True) for align in alignments
              for dtype in DTYPES]
    assert gloo_world(_flatten_on_gloo_rank, 2, combos, timeout=300) == [3 * len(combos) + 2] * 2


# ------------------------------------------------------------------------------------------ on a GPU


def _gpu_params(dtype=torch.bfloat16):
    """CUDA params: plain, transposed (strided: evicted through a staging chunk, never a full device copy),
    0-d, odd sizes; a frozen one."""
    shapes = [(256, 48), (33,), (), (1000,), (64, 130)]
    params = [torch.nn.Parameter(bits_tensor(s, dtype, 17, i).cuda()) for i, s in enumerate(shapes)]
    params[3] = torch.nn.Parameter(bits_tensor((40, 25), dtype, 17, 3).cuda().t())  # strided
    params.append(torch.nn.Parameter(bits_tensor((7,), dtype, 17, 9).cuda(), requires_grad=False))
    return params


@pytest.mark.gpu
@pytest.mark.parametrize("tier", TIERS, ids=[t.value for t in TIERS])
def test_tiers_on_gpu(tier):
    """Each tier on CUDA params (W = 4 on the fake process group): bytes, aliasing, pinned host copies."""
    params = _gpu_params()
    values = [p.detach().cpu() for p in params]
    layout = zero12_group_layout([v.numel() for v in values], 4, element_size=2,
                                 trainable=[p.requires_grad for p in params], parameter_alignment=True)
    expected = _expected_flat(values, layout, torch.bfloat16)
    from ztriton import staging

    pinned = []
    real_spill = staging.spill

    def spill(*args, **kwargs):
        buf = real_spill(*args, **kwargs)
        pinned.append(buf.is_pinned())
        return buf

    budget = layout.total_numel  # half the group's bytes
    with _world(4, 1), _memory(budget), mock.patch.object(staging, "spill", spill):
        (fg,) = ztriton.flatten_groups([params], tier=tier, parameter_alignment=True, headroom_bytes=0)
    assert fg.tier is tier and fg.flat.is_cuda
    w0, w1 = layout.rank_window(1) if tier is Tier.DISTRIBUTED else (0, layout.total_numel)
    assert torch.equal(bits(fg.flat.cpu())[w0:w1], bits(expected)[w0:w1])
    for k, j in enumerate(fg.order):
        p = params[j]
        assert p.is_cuda and p.shape == values[j].shape
        assert p.data_ptr() == fg.flat.data_ptr() + fg.offsets[k] * 2
    assert params[-1].data_ptr() != 0 and torch.equal(bits(params[-1].cpu()), bits(values[-1]))
    if tier in (Tier.EVICT, Tier.HOST):  # host copies live in the pinned spill: one DMA each way
        assert pinned and all(pinned)


@pytest.mark.gpu
@pytest.mark.parametrize("tier, world_size, expected", [
    (Tier.DEVICE, 1, 1.0),         # the flat buffer beside the params
    (Tier.DISTRIBUTED, 4, 0.25),   # params freed after the window pack: only the window stays extra
    (Tier.EVICT, 1, 0.5),          # half of the params went to host memory first
    (Tier.HOST, 1, 0.0),           # the params go before the flat buffer comes
])
def test_peak_memory_per_tier_gpu(tier, world_size, expected):
    """Peak device memory above the params, as a fraction of the group: what each tier promises."""
    shapes = [(1024, 1024)] * 8  # 16 MiB of bf16
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(torch.bfloat16)) for s in shapes]
    group_bytes = sum(p.numel() for p in params) * 2
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with _world(world_size, 0, use_world=world_size > 1), _memory(group_bytes // 2):
        (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / group_bytes
    assert fg.tier is tier
    assert expected - 0.01 <= peak <= expected + 0.05, f"peak {peak:.3f} x group, expected {expected}"
    assert torch.cuda.memory_allocated() - base <= 0.01 * group_bytes  # afterwards: the buffer replaced the params


def test_distributed_host_copy_failure_keeps_the_params_on_the_device():
    """No room beside the params and no host copy: the params are never moved off the device (the branch
    makes the host copy first); with every host copy and flat buffer failing, every tier fails with the
    params untouched where they were."""
    fail = lambda what, n: what in ("flat buffer", "host copy of the params", "evicted params")  # noqa: E731
    with _world(2, 0), _memory(0), _failing_allocations(fail):
        model = _fixed_model()()
        groups = groups_of(model, FIXED_SIZES)
        before = _snapshot(groups)
        with pytest.raises(torch.OutOfMemoryError, match=r"every tier ran out of memory.*all are on cpu as before"):
            ztriton.flatten_groups(groups, round_robin=True, parameter_alignment=True, tier="distributed",
                                   headroom_bytes=0)
    for snap in before:
        for param, values, ptr, shape in snap:
            assert torch.equal(bits(param), values) and param.data_ptr() == ptr and param.shape == shape


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("injected"), RuntimeError("NCCL error (injected)")])
def test_distributed_gather_failure_keeps_values(error):
    """Issue 16's minimal case: fake W = 2, rank 0, the probe reporting 0 free (the branch that moves the
    params off the device), and the all-gather raising: the params come back intact (evict tier)."""
    reference = _fixed_reference(2)
    with fake_world(2, 0), _memory(0), mock.patch.object(F, "all_gather_bytes", side_effect=error):
        model = _fixed_model()()
        groups = groups_of(model, FIXED_SIZES)
        before = _snapshot(groups)
        result = ztriton.flatten_groups(groups, round_robin=True, parameter_alignment=True, tier="distributed",
                                        headroom_bytes=0)
    assert [fg.tier for fg in result] == [Tier.EVICT, Tier.EVICT]
    _check_against_reference(result, reference, before, 2, 0, Tier.EVICT, whole=True)


def test_minimal_gather_failure_case():
    """The issue's exact repro: P(7), P(2, 3), all-gather raising; values intact, no shape (0,) left."""
    a, b = _p(7), _p(2, 3)
    va, vb = a.detach().clone(), b.detach().clone()
    with fake_world(2, 0), _memory(0), mock.patch.object(F, "all_gather_bytes", side_effect=RuntimeError("boom")):
        (fg,) = ztriton.flatten_groups([[a, b]], tier="distributed", headroom_bytes=0)
    assert fg.tier is Tier.EVICT and a.shape == (7,) and b.shape == (2, 3)
    assert torch.equal(bits(a), bits(va)) and torch.equal(bits(b), bits(vb))


def test_interleaved_disjoint_views_flatten_like_deepspeed():
    """fused[:, :4] and fused[:, 4:] as params: elements interleaved in memory but disjoint. DeepSpeed
    flattens them (its own flatten, ztriton.testing.deepspeed_flatten); so do we, bit for bit."""
    from ztriton.testing import deepspeed_flatten

    fused = bits_tensor((6, 10), torch.bfloat16, 11)
    params = [torch.nn.Parameter(fused[:, :4]), torch.nn.Parameter(fused[:, 4:]), torch.nn.Parameter(fused.t()[2:5, 1:3])]
    for p in params[2:]:
        p.requires_grad_(False)  # overlaps both: frozen, so it does not take part
    views = [params[0].detach(), params[1].detach()]
    (fg,) = ztriton.flatten_groups([params])
    expected = deepspeed_flatten(views, fg.paddings, 2)  # DeepSpeed's flatten of the very same views
    assert torch.equal(bits(fg.flat), bits(expected))


def test_interleaved_overlapping_views_rejected():
    fused = torch.zeros(6, 10)
    a, b = torch.nn.Parameter(fused[:, :5]), torch.nn.Parameter(fused[:, 4:])
    with pytest.raises(ValueError, match=r"params\[0\] and param_groups\[0\] params\[1\] share memory"):
        ztriton.flatten_groups([[a, b]])
    c = torch.nn.Parameter(fused.t()[3:5])  # transposed: rows 3-4 of fused.t() are columns 3-4 of fused
    with pytest.raises(ValueError, match="share memory"):
        ztriton.flatten_groups([[fused_view] for fused_view in (torch.nn.Parameter(fused[:, :4]), c)])
    assert ztriton.flatten_groups([[torch.nn.Parameter(fused[:, :3])], [c]])[1].flat.numel() >= 12


def test_a_late_group_refused_by_the_kernels_moves_no_earlier_group():
    """Group 1 holds a param the kernels refuse (10-D strided): refused before group 0 is re-pointed."""
    p0 = _p(5)
    ptr = p0.data_ptr()
    odd = torch.nn.Parameter(torch.zeros([2] * 10).permute(*reversed(range(10))))  # 10 unmergeable dims
    with pytest.raises((TypeError, ValueError), match=r"param_groups\[1\] params\[0\]"):
        ztriton.flatten_groups([[p0], [odd]])
    assert p0.data_ptr() == ptr


def test_flattening_twice_builds_a_new_buffer_and_frees_the_old():
    """Repeats are well defined: the second call flattens the params (views of the first buffer) into a
    new buffer; once the first result is dropped, nothing references the old buffer."""
    import weakref

    params = [_p(3, 2), _p(5)]
    values = [bits(p).clone() for p in params]
    first = ztriton.flatten_groups([params])
    old = weakref.ref(first[0].flat)
    second = ztriton.flatten_groups([params])
    del first
    assert old() is None
    assert second[0].flat.data_ptr() == params[0].data_ptr()
    assert all(torch.equal(bits(p), v) for p, v in zip(params, values))


def _different_values_on_gloo_rank(rank, world_size):
    """Each rank holds its own values: the distributed tier steps aside; every rank keeps its own."""
    params = [torch.nn.Parameter(bits_tensor((7,), torch.float32, 100 + rank, i)) for i in range(3)]
    own = [bits(p).clone() for p in params]
    with _memory(1 << 30):
        (fg,) = ztriton.flatten_groups([params], tier="distributed", headroom_bytes=0)
    assert fg.tier is Tier.EVICT
    assert all(torch.equal(bits(p), v) for p, v in zip(params, own))
    same = [torch.nn.Parameter(bits_tensor((7,), torch.float32, 5, i)) for i in range(3)]
    with _memory(1 << 30):
        (fg,) = ztriton.flatten_groups([same], tier="distributed", headroom_bytes=0)
    return fg.tier.value


def test_ranks_with_different_values_keep_their_own(gloo_world):
    assert gloo_world(_different_values_on_gloo_rank, 2, timeout=60) == ["distributed"] * 2
