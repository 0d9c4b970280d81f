"""ztriton.layout: properties of the arithmetic, argument checks, and conformance with DeepSpeed itself.

The conformance tests drive DeepSpeed 0.19.8 (``zero.Init`` for ZeRO-3, ``deepspeed.initialize`` for
ZeRO-1/2) on CPU and compare what it builds with what the layout predicts: sizes and offsets exactly,
and values byte for byte (integer views), from parameters that hold arbitrary bit patterns. On the
fake process group each process plays one rank, which is what layouts depend on; the gloo tests add
the one thing the fake group cannot show: that values come from rank 0.
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_reference import (BitsModule, bits, bits_tensor, groups_of, has_parameter_alignment, keeps_empty_params_in_groups,
                          zero3_reference, zero12_reference)
from ztriton.layout import (NCCL_START_ALIGNMENT_FACTOR, FlatGroupLayout, param_alignment, round_robin_order,
                            zero3_slice, zero12_group_layout)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PRIMES = [2, 3, 5, 7, 11, 13, 17, 31, 37, 61, 97, 101, 127, 251, 257, 509, 1021]

# Arithmetic only: sizes far past 2**31 elements are as cheap as small ones.
huge_numels = st.integers(0, 2**45)
world_sizes = st.integers(1, 64)

ds_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------------------- unit cases


def test_zero3_slice_example():
    """7 elements over 3 ranks: padded to 9, 3 each; rank 2 holds one real element and two pads."""
    s = zero3_slice(7, 3)
    assert (s.padding, s.aligned_numel, s.partition_numel) == (2, 9, 3)
    assert [s.rank_start(r) for r in range(3)] == [0, 3, 6]
    assert [s.valid_numel(r) for r in range(3)] == [3, 3, 1]


def test_zero3_slice_smaller_than_world():
    """1 element over 8 ranks: every rank stores one element, only rank 0 a real one."""
    s = zero3_slice(1, 8)
    assert (s.padding, s.aligned_numel, s.partition_numel) == (7, 8, 1)
    assert [s.valid_numel(r) for r in range(8)] == [1] + [0] * 7


def test_zero3_slice_empty():
    s = zero3_slice(0, 5)
    assert (s.padding, s.aligned_numel, s.partition_numel) == (0, 0, 0)
    assert [s.valid_numel(r) for r in range(5)] == [0] * 5


def test_round_robin_order_example():
    assert round_robin_order(7, 3) == [0, 3, 6, 1, 4, 2, 5]
    assert round_robin_order(2, 8) == [0, 1]
    assert round_robin_order(0, 4) == []


@pytest.mark.parametrize("element_size, expected", [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1), (3, 16), (6, 8)])
def test_param_alignment(element_size, expected):
    assert param_alignment(element_size, True) == expected
    assert param_alignment(element_size, False) == 1


def test_zero12_example_bf16_aligned_round_robin():
    """bf16, W=2: trainable non-empty params [5, 7, 1, 9] (a frozen and an empty one left out)."""
    layout = zero12_group_layout([5, 3, 0, 7, 1, 9], 2, element_size=2,
                                 trainable=[True, False, True, True, True, True],
                                 round_robin=True, parameter_alignment=True)
    assert layout.order == (0, 4, 3, 5)  # members [0, 3, 4, 5] -> even positions, then odd
    assert layout.numels == (5, 1, 7, 9)
    assert layout.offsets == (0, 8, 16, 24)
    assert layout.paddings == (3, 7, 1, 0)
    assert (layout.packed_numel, layout.tail_padding, layout.total_numel) == (33, 3, 36)
    assert [layout.rank_window(r) for r in range(2)] == [(0, 18), (18, 36)]


def test_zero12_empty_group():
    layout = zero12_group_layout([0, 4], 3, element_size=4, trainable=[True, False])
    assert (layout.order, layout.total_numel, layout.partition_numel) == ((), 0, 0)
    assert [layout.rank_window(r) for r in range(3)] == [(0, 0)] * 3


# ------------------------------------------------------------------------------------------- properties


@given(numel=st.one_of(huge_numels, st.integers(0, 20)), world_size=world_sizes)
def test_zero3_slice_properties(numel, world_size):
    s = zero3_slice(numel, world_size)
    assert 0 <= s.padding < world_size
    assert s.aligned_numel == numel + s.padding
    assert s.aligned_numel % world_size == 0  # the smallest multiple of W that holds numel:
    assert s.aligned_numel < numel + world_size
    assert s.partition_numel * world_size == s.aligned_numel
    assert [s.rank_start(r) for r in range(world_size)] == [r * s.partition_numel for r in range(world_size)]
    # Real elements fill the ranks in order: full partitions, at most one partial one, then padding only.
    valid = [s.valid_numel(r) for r in range(world_size)]
    assert sum(valid) == numel
    assert all(0 <= v <= s.partition_numel for v in valid)
    not_full = [r for r, v in enumerate(valid) if v < s.partition_numel]
    assert all(valid[r] == 0 for r in not_full[1:])


@given(count=st.integers(0, 300), world_size=world_sizes)
def test_round_robin_order_is_a_permutation(count, world_size):
    order = round_robin_order(count, world_size)
    assert sorted(order) == list(range(count))
    # residues mod W appear in increasing blocks, each block in increasing order
    keys = [(i % world_size, i) for i in order]
    assert keys == sorted(keys)


@st.composite
def flat_groups(draw, max_params=12, numels=st.integers(0, 2**40)):
    """Arguments of zero12_group_layout: numels, world_size, element_size, trainable, flags."""
    n = draw(st.integers(0, max_params))
    return dict(
        numels=draw(st.lists(numels, min_size=n, max_size=n)),
        world_size=draw(world_sizes),
        element_size=draw(st.sampled_from([1, 2, 4, 8])),
        trainable=draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n))),
        round_robin=draw(st.booleans()),
        parameter_alignment=draw(st.booleans()),
    )


def _check_flat_layout(layout: FlatGroupLayout, args: dict) -> None:
    numels, trainable, w = args["numels"], args["trainable"], args["world_size"]
    members = [i for i, n in enumerate(numels) if n > 0 and (trainable is None or trainable[i])]
    assert sorted(layout.order) == members
    if not args["round_robin"]:
        assert list(layout.order) == members
    else:
        assert list(layout.order) == [members[k] for k in round_robin_order(len(members), w)]
    assert layout.numels == tuple(numels[i] for i in layout.order)
    palign = param_alignment(args["element_size"], args["parameter_alignment"])
    expected_offset = 0
    for k, (offset, numel, pad) in enumerate(zip(layout.offsets, layout.numels, layout.paddings)):
        assert offset == expected_offset  # monotone, params and pads end to end
        assert 0 <= pad < palign
        if args["parameter_alignment"]:
            assert offset * args["element_size"] % 16 == 0  # every param starts 16-byte aligned
        else:
            assert pad == 0
        expected_offset = offset + numel + pad
    if layout.paddings:
        assert layout.paddings[-1] == 0
    assert layout.packed_numel == expected_offset
    alignment = NCCL_START_ALIGNMENT_FACTOR * w
    assert 0 <= layout.tail_padding < alignment
    assert layout.total_numel % alignment == 0
    assert layout.partition_numel * w == layout.total_numel
    windows = [layout.rank_window(r) for r in range(w)]
    assert windows[0][0] == 0 and windows[-1][1] == layout.total_numel
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))  # the windows tile the buffer


@given(args=flat_groups())
def test_zero12_layout_properties_huge(args):
    _check_flat_layout(zero12_group_layout(**args), args)


@given(args=flat_groups(max_params=30, numels=st.integers(0, 40)))
def test_zero12_layout_properties_small(args):
    _check_flat_layout(zero12_group_layout(**args), args)


# ------------------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("numel, world_size, name", [
    (-1, 2, "numel"), (2.0, 2, "numel"), ("3", 2, "numel"), (None, 2, "numel"), (True, 2, "numel"),
    (3, 0, "world_size"), (3, -2, "world_size"), (3, 2.0, "world_size"), (3, True, "world_size"),
    (3, None, "world_size"),
])
def test_zero3_slice_rejects(numel, world_size, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        zero3_slice(numel, world_size)


@pytest.mark.parametrize("rank", [-1, 3, 4, 1.0, "0", None, True])
def test_rank_outside_world_rejected(rank):
    s = zero3_slice(10, 3)
    layout = zero12_group_layout([10], 3, element_size=2)
    for method in (s.rank_start, s.valid_numel, layout.rank_window):
        with pytest.raises(ValueError, match=r"^rank\b"):
            method(rank)


@pytest.mark.parametrize("kwargs, name", [
    (dict(numels=[3, -1], world_size=2, element_size=2), r"numels\[1\]"),
    (dict(numels=[3, 1.5], world_size=2, element_size=2), r"numels\[1\]"),
    (dict(numels=[3], world_size=0, element_size=2), "world_size"),
    (dict(numels=[3], world_size=2.0, element_size=2), "world_size"),
    (dict(numels=[3], world_size=2, element_size=0), "element_size"),
    (dict(numels=[3], world_size=2, element_size=2.0), "element_size"),
    (dict(numels=[3], world_size=2, element_size=True), "element_size"),
    (dict(numels=[3, 4], world_size=2, element_size=2, trainable=[True]), "trainable"),
])
def test_zero12_group_layout_rejects(kwargs, name):
    numels, world_size = kwargs.pop("numels"), kwargs.pop("world_size")
    with pytest.raises(ValueError, match=rf"^{name}"):
        zero12_group_layout(numels, world_size, **kwargs)


@pytest.mark.parametrize("count, world_size, name", [(-1, 2, "count"), (2.0, 2, "count"), (3, 0, "world_size")])
def test_round_robin_order_rejects(count, world_size, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        round_robin_order(count, world_size)


@pytest.mark.parametrize("element_size", [0, -4, 2.0, None])
def test_param_alignment_rejects(element_size):
    with pytest.raises(ValueError, match=r"^element_size\b"):
        param_alignment(element_size, True)


# ------------------------------------------------------------------------------- the test helpers


def test_bits_module_holds_bits_tensors(fake_world):
    """The reference models hold exactly bits_tensor(...) values, and rank_salt makes ranks differ."""
    shapes = [(3, 2), (5,), ()]
    with fake_world(2, 1):
        plain = BitsModule(shapes, seed=4, dtype=torch.bfloat16)
        salted = BitsModule(shapes, seed=4, dtype=torch.bfloat16, rank_salt=True)
    for i, shape in enumerate(shapes):
        expected = bits_tensor(shape, torch.bfloat16, 4, i)
        assert getattr(plain, f"p{i}").shape == shape
        assert torch.equal(bits(getattr(plain, f"p{i}")), bits(expected))
    assert not torch.equal(bits(salted.p0), bits(plain.p0))


# --------------------------------------------------------------------- ZeRO-3 conformance (zero.Init)


@st.composite
def shapes_of(draw, numel):
    """A 1-D or 2-D shape with ``numel`` elements.

    Never 0-d: DeepSpeed 0.19.8 fails on 0-d params of elements wider than a byte, in ``zero.Init``
    and in ``DeepSpeedEngine._broadcast_model`` alike: both broadcast ``param.data.view(torch.uint8)``,
    which torch refuses for a 0-d tensor.
    """
    if not draw(st.booleans()):
        return (numel,)
    rows = draw(st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0] or [1, 3]))
    return (rows, numel // rows)


@st.composite
def zero3_shapes(draw, world_size):
    """Parameter shapes whose numels mix 1, sizes below W, primes, and anything up to a few hundred."""
    numel = st.one_of(st.just(1), st.integers(0, max(world_size - 1, 0)), st.sampled_from(PRIMES),
                      st.integers(0, 400))
    numels = draw(st.lists(numel, min_size=1, max_size=5))
    return [draw(shapes_of(n)) for n in numels]


def _check_zero3(params, shapes, world_size, rank, dtype, source_seed):
    """What DeepSpeed built on ``rank`` against the layout and the rank-0 values (``source_seed``)."""
    assert [p.name for p in params] == [f"p{i}" for i in range(len(shapes))]
    for i, (param, shape) in enumerate(zip(params, shapes)):
        full = bits(bits_tensor(shape, dtype, source_seed, i))
        s = zero3_slice(full.numel(), world_size)
        assert param.ds_shape == tuple(shape)
        assert param.ds_numel == s.numel
        assert param.ds_numel_aligned == s.aligned_numel
        assert param.partition_numel == s.partition_numel
        assert param.partition.numel() == s.partition_numel
        assert param.partition.dtype == dtype
        start, valid = s.rank_start(rank), s.valid_numel(rank)
        assert torch.equal(bits(param.partition)[:valid], full[start:start + valid]), (param.name, rank)
        assert param.data_numel == 0
        assert param.status == "NOT_AVAILABLE"


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
@settings(ds_settings, max_examples=40)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**20))
def test_zero3_matches_zero_init(world_size, data, dtype, seed):
    """Every rank of the world, one fake-process-group rank at a time, under ``with zero.Init()``."""
    shapes = data.draw(zero3_shapes(world_size), label="shapes")
    factory = functools.partial(BitsModule, shapes, seed)
    for rank in range(world_size):
        params = zero3_reference(factory, world_size, rank, dtype)
        _check_zero3(params, shapes, world_size, rank, dtype, seed)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero3_matches_zero_init_of_existing_module(world_size, dtype):
    """``zero.Init(module=...)``: the module exists first, in its own dtype."""
    shapes = [(1,), (7, 3), (0,), (2,), (5, 5)]
    factory = functools.partial(BitsModule, shapes, 11, dtype)
    for rank in range(world_size):
        params = zero3_reference(factory, world_size, rank, dtype, wrap_existing=True)
        _check_zero3(params, shapes, world_size, rank, dtype, 11)


def _zero3_on_rank(rank, world_size, shapes, seed, dtype):
    """One gloo rank: every rank starts from its own values (rank_salt); zero.Init must keep rank 0's."""
    return zero3_reference(functools.partial(BitsModule, shapes, seed, rank_salt=True), world_size, rank, dtype)


def test_zero3_values_come_from_rank0_gloo(gloo_world):
    world_size, seed, dtype = 3, 21, torch.bfloat16
    shapes = [(1,), (2,), (7,), (4, 5), (0,), (3, 3)]
    for rank, params in enumerate(gloo_world(_zero3_on_rank, world_size, shapes, seed, dtype)):
        _check_zero3(params, shapes, world_size, rank, dtype, seed)


# ----------------------------------------------------------- ZeRO-1/2 conformance (deepspeed.initialize)


@st.composite
def zero12_models(draw):
    """Shapes, frozen indices and group sizes; every group has at least one trainable non-empty param."""
    numel = st.one_of(st.just(0), st.just(1), st.sampled_from(PRIMES[:10]), st.integers(0, 60))
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    numels, frozen = [], []
    for size in sizes:
        group = draw(st.lists(numel, min_size=size, max_size=size))
        flags = draw(st.lists(st.booleans(), min_size=size, max_size=size))
        keep = draw(st.integers(0, size - 1))  # DeepSpeed fails on a group with nothing to optimize
        group[keep], flags[keep] = max(group[keep], 1), False
        frozen += [len(numels) + k for k in range(size) if flags[k]]
        numels += group
    shapes = [draw(shapes_of(n)) for n in numels]
    return shapes, tuple(frozen), sizes


def _check_zero12(groups, shapes, frozen, sizes, world_size, dtype, round_robin, alignment, source_seed):
    """DeepSpeed's flat groups against zero12_group_layout and the params' (rank-0) values."""
    assert len(groups) == len(sizes)
    first = 0
    for group, size in zip(groups, sizes):
        indices = range(first, first + size)
        values = [bits(bits_tensor(shapes[i], dtype, source_seed, i)) for i in indices]
        trainable = [i not in frozen for i in indices]
        assert group.numels == tuple(v.numel() for v in values)
        assert group.trainable == tuple(trainable)
        layout = zero12_group_layout(group.numels, world_size, element_size=_element_size(dtype), trainable=trainable,
                                     round_robin=round_robin, parameter_alignment=alignment)
        assert group.order == layout.order
        members = sorted(layout.order)  # DeepSpeed numbers the optimized params in group order
        assert group.indices == tuple(layout.order.index(m) for m in members)
        assert group.offsets == layout.offsets
        assert group.paddings == layout.paddings
        assert group.flat.numel() == layout.total_numel
        assert group.flat.dtype == dtype
        assert group.partition_numel == layout.partition_numel
        assert group.windows == tuple(layout.rank_window(r) for r in range(world_size))
        position = dict(zip(layout.order, layout.offsets))
        assert group.aliases == tuple(position.get(i) for i in range(size))
        expected = torch.zeros(layout.total_numel, dtype=values[0].dtype)
        for index, offset, numel in zip(layout.order, layout.offsets, layout.numels):
            expected[offset:offset + numel] = values[index]
        assert torch.equal(bits(group.flat), expected)
        first += size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alignment", [False, True], ids=["noalign", "align"])
@pytest.mark.parametrize("round_robin", [False, True], ids=["seq", "rr"])
@pytest.mark.parametrize("stage", [1, 2])
@settings(ds_settings, max_examples=12)
@given(model=zero12_models(), world_size=st.sampled_from([1, 2, 3, 4, 8]), data=st.data(),
       seed=st.integers(0, 2**20))
def test_zero12_matches_deepspeed(stage, round_robin, alignment, dtype, model, world_size, data, seed):
    """One drawn rank of the world (the flat buffer is the same on every rank; the windows say which is whose)."""
    shapes, frozen, sizes = model
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    groups = zero12_reference(functools.partial(BitsModule, shapes, seed, dtype, frozen),
                              world_size, rank, stage, round_robin, alignment, dtype,
                              param_groups_fn=functools.partial(groups_of, sizes=sizes))
    _check_zero12(groups, shapes, frozen, sizes, world_size, dtype, round_robin, alignment, seed)


def _zero12_on_rank(rank, world_size, shapes, frozen, sizes, seed, dtype, stage, round_robin, alignment):
    """One gloo rank: ranks start from different values; the engine's broadcast must leave rank 0's."""
    factory = functools.partial(BitsModule, shapes, seed, dtype, frozen, rank_salt=True)
    return zero12_reference(factory, world_size, rank, stage, round_robin, alignment, dtype,
                            param_groups_fn=functools.partial(groups_of, sizes=sizes))


def test_zero12_matches_deepspeed_gloo(gloo_world):
    # A DeepSpeed without parameter_alignment compares unaligned; one that keeps trainable empty params in its
    # groups cannot build a group with one (ds_reference.keeps_empty_params_in_groups), so it gets none.
    world_size, seed, dtype, stage, round_robin, alignment = 2, 5, torch.bfloat16, 2, True, has_parameter_alignment()
    shapes = [(5,), (3,), (0,), (7, 2), (1,), (2,), (9,), (4, 3), (11,)]
    frozen, sizes = (1, 7), [4, 5]
    if keeps_empty_params_in_groups():
        shapes, frozen, sizes = shapes[:2] + shapes[3:], (1, 6), [4, 4]
    results = gloo_world(_zero12_on_rank, world_size, shapes, frozen, sizes, seed, dtype, stage, round_robin,
                         alignment)
    for groups in results:
        _check_zero12(groups, shapes, frozen, sizes, world_size, dtype, round_robin, alignment, seed)


@pytest.mark.parametrize("bad, pattern", [
    (dict(numels=None), r"^numels must be a list or tuple, got NoneType"),
    (dict(numels=5), r"^numels must be a list or tuple, got int"),
    (dict(numels="34"), r"^numels must be a list or tuple, got str"),
    (dict(trainable="ab"), r"^trainable must be a list or tuple, got str"),
    (dict(trainable=[True, "x"]), r"^trainable\[1\] must be a bool, got 'x'"),
    (dict(round_robin="no"), r"^round_robin must be a bool, got 'no'"),
    (dict(parameter_alignment=None), r"^parameter_alignment must be a bool, got None"),
])
def test_group_layout_refuses_junk_naming_the_argument(bad, pattern):
    """A string or None is not read as a truthy flag or iterated: refused, named."""
    kwargs = dict(numels=[3, 4], world_size=2, element_size=2)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=pattern):
        zero12_group_layout(**kwargs)
    assert zero12_group_layout([3, 4], 2, element_size=2, trainable=[1, 0], round_robin=0).order == (0,)
