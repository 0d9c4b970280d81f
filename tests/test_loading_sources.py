"""Window resolution of Key/Stack/Concat sources against slicing the torch.stack / torch.cat tensor.

Leaves hold distinct integers (a running count over all leaves), so a span that reads the wrong
element, the wrong leaf or writes to the wrong place shows as a mismatch.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ztriton.layout import zero3_slice
from ztriton.loading.sources import Concat, Key, SourceError, Stack, built_shape, leaf_keys, resolve_window

fast = settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trees(draw, shape, depth=0, names=None):
    """(source, leaf shapes) building a tensor of ``shape``: a Key (sometimes one already used), or a
    Stack / Concat along a drawn dim (sometimes written negative) of subtrees that build the parts."""
    names = {} if names is None else names
    ndim = len(shape)
    kinds = ["key"]
    if depth < 3:
        if any(0 < size <= 6 for size in shape):
            kinds.append("stack")
        if ndim >= 1:
            kinds.append("concat")
    kind = draw(st.sampled_from(kinds))
    if kind == "key":
        name = f"k{len(names)}"
        same = [n for n, s in names.items() if s == tuple(shape)]
        if same and draw(st.booleans()):  # the same checkpoint tensor used twice
            name = draw(st.sampled_from(same))
        names[name] = tuple(shape)
        return Key(name), {name: tuple(shape)}
    if kind == "stack":
        d = draw(st.sampled_from([d for d in range(ndim) if 0 < shape[d] <= 6]))
        part_shape = shape[:d] + shape[d + 1:]
        parts, leaves = [], {}
        for _ in range(shape[d]):
            src, lv = draw(trees(part_shape, depth + 1, names))
            parts.append(src)
            leaves.update(lv)
        dim = d - ndim if draw(st.booleans()) else d
        return Stack(tuple(parts), dim), leaves
    d = draw(st.integers(0, ndim - 1))
    k = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=k - 1, max_size=k - 1)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [shape[d]])]
    parts, leaves = [], {}
    for size in sizes:
        src, lv = draw(trees(shape[:d] + (size,) + shape[d + 1:], depth + 1, names))
        parts.append(src)
        leaves.update(lv)
    dim = d - ndim if draw(st.booleans()) else d
    return Concat(tuple(parts), dim), leaves


def build(source, tensors):
    if isinstance(source, Key):
        return tensors[source.name]
    parts = [build(p, tensors) for p in source.parts]
    return torch.stack(parts, source.dim) if isinstance(source, Stack) else torch.cat(parts, source.dim)


def leaf_tensors(leaves):
    tensors, base = {}, 0
    for name, shape in sorted(leaves.items()):
        n = math.prod(shape)
        tensors[name] = torch.arange(base, base + n, dtype=torch.int64).reshape(shape)
        base += n
    return tensors


def apply(spans, tensors, length):
    out = torch.full((length,), -1, dtype=torch.int64)
    for span in spans:
        out[span.offset:span.offset + span.count] = tensors[span.key].reshape(-1)[span.start:span.start + span.count]
    return out


def check_spans(spans, length):
    """Spans cover [0, length) once, in order, and no two neighbours could have been one span."""
    assert all(s.count > 0 for s in spans)
    assert [s.offset for s in spans] == sorted(s.offset for s in spans)
    assert sum(s.count for s in spans) == length
    for a, b in zip(spans, spans[1:]):
        assert a.offset + a.count == b.offset
        assert not (a.key == b.key and a.start + a.count == b.start), (a, b)


shapes = st.lists(st.integers(0, 5), min_size=1, max_size=4).map(tuple)


@fast
@given(data=st.data(), shape=shapes, world=st.integers(1, 8))
def test_rank_windows_match_torch(data, shape, world):
    source, leaves = data.draw(trees(shape))
    tensors = leaf_tensors(leaves)
    full = build(source, tensors)
    assert built_shape(source, leaves) == tuple(full.shape) == shape
    assert set(leaf_keys(source)) == set(leaves)
    rank = data.draw(st.integers(0, world - 1))
    sl = zero3_slice(full.numel(), world)
    begin = min(sl.rank_start(rank), full.numel())
    end = begin + sl.valid_numel(rank)
    spans = resolve_window(source, leaves, begin, end)
    check_spans(spans, end - begin)
    assert torch.equal(apply(spans, tensors, end - begin), full.reshape(-1)[begin:end])


@fast
@given(data=st.data(), shape=shapes)
def test_any_window_matches_torch(data, shape):
    source, leaves = data.draw(trees(shape))
    tensors = leaf_tensors(leaves)
    full = build(source, tensors).reshape(-1)
    begin = data.draw(st.integers(0, full.numel()))
    end = data.draw(st.integers(begin, full.numel()))
    spans = resolve_window(source, leaves, begin, end)
    check_spans(spans, end - begin)
    assert torch.equal(apply(spans, tensors, end - begin), full[begin:end])


def mixtral(experts, ffn, hidden):
    source = Stack(tuple(Concat((Key(f"e{e}.w1"), Key(f"e{e}.w3")), 0) for e in range(experts)), 0)
    leaves = {f"e{e}.{w}": (ffn, hidden) for e in range(experts) for w in ("w1", "w3")}
    return source, leaves


def test_fused_experts_window_is_a_few_spans_without_materialising():
    # 32 experts of 14336 x 4096: 3.76e9 elements (past 2**31), never built.
    source, leaves = mixtral(32, 14336, 4096)
    numel = math.prod(built_shape(source, leaves))
    assert built_shape(source, leaves) == (32, 2 * 14336, 4096) and numel > 2**31
    sl = zero3_slice(numel, 8)
    expert = 2 * 14336 * 4096
    for rank in range(8):
        begin = sl.rank_start(rank)
        spans = resolve_window(source, leaves, begin, begin + sl.valid_numel(rank))
        check_spans(spans, sl.valid_numel(rank))
        # rank r holds experts [4r, 4r + 4): w1 and w3 of each, whole
        assert [(s.key, s.start, s.count) for s in spans] == [
            (f"e{e}.{w}", 0, expert // 2) for e in range(4 * rank, 4 * rank + 4) for w in ("w1", "w3")]
    # an unaligned window: a tail of one w3, then the next expert's w1 head
    spans = resolve_window(source, leaves, expert - 5, expert + 7)
    assert [tuple(s) for s in spans] == [("e0.w3", expert // 2 - 5, 5, 0), ("e1.w1", 0, 7, 5)]


def test_concat_along_last_dim_gives_one_span_per_row_part():
    source = Concat((Key("a"), Key("b")), -1)
    leaves = {"a": (3, 2), "b": (3, 4)}
    spans = resolve_window(source, leaves, 1, 17)
    assert [tuple(s) for s in spans] == [("a", 1, 1, 0), ("b", 0, 4, 1), ("a", 2, 2, 5), ("b", 4, 4, 7),
                                         ("a", 4, 2, 11), ("b", 8, 3, 13)]


def test_single_part_concat_merges_to_one_span():
    spans = resolve_window(Concat((Key("a"),), 1), {"a": (1000, 7)}, 3, 6990)
    assert [tuple(s) for s in spans] == [("a", 3, 6987, 0)]


def test_shape_errors_name_the_parts():
    pattern = r"part 1 \(Key\('b'\)\) has shape \(3, 5\).*part 0 \(Key\('a'\)\) has \(3, 4\)"
    with pytest.raises(SourceError, match=pattern):
        built_shape(Stack((Key("a"), Key("b"))), {"a": (3, 4), "b": (3, 5)})
    with pytest.raises(SourceError, match="agree on every dim but 0"):
        built_shape(Concat((Key("a"), Key("b")), 0), {"a": (3, 4), "b": (3, 5)})
    with pytest.raises(SourceError, match="agree on every dim but 1"):
        built_shape(Concat((Key("a"), Key("b")), 1), {"a": (3, 4), "b": (3, 4, 1)})
    with pytest.raises(SourceError, match="dim 2 is out of range"):
        built_shape(Concat((Key("a"),), 2), {"a": (3, 4)})
    with pytest.raises(SourceError, match="dim -4 is out of range"):
        built_shape(Stack((Key("a"),), -4), {"a": (3, 4)})
    with pytest.raises(SourceError, match="0-d"):
        built_shape(Concat((Key("a"),), 0), {"a": ()})
    with pytest.raises(SourceError, match="no shape for checkpoint tensor 'z'"):
        built_shape(Stack((Key("a"), Key("z"))), {"a": (1,)})
    assert built_shape(Stack((Key("a"), Key("a")), -1), {"a": ()}) == (2,)
    assert built_shape(Stack((Key("a"), Key("a")), 2), {"a": (3, 4)}) == (3, 4, 2)


def test_window_outside_the_tensor_is_refused():
    with pytest.raises(SourceError, match=r"window \[5, 13\) is outside the 12 elements"):
        resolve_window(Key("a"), {"a": (3, 4)}, 5, 13)
    with pytest.raises(SourceError, match="outside"):
        resolve_window(Key("a"), {"a": (3, 4)}, 6, 5)
    assert resolve_window(Key("a"), {"a": (3, 4)}, 12, 12) == []


def test_source_constructors_check_their_arguments():
    with pytest.raises(ValueError, match="at least one part"):
        Stack(())
    with pytest.raises(TypeError, match="part 1 must be a Key, Stack or Concat"):
        Concat((Key("a"), "b"))
    with pytest.raises(TypeError, match="tuple of sources"):
        Stack("ab")
    with pytest.raises(TypeError, match="dim must be an int"):
        Stack((Key("a"),), 1.0)
    with pytest.raises(TypeError, match="Key name must be a str"):
        Key(3)
    assert Stack([Key("a")]).parts == (Key("a"),)  # lists become tuples: sources stay hashable
    assert hash(Stack([Key("a")])) == hash(Stack((Key("a"),)))
