"""Params whose strides are not a new tensor's: every entry point, against DeepSpeed's own code (issue 32).

torch calls a tensor contiguous whatever strides its size-1 dims carry (and whatever strides a tensor of at
most one element has): ``x[3::2][:1]`` is contiguous with stride 2, and viewing it as bytes raises. The
strategy below draws such tensors (1-element and size-1-dim ones with odd strides, empty ones), sliced,
expanded and transposed views, and deep ones the kernels refuse, all views of one storage laid end to end, so
that neighbouring params touch in memory (the kernels join such neighbours into one run). Each entry point
must give DeepSpeed's bytes (its own flatten, ``zero.Init``, ``defragment``; where ``zero.Init`` refuses a view,
its bytes of a copy holding the same values), or a TypeError/ValueError naming the param and the fix, with
every param unchanged.
"""
from __future__ import annotations

import contextlib
import math
import os
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ztriton
from ds_reference import bits, bits_tensor, deepspeed_defragment, zero3_reference
from worlds import fake_world
from ztriton import memory
from ztriton.flatten import tiers as F
from ztriton.memory import MemoryInfo
from ztriton.testing import deepspeed_flatten

def _examples(n: int) -> settings:
    return settings(max_examples=int(os.environ.get("ZT_ODD_EXAMPLES", n)), deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ODD = [0, 2, 3, 5, 7, 13]  # strides no new tensor has
DEEP = ((2,) * 9, tuple(3 ** k for k in range(8, -1, -1)))  # 9 dims that do not merge: more than the kernels take


def _canonical(shape):
    """The strides of a new tensor of ``shape``."""
    return torch.empty(shape).stride()


@st.composite
def views(draw, one_d: bool = False):
    """(kind, shape, strides) of a view; ``one_d``: 1-D ones only (defragment's partitions)."""
    kinds = ["one", "one", "empty", "slice", "expand", "plain"] + ([] if one_d else ["size1", "size1", "transpose"])
    kind = draw(st.sampled_from(kinds))
    ndim = 1 if one_d else draw(st.integers(1, 3))
    if kind == "one":
        shape = (1,) * ndim
        return kind, shape, tuple(draw(st.sampled_from(ODD + [1])) for _ in shape)
    if kind == "empty":
        shape = tuple(draw(st.sampled_from([0, 1, 3])) for _ in range(ndim - 1)) + (0,)
        return kind, shape, tuple(draw(st.sampled_from(ODD + [1])) for _ in shape)
    if kind == "size1":
        shape = [draw(st.integers(2, 4)) for _ in range(max(2, ndim))]
        shape[draw(st.integers(0, len(shape) - 1))] = 1
        strides = [draw(st.sampled_from(ODD)) if n == 1 else s for n, s in zip(shape, _canonical(shape))]
        return kind, tuple(shape), tuple(strides)
    if kind == "slice":
        step = draw(st.sampled_from([2, 3]))
        if ndim == 1:
            return kind, (draw(st.integers(1, 5)),), (step,)
        rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        return kind, (rows, cols), (cols * step + draw(st.integers(0, 3)), step)
    if kind == "expand":
        if ndim == 1:
            return kind, (draw(st.integers(2, 5)),), (0,)
        rows, cols = draw(st.integers(1, 4)), draw(st.integers(2, 4))
        return kind, (rows, cols), draw(st.sampled_from([(0, 1), (1, 0), (0, 0)]))
    if kind == "transpose":
        rows, cols = draw(st.integers(2, 4)), draw(st.integers(2, 4))
        return kind, (rows, cols), (1, rows)
    shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    return kind, shape, _canonical(shape)


def _extent(shape, strides) -> int:
    """Elements of storage a view spans."""
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


@st.composite
def layouts(draw, count: int, one_d: bool = False):
    """``count`` views and the gap (0 or more elements) before each in their shared storage; in some layouts
    (not ``one_d``) one of them is a deep view the kernels refuse."""
    specs = [draw(views(one_d)) for _ in range(count)]
    if not one_d and draw(st.integers(0, 3)) == 0:
        specs[draw(st.integers(0, count - 1))] = ("deep", *DEEP)
    gaps = [draw(st.integers(0, 2)) for _ in specs]
    return specs, gaps


def build(specs, gaps, dtype, seed):
    """The views, end to end (after their gaps) in one storage of arbitrary bits."""
    offsets, at = [], 0
    for (_, shape, strides), gap in zip(specs, gaps):
        offsets.append(at + gap)
        at += gap + _extent(shape, strides)
    base = bits_tensor((at + 1,), dtype, seed)
    return [base.as_strided(shape, strides, offset) for (_, shape, strides), offset in zip(specs, offsets)]


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """The values the kernels must copy: the row-major flattening, as integers."""
    return bits(t.detach().reshape(-1))


def _refused(specs, names, exc, participating):
    """A refusal must name a param the kernels cannot copy (a deep one), and say how to fix it."""
    deep = [name for (kind, _, _), name, takes in zip(specs, names, participating) if kind == "deep" and takes]
    event("refused")
    assert deep, f"refused params the kernels take: {exc!r}"
    assert any(name in str(exc) for name in deep) and "contiguous" in str(exc), str(exc)


@contextlib.contextmanager
def _free(free_bytes):
    fake = lambda device: MemoryInfo(str(device), free_bytes, free_bytes, 1 << 40, "test")  # noqa: E731
    with mock.patch.object(memory, "probe_memory", fake):
        yield


def _own_slot_gather(out, part, world):
    """The fake group's all-gather, read as a real one: this rank's part lands in its own slot."""
    out.narrow(0, world.rank * part.numel(), part.numel()).copy_(part)


# ------------------------------------------------------------------------------------------------ flatten


TIER_CHOICES = [None, "device", "distributed", "evict", "host"]


@_examples(10)
@given(layout=st.integers(1, 6).flatmap(lambda n: layouts(n)), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       world_size=st.sampled_from([1, 2, 3]), data=st.data())
def test_flatten_every_tier_matches_deepspeeds_flatten(layout, dtype, world_size, data):
    specs, gaps = layout
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    frozen = data.draw(st.lists(st.integers(0, 3).map(lambda k: k == 0), min_size=len(specs), max_size=len(specs)),
                       label="frozen")
    for tier in TIER_CHOICES:
        if tier == "distributed" and world_size == 1:
            continue
        free = data.draw(st.sampled_from([0, 64, 1 << 30]), label=f"free bytes ({tier})")
        alignment = data.draw(st.booleans(), label=f"parameter_alignment ({tier})")
        originals = build(specs, gaps, dtype, seed=len(specs))
        params = [torch.nn.Parameter(v, requires_grad=not f) for v, f in zip(originals, frozen)]
        before = [_row_major(p) for p in params]
        participating = [p.requires_grad and p.numel() > 0 for p in params]
        names = [f"param_groups[0] params[{j}]" for j in range(len(params))]
        with fake_world(world_size, rank), mock.patch.object(F, "all_gather_bytes", _own_slot_gather), _free(free):
            try:
                (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0, parameter_alignment=alignment)
            except (TypeError, ValueError) as exc:
                _refused(specs, names, exc, participating)
                for p, values, (_, shape, _) in zip(params, before, specs):
                    assert tuple(p.shape) == shape and torch.equal(_row_major(p), values)
                continue
        if not any(participating):
            event("nothing to flatten")
            assert fg.flat.numel() == 0
            continue
        # DeepSpeed's own flatten of the params as they were (odd strides and all), in ztriton's order and pads.
        event(f"built by {fg.tier.value}")
        assert tier is None or fg.tier.value == tier, f"tier {tier} fell through to {fg.tier.value}"
        want = bits(deepspeed_flatten([originals[j] for j in fg.order], fg.paddings, 2 * world_size))
        w0, w1 = fg.layout.rank_window(rank) if fg.tier.value == "distributed" else (0, want.numel())
        assert torch.equal(bits(fg.flat)[w0:w1], want[w0:w1]), f"tier {fg.tier} (asked {tier}): bytes differ"
        for j, p in enumerate(params):
            if participating[j]:
                assert p.untyped_storage().data_ptr() == fg.flat.untyped_storage().data_ptr(), f"params[{j}]"
                offset = p.storage_offset() - fg.flat.storage_offset()
                if fg.tier.value != "distributed" or w0 <= offset and offset + p.numel() <= w1:
                    assert torch.equal(_row_major(p), before[j]), f"params[{j}] reads other values"
            else:
                assert torch.equal(_row_major(p), before[j]), f"frozen/empty params[{j}] changed"


# ---------------------------------------------------------------------------------------------- partition


class _Views(torch.nn.Module):
    """Params ``p0, p1, ...`` holding the views of :func:`build` (module level: DeepSpeed rebuilds it).
    ``for_deepspeed``: a view DeepSpeed refuses (its broadcast views each param as bytes, which needs a unit
    last stride) is copied: the same values, which DeepSpeed then partitions."""

    def __init__(self, specs, gaps, dtype, seed, for_deepspeed=False):
        super().__init__()
        for i, view in enumerate(build(specs, gaps, dtype, seed)):
            if for_deepspeed and not _byte_viewable(view):  # a copy with a new tensor's strides
                view = torch.empty(view.shape, dtype=view.dtype).copy_(view)
            self.register_parameter(f"p{i}", torch.nn.Parameter(view))


def _byte_viewable(t: torch.Tensor) -> bool:
    try:
        t.view(torch.uint8)
    except RuntimeError:
        return False
    return True


@_examples(25)
@given(layout=st.integers(1, 10).flatmap(lambda n: layouts(n)), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       world_size=st.sampled_from([1, 2, 3]), data=st.data())
def test_partition_matches_zero_init(layout, dtype, world_size, data):
    """Both sides of ``policy.PER_PARAM_COPIES`` (one copy per param, or one plan) on the local path."""
    specs, gaps = layout
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    module = _Views(specs, gaps, dtype, 5)
    params = list(module.parameters())
    before = [_row_major(p) for p in params]
    names = [f"'p{i}'" for i in range(len(params))]
    with fake_world(world_size, rank):
        try:
            ztriton.partition(module)
        except (TypeError, ValueError) as exc:
            _refused(specs, names, exc, [True] * len(params))
            assert not any(hasattr(p, "ds_id") for p in params)
            for p, values, (_, shape, _) in zip(params, before, specs):
                assert tuple(p.shape) == shape and torch.equal(_row_major(p), values)
            return
    event("partitioned")
    reference = {r.name: r.partition for r in zero3_reference(lambda: _Views(specs, gaps, dtype, 5, for_deepspeed=True),
                                                              world_size, rank, dtype, wrap_existing=True)}
    for i, (p, values) in enumerate(zip(params, before)):
        size = -(-values.numel() // world_size)
        count = max(0, min(values.numel() - rank * size, size))
        assert p.ds_tensor.numel() == size
        assert torch.equal(bits(p.ds_tensor)[:count], bits(reference[f"p{i}"])[:count]), f"p{i}"
        assert not bits(p.ds_tensor)[count:].any(), f"p{i}: padding is not zero"


# --------------------------------------------------------------------------------------------- defragment


@_examples(12)
@given(layout=st.integers(1, 6).flatmap(lambda n: layouts(n, one_d=True)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), tier=st.sampled_from([None, "device", "evict"]),
       free=st.sampled_from([0, 1 << 30]))
def test_defragment_matches_deepspeeds(layout, dtype, tier, free):
    specs, gaps = layout
    want = bits(deepspeed_defragment(build(specs, gaps, dtype, 7)))
    tensors = build(specs, gaps, dtype, 7)
    before = [_row_major(t) for t in tensors]
    with _free(free):
        flat = ztriton.defragment(tensors, tier=tier, headroom_bytes=0)
    assert torch.equal(bits(flat), want)
    for i, (t, values) in enumerate(zip(tensors, before)):
        assert torch.equal(_row_major(t), values), f"tensors[{i}] reads other values"
        assert t.numel() == 0 or t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), f"tensors[{i}]"


# ------------------------------------------------------------------------------------ the cases, pinned down


def _one_element_slice(dtype=torch.float32):
    """The issue's param: shape (1,), stride 2, its neighbour in memory right after it."""
    base = bits_tensor((8,), dtype, 3)
    return base[3::2][:1], base[4:8]


def test_one_element_slice_is_partitioned():
    module = torch.nn.Module()
    lone, _ = _one_element_slice()
    module.p = torch.nn.Parameter(lone)
    assert module.p.is_contiguous() and module.p.stride() == (2,)
    with fake_world(2, 0):
        ztriton.partition(module)
    assert torch.equal(bits(module.p.ds_tensor), bits(lone))


@pytest.mark.parametrize("tier", ["device", "evict", "host"])
def test_one_element_slice_beside_its_neighbour_is_flattened(tier):
    lone, after = _one_element_slice()
    params = [torch.nn.Parameter(lone), torch.nn.Parameter(after)]
    with _free(0):
        (fg,) = ztriton.flatten_groups([params], tier=tier, headroom_bytes=0)
    assert fg.tier.value == tier
    assert torch.equal(bits(fg.flat)[:5], torch.cat([bits(lone), bits(after)]))


def test_forced_distributed_tier_is_taken_for_a_one_element_slice():
    """The tier's host copy viewed the param as bytes: it fell through to evict instead."""
    lone, after = _one_element_slice()
    params = [torch.nn.Parameter(lone), torch.nn.Parameter(after)]
    with fake_world(2, 0), mock.patch.object(F, "all_gather_bytes", _own_slot_gather), _free(0):
        (fg,) = ztriton.flatten_groups([params], tier="distributed", headroom_bytes=0)
    assert fg.tier.value == "distributed"


def test_one_element_slice_beside_its_neighbour_is_defragmented():
    lone, after = _one_element_slice()
    flat = ztriton.defragment([lone, after], tier="device", headroom_bytes=0)
    assert torch.equal(bits(flat), torch.cat([bits(lone), bits(after)]))


def test_a_param_the_kernels_refuse_is_named_in_partition():
    module = torch.nn.Module()
    module.deep = torch.nn.Parameter(build([("deep", *DEEP)], [0], torch.float32, 1)[0])
    with fake_world(2, 0), pytest.raises(ValueError, match=r"parameter 'deep' cannot be copied.*contiguous"):
        ztriton.partition(module)
    assert not hasattr(module.deep, "ds_id")
