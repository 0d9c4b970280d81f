"""Kernels against the torch reference (``ztriton.kernels.reference``, also the entry points'
fallback), compared on the bytes; the reference itself against ``torch.cat`` constructions.

Every destination is poisoned first, so a test sees both that each element in range was written and
that nothing outside it was. On CPU the kernels run under the Triton interpreter: sizes stay small.
"""
import os

import numpy as np

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factories import random_bits
from ztriton.kernels import (bits, byte_extent, byte_extents, copy_chunk, pack, pack_plan, pack_slices,
                             torch_copy_chunk, torch_pack, torch_pack_slices, uncovered)

from ztriton.kernels import plan as plan_module
from ztriton.kernels import torch_route, validation
from ztriton.kernels.pieces import slices_to_pieces

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float64]
# ZT_EXAMPLES raises the example count for a longer local run.
FAST = settings(max_examples=int(os.environ.get("ZT_EXAMPLES", 40)), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def kernels_always(monkeypatch, request):
    """These tests are about the kernels: a plan of a few contiguous pieces launches them too, instead
    of handing the pieces to torch's copy_ (``Tuning.torch_pieces``; that path has its own test below)."""
    if "torch_copies" not in request.node.name:
        monkeypatch.setattr(plan_module, "_torch_copies_suffice", lambda *args: False)


def random_tensor(shape, dtype, generator=None) -> torch.Tensor:
    """Random bit patterns of any dtype: raw bytes viewed as ``dtype`` (NaNs included)."""
    if dtype == torch.bool:
        return (random_bits(shape, torch.uint8, generator) % 2).view(torch.bool).to(DEVICE)
    return random_bits(shape, dtype, generator).to(DEVICE)


def poisoned(numel, dtype) -> torch.Tensor:
    """A destination filled with 0xA5 bytes, a pattern no test source is made of by chance."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fill = 1 if dtype == torch.bool else 0xA5
    return torch.full((numel * itemsize,), fill, dtype=torch.uint8, device=DEVICE).view(dtype)


# A strided view drawn from a base tensor: permuted, sliced with steps, offset, or expanded.
@st.composite
def strided_views(draw, dtypes=st.sampled_from(ALL_DTYPES), max_dims=4, max_side=7):
    dtype = draw(dtypes)
    ndim = draw(st.integers(0, max_dims))
    shape = draw(st.lists(st.integers(0, max_side), min_size=ndim, max_size=ndim))
    steps = draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
    offsets = draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim))
    base_shape = [s * k + o for s, k, o in zip(shape, steps, offsets)]
    base = random_tensor(base_shape, dtype)
    view = base[tuple(slice(o, o + s * k, k) for s, k, o in zip(shape, steps, offsets))]
    if ndim > 1 and draw(st.booleans()):
        view = view.permute(*draw(st.permutations(range(ndim))))
    if ndim and draw(st.booleans()):  # expand one size-1 dim with stride 0
        dim = draw(st.integers(0, ndim - 1))
        view = view.narrow(dim, 0, min(1, view.shape[dim])).expand(
            *[draw(st.integers(0, 4)) if d == dim and view.shape[d] else -1 for d in range(ndim)])
    return view


@FAST
@given(src=strided_views(), data=st.data())
def test_copy_chunk_matches_flatten(src, data):
    numel = src.numel()
    start = data.draw(st.integers(0, numel))
    count = data.draw(st.integers(0, numel - start))
    lead = data.draw(st.integers(0, 9))  # dst is a view at an arbitrary element offset
    buf = poisoned(lead + count + 3, src.dtype)
    copy_chunk(src, buf[lead:lead + count], start, count)
    expected = poisoned(lead + count + 3, src.dtype)
    torch_copy_chunk(src, expected[lead:lead + count], start, count)
    assert torch.equal(bits(buf), bits(expected))


def layout_of(sizes, gaps):
    """Offsets of tensors of ``sizes`` separated by ``gaps`` zeros, and the layout's length."""
    offsets, cursor = [], 0
    for size, gap in zip(sizes, gaps):
        cursor += gap
        offsets.append(cursor)
        cursor += size
    return offsets, cursor


def reference_layout(sources, offsets, total, dtype) -> torch.Tensor:
    """The reference's pack into a poisoned buffer (every element written: no poison survives)."""
    return torch_pack(poisoned(total, dtype), sources, offsets)


def cat_layout(sources, offsets, total, dtype) -> torch.Tensor:
    """A flat layout built independently of the reference, to check the reference itself."""
    parts, cursor = [], 0
    for src, offset in sorted(zip(sources, offsets), key=lambda so: so[1]):
        parts += [torch.zeros(offset - cursor, dtype=dtype, device=DEVICE), src.reshape(-1)]
        cursor = offset + src.numel()
    return torch.cat(parts + [torch.zeros(total - cursor, dtype=dtype, device=DEVICE)])


@FAST
@given(data=st.data(), dtype=st.sampled_from(ALL_DTYPES), k=st.integers(0, 8))
def test_reference_pack_is_the_cat_layout(data, dtype, k):
    """The oracle: torch_pack lays sources out as torch.cat with zero pads does, windows included."""
    sources = [data.draw(strided_views(dtypes=st.just(dtype), max_dims=3, max_side=5)) for _ in range(k)]
    offsets, end = layout_of([s.numel() for s in sources], data.draw(st.lists(st.integers(0, 5), min_size=k, max_size=k)))
    total = end + data.draw(st.integers(0, 5))
    whole = cat_layout(sources, offsets, total, dtype)
    assert torch.equal(bits(reference_layout(sources, offsets, total, dtype)), bits(whole))
    w0 = data.draw(st.integers(0, total))
    w1 = data.draw(st.integers(w0, total))
    out = torch_pack(poisoned(w1 - w0, dtype), sources, offsets, window=(w0, w1))
    assert torch.equal(bits(out), bits(whole[w0:w1]))


@FAST
@given(data=st.data(), dtype=st.sampled_from(ALL_DTYPES), k=st.integers(1, 12))
def test_pack_and_window(data, dtype, k):
    sources = [data.draw(strided_views(dtypes=st.just(dtype), max_dims=3, max_side=6)) if data.draw(st.booleans())
               else random_tensor([data.draw(st.integers(0, 70))], dtype) for _ in range(k)]
    gaps = data.draw(st.lists(st.integers(0, 9), min_size=k, max_size=k))
    offsets, end = layout_of([s.numel() for s in sources], gaps)
    total = end + data.draw(st.integers(0, 9))
    ref = reference_layout(sources, offsets, total, dtype)

    flat = poisoned(total, dtype)
    pack(flat, sources, offsets)
    assert torch.equal(bits(flat), bits(ref))

    w0 = data.draw(st.integers(0, total))
    w1 = data.draw(st.integers(w0, total))
    lead = data.draw(st.integers(0, 5))
    out = poisoned(lead + (w1 - w0) + 2, dtype)
    pack(out[lead:], sources, offsets, window=(w0, w1))
    expected = poisoned(lead + (w1 - w0) + 2, dtype)
    torch_pack(expected[lead:], sources, offsets, window=(w0, w1))
    assert torch.equal(bits(out), bits(expected))


def test_pack_hundreds_of_tensors():
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 40, (300,), generator=gen).tolist()
    sources = [random_tensor([n], torch.bfloat16, gen) for n in sizes]
    sources[7] = random_tensor([6, 5], torch.bfloat16, gen).t()  # one strided among them
    offsets, end = layout_of([s.numel() for s in sources], [(-i) % 8 for i in range(300)])
    flat = poisoned(end + 5, torch.bfloat16)
    pack(flat, sources, offsets)
    assert torch.equal(bits(flat), bits(reference_layout(sources, offsets, end + 5, torch.bfloat16)))


@FAST
@given(data=st.data(), world=st.integers(1, 8), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]))
def test_pack_slices_per_rank_buffer(data, world, dtype):
    """One rank's ZeRO-3-style slices of several params into one buffer, tails zeroed."""
    params = [data.draw(strided_views(dtypes=st.just(dtype), max_dims=3)) for _ in range(data.draw(st.integers(1, 5)))]
    rank = data.draw(st.integers(0, world - 1))
    slices, ref_parts, offset = [], [], 0
    for p in params:
        psize = -(-p.numel() // world)
        start = min(rank * psize, p.numel())
        count = min(psize, p.numel() - start)
        slices.append((p, start, count, offset))
        ref_parts += [p.reshape(-1)[start:start + count], torch.zeros(psize - count, dtype=dtype, device=DEVICE)]
        offset += psize
    buf = poisoned(offset, dtype)
    pack_slices(buf, slices)
    reference = torch_pack_slices(poisoned(offset, dtype), slices)
    assert torch.equal(bits(buf), bits(reference))
    assert torch.equal(bits(reference), bits(torch.cat(ref_parts)))  # the oracle, checked independently


@pytest.mark.parametrize("shape,perm", [((3, 4, 5), (2, 0, 1)), ((2, 3, 4, 5), (3, 1, 0, 2)), ((33, 17), (1, 0))])
def test_transposed_sources(shape, perm):
    src = random_tensor(list(shape), torch.bfloat16).permute(*perm)
    out = poisoned(src.numel(), torch.bfloat16)
    copy_chunk(src, out)
    assert torch.equal(bits(out), bits(src))


def test_six_unmergeable_dims_and_storage_offset():
    base = random_tensor([3, 4, 3, 5, 2, 3, 4], torch.float16)
    src = base[1:, ::2, :, 1:, :, ::2, 1:].permute(5, 3, 1, 0, 2, 4, 6)
    out = poisoned(src.numel() - 3, torch.float16)
    copy_chunk(src, out, 2, src.numel() - 3)
    assert torch.equal(bits(out), bits(src.reshape(-1)[2:src.numel() - 1]))


def test_empty_and_single_element():
    out = poisoned(1, torch.float32)
    copy_chunk(torch.tensor(2.5, device=DEVICE), out)
    assert out.item() == 2.5
    empty = poisoned(0, torch.float32)
    copy_chunk(torch.empty(0, 3, device=DEVICE), empty)
    pack(poisoned(0, torch.float32), [], [])


# ---------------------------------------------------------------------------------------------
# Bad input is refused, naming the argument and sizes, before anything is written.


def assert_untouched(buf):
    assert torch.equal(bits(buf), bits(poisoned(buf.numel(), buf.dtype)))


@pytest.mark.parametrize("case,error,match", [
    ("dtype", TypeError, r"sources\[1\] has dtype torch.float16 but dst has dtype torch.float32"),
    ("too_small", ValueError, r"sources\[1\].*does not fit in dst of 10 elements"),
    ("negative_offset", ValueError, r"offsets\[1\]=-1 is negative"),
    ("overlap_layout", ValueError, r"sources\[0\].*sources\[1\].*overlap in dst"),
    ("window", ValueError, r"window=\(4, 2\)"),
    ("count", ValueError, r"got 2 sources but 1 offsets"),
])
@pytest.mark.parametrize("impl", [pack, torch_pack], ids=["kernels", "reference"])
def test_pack_errors(case, error, match, impl):
    dst = poisoned(10, torch.float32)
    a = torch.ones(3, device=DEVICE)
    b = torch.ones(4, device=DEVICE)
    args = {
        "dtype": ([a, b.half()], [0, 4], None),
        "too_small": ([a, b], [0, 8], None),
        "negative_offset": ([a, b], [0, -1], None),
        "overlap_layout": ([a, b], [0, 2], None),
        "window": ([a, b], [0, 4], (4, 2)),
        "count": ([a, b], [0], None),
    }[case]
    with pytest.raises(error, match=match):
        impl(dst, args[0], args[1], window=args[2])
    assert_untouched(dst)


@pytest.mark.parametrize("impl", [pack, torch_pack], ids=["kernels", "reference"])
def test_overlapping_source_and_destination_refused(impl):
    buf = poisoned(20, torch.float32)
    with pytest.raises(ValueError, match=r"sources\[0\] overlaps dst in memory"):
        impl(buf[5:], [buf[:8]], [0])
    assert_untouched(buf)


@pytest.mark.parametrize("copy_chunk", [copy_chunk, torch_copy_chunk], ids=["kernels", "reference"])
def test_chunk_out_of_range_refused(copy_chunk):
    src = torch.ones(10, device=DEVICE)
    out = poisoned(5, torch.float32)
    with pytest.raises(ValueError, match=r"range \[8, 13\) is outside its 10 elements"):
        copy_chunk(src, out, 8, 5)
    with pytest.raises(ValueError, match=r"count=6 exceeds dst's 5 elements"):
        copy_chunk(src, out, 0, 6)
    with pytest.raises(ValueError, match=r"range \[-1, 4\)"):
        copy_chunk(src, out, -1, 5)
    with pytest.raises(ValueError, match="dst must be contiguous"):
        copy_chunk(src, poisoned(10, torch.float32)[::2])
    assert_untouched(out)


def test_device_mismatch_refused():
    if DEVICE == "cpu":
        pytest.skip("needs a second device: CPU tensors under the interpreter have no other device with values")
    with pytest.raises(ValueError, match=r"sources\[0\] is on cpu but dst is on cuda"):
        pack(poisoned(4, torch.float32), [torch.ones(4)], [0])


# Every launch function and its reference, each bad argument: the exception class and the argument's
# name in the message, and the destination untouched. `dst` is a poisoned float32 buffer of 10.
def _a():
    return torch.ones(3, device=DEVICE)


BAD_CALLS = [
    # integers only: a float would be truncated (2.5 elements leave one unwritten), a bool is not a count
    ("slice count 2.5", "slices", lambda dst: [(_a(), 0, 2.5, 0)], TypeError, r"slices\[0\] count must be an int"),
    ("slice start 0.0", "slices", lambda dst: [(_a(), 0.0, 2, 0)], TypeError, r"slices\[0\] start must be an int"),
    ("slice offset '1'", "slices", lambda dst: [(_a(), 0, 2, "1")], TypeError, r"slices\[0\] offset must be an int"),
    ("slice offset 2**64", "slices", lambda dst: [(_a(), 0, 2, 2**64)], ValueError, r"slices\[0\] offset=18446744073709551616 is out of range"),
    ("slice of 3", "slices", lambda dst: [(_a(), 0, 2)], TypeError, r"slices\[0\] must be a \(src, start, count, offset\)"),
    ("slices None", "slices", lambda dst: None, TypeError, r"slices must be a list or tuple, got NoneType"),
    ("slices tensor", "slices", lambda dst: _a(), TypeError, r"slices must be a list or tuple, got a torch.Tensor"),
    ("slice src str", "slices", lambda dst: [("x", 0, 1, 0)], TypeError, r"slices\[0\] must be a torch.Tensor, got str"),
    ("offset 3.9", "pack", lambda dst: ([_a()], [3.9], None), TypeError, r"offsets\[0\] must be an int, got float 3.9"),
    ("offset True", "pack", lambda dst: ([_a()], [True], None), TypeError, r"offsets\[0\] must be an int, got the bool"),
    ("offset 2**64", "pack", lambda dst: ([_a()], [2**64], None), ValueError, r"offsets\[0\]=18446744073709551616 is out of range"),
    ("offset 2**63-1", "pack", lambda dst: ([_a()], [2**63 - 1], None), ValueError, r"offsets\[0\]=9223372036854775807 is out of range"),
    ("window 0.5", "pack", lambda dst: ([_a()], [0], (0.5, 3)), TypeError, r"window\[0\] must be an int, got float 0.5"),
    ("window str", "pack", lambda dst: ([_a()], [0], "03"), TypeError, r"window must be a list or tuple, got str"),
    ("window of 3", "pack", lambda dst: ([_a()], [0], (0, 1, 2)), ValueError, r"window must be None or \(w0, w1\)"),
    ("sources tensor", "pack", lambda dst: (_a(), [0], None), TypeError, r"sources must be a list or tuple, got a torch.Tensor; wrap"),
    ("sources None", "pack", lambda dst: (None, [0], None), TypeError, r"sources must be a list or tuple, got NoneType"),
    ("offsets None", "pack", lambda dst: ([_a()], None, None), TypeError, r"offsets must be a list or tuple, got NoneType"),
    ("offsets str", "pack", lambda dst: ([_a()], "0", None), TypeError, r"offsets must be a list or tuple, got str"),
    ("source int", "pack", lambda dst: ([5], [0], None), TypeError, r"sources\[0\] must be a torch.Tensor, got int"),
    ("meta source", "pack", lambda dst: ([torch.empty(3, device="meta")], [0], None), ValueError,
     r"sources\[0\] is on the meta device and holds no values"),
    ("sparse source", "pack", lambda dst: ([torch.ones(3, device=DEVICE).to_sparse()], [0], None), TypeError,
     r"sources\[0\] has layout torch.sparse_coo.*to_dense"),
    ("start 1.0", "chunk", lambda dst: (_a(), 1.0, 2), TypeError, r"start must be an int, got float"),
    ("count True", "chunk", lambda dst: (_a(), 0, True), TypeError, r"count must be an int, got the bool True"),
    ("count '2'", "chunk", lambda dst: (_a(), 0, "2"), TypeError, r"count must be an int, got str"),
    ("src None", "chunk", lambda dst: (None, 0, 2), TypeError, r"src must be a torch.Tensor, got NoneType"),
]
IMPLS = {"slices": (pack_slices, torch_pack_slices), "pack": (pack, torch_pack), "chunk": (copy_chunk, torch_copy_chunk)}


def _call(impl, kind, dst, args):
    if kind == "slices":
        return impl(dst, args)
    if kind == "pack":
        sources, offsets, window = args
        return impl(dst, sources, offsets, window=window)
    src, start, count = args
    return impl(src, dst, start, count)


@pytest.mark.parametrize("which", [0, 1], ids=["kernels", "reference"])
@pytest.mark.parametrize("case,kind,make,error,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_named_and_nothing_written(case, kind, make, error, match, which):
    dst = poisoned(10, torch.float32)
    with pytest.raises(error, match=match):
        _call(IMPLS[kind][which], kind, dst, make(dst))
    assert_untouched(dst)


@pytest.mark.parametrize("impl", [pack, torch_pack, copy_chunk], ids=["pack", "torch_pack", "copy_chunk"])
@pytest.mark.parametrize("dst", [None, "buffer", torch.empty(4, device="meta"), torch.ones(4).to_sparse()],
                         ids=["None", "str", "meta", "sparse"])
def test_bad_dst_named(impl, dst):
    args = (dst, [torch.ones(4)], [0]) if impl is not copy_chunk else (torch.ones(4), dst)
    with pytest.raises((TypeError, ValueError), match=r"^dst "):
        impl(*args)


def test_integer_like_arguments_accepted():
    """numpy integers and integer 0-d tensors are integers: accepted, not truncated."""
    import numpy as np

    src = random_tensor([6], torch.int32)
    out = poisoned(8, torch.int32)
    pack(out, [src], [np.int64(1)], window=(np.int32(0), torch.tensor(8)))
    assert torch.equal(bits(out), bits(torch_pack(poisoned(8, torch.int32), [src], [1])))
    pack_slices(out, [(src, np.int64(2), torch.tensor(3), 4)])
    assert torch.equal(bits(out[4:7]), bits(src[2:5])) and not bits(out[:4]).any()


def test_lazy_conjugate_refused():
    z = torch.randn(4, dtype=torch.complex64, device=DEVICE).conj()
    out = poisoned(4, torch.complex64)
    for impl in (pack, torch_pack):
        with pytest.raises(ValueError, match=r"sources\[0\] is a lazy conjugate.*resolve_conj"):
            impl(out, [z], [0])
    assert_untouched(out)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
def test_complex_strided_sources(dtype):
    """A 16-byte element travels as two 8-byte words: strided complex128 sources (DeepSpeed accepts
    such a param) copy bit-exactly through every entry point."""
    base = torch.randn(6, 10, dtype=dtype, device=DEVICE)
    src = base[1:, ::3].t()  # strided, transposed
    out = poisoned(src.numel() + 3, dtype)
    copy_chunk(src, out[1:1 + src.numel() - 2], 1, src.numel() - 2)
    expected = poisoned(src.numel() + 3, dtype)
    torch_copy_chunk(src, expected[1:1 + src.numel() - 2], 1, src.numel() - 2)
    assert torch.equal(bits(out), bits(expected))
    flat = poisoned(40, dtype)
    pack(flat, [src, base[0]], [1, 25])
    assert torch.equal(bits(flat), bits(torch_pack(poisoned(40, dtype), [src, base[0]], [1, 25])))
    window = poisoned(9, dtype)
    pack(window, [src, base[0]], [1, 25], window=(20, 29))
    assert torch.equal(bits(window), bits(flat[20:29]))
    slices = poisoned(12, dtype)
    pack_slices(slices, [(src, 3, 5, 0), (base.t(), 7, 4, 6)])
    assert torch.equal(bits(slices), bits(torch_pack_slices(poisoned(12, dtype), [(src, 3, 5, 0), (base.t(), 7, 4, 6)])))


def test_tables_keep_pointer_arguments_16_byte_aligned():
    """triton compiles one variant per pointer alignment class: every table pointer a launch passes
    (the rows and their prefix sum) is 16-byte aligned whatever the number of rows, so that a fresh
    process compiles each kernel once per constexpr combination, not twice."""
    from ztriton.kernels import make_plan
    from ztriton.kernels.pieces import pack_pieces

    gen = torch.Generator().manual_seed(1)
    for k in range(1, 8):
        sources = [random_tensor([int(n)], torch.bfloat16, gen) for n in torch.randint(1, 50, (k,), generator=gen)]
        sources.append(random_tensor([5, 3], torch.bfloat16, gen).t())  # one gather launch, k rows... odd and even
        offsets, end = layout_of([s.numel() for s in sources], [1] * len(sources))
        flat = poisoned(end, torch.bfloat16)
        plan = make_plan(flat, *pack_pieces(flat, sources, offsets))
        assert plan.launches
        assert len(plan.tables) == 1  # every launch's table in one upload: views of it
        for _, _, args, _ in plan.launches:
            pointers = [a for a in args if isinstance(a, torch.Tensor)]
            assert all(p.data_ptr() % 16 == 0 for p in pointers), [p.data_ptr() % 16 for p in pointers]
        plan.launch()
        assert torch.equal(bits(flat), bits(reference_layout(sources, offsets, end, torch.bfloat16)))


@FAST
@given(data=st.data(), dtype=st.sampled_from(ALL_DTYPES + [torch.complex64]))
def test_few_contiguous_pieces_go_through_torch_copies_with_the_same_bits(data, dtype):
    """Up to ``Tuning.torch_pieces`` contiguous pieces: torch's copies and zeroes instead of a launch, the
    same bytes as the kernels write (pieces anywhere in their sources, sources at any offset of their storage,
    1-D or 2-D, gaps before, between and after; each piece's own copy_, a shared _foreach_copy_ or torch.cat)."""
    from ztriton.kernels import Piece, Tuning, make_plan

    count = data.draw(st.integers(0, 6))
    pieces, at = [], data.draw(st.integers(0, 5))
    for _ in range(count):
        # 1-D or 2-D, whole or a slice of a bigger buffer at any element (then its bytes may not be word-aligned)
        rows, cols = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 16))
        skip = data.draw(st.integers(0, 5))
        src = random_tensor([skip + rows * cols], dtype)[skip:]
        src = src.view(rows, cols) if data.draw(st.booleans()) else src
        start = data.draw(st.integers(0, src.numel() - 1))
        n = data.draw(st.integers(0, src.numel() - start))
        pieces.append(Piece(src, start, n, at))
        at += n + data.draw(st.integers(0, 5))
    by_torch, by_kernels = poisoned(at, dtype), poisoned(at, dtype)
    # With the gaps zeroed the pieces and gaps tile dst (one split cuts its views), without them they do not.
    gaps = uncovered([(p[3], p[3] + p[2]) for p in pieces], 0, at) if data.draw(st.booleans()) else []
    # Runs and gaps side by side in dst (cat_items or more) are one torch.cat; of the others, pieces of at least
    # own_copy_bytes get a copy_ each, the rest share a _foreach_copy_ per word width, but only where more than
    # foreach_from are left (the gaps likewise: a zero_ each or one _foreach_zero_).
    own = data.draw(st.sampled_from([1, 24, Tuning().own_copy_bytes]))
    tuning = Tuning(own_copy_bytes=own, foreach_from=data.draw(st.sampled_from([0, 2, Tuning().foreach_from])),
                    cat_items=data.draw(st.sampled_from([0, 2, 3, Tuning().cat_items])))
    torch_plan = make_plan(by_torch, pieces, gaps, tuning=tuning)
    assert not torch_plan.launches, "a few contiguous pieces should not launch a kernel"
    for out, inputs in torch_plan.cats:  # torch.cat would promote mixed dtypes: values, not bits, would move
        assert {t.dtype for t in inputs} == {out.dtype} and sum(t.numel() for t in inputs) == out.numel()
    torch_plan.launch()
    make_plan(by_kernels, pieces, gaps, tuning=Tuning(torch_pieces=0)).launch()
    assert torch.equal(bits(by_torch), bits(by_kernels))
    # Copied while planned (run_plan's way), into dst at an element offset of a bigger buffer.
    lead = data.draw(st.integers(0, 3))
    by_now = poisoned(lead + at, dtype)[lead:]
    done = make_plan(by_now, pieces, gaps, tuning=tuning, run_now=True)
    assert not done.torch_copies and not done.launches, "run_now leaves nothing to launch"
    assert torch.equal(bits(by_now), bits(by_kernels))


def test_torch_copies_write_what_the_kernels_write_in_every_odd_case():
    """The torch path writes bytes of dst's flattening like the kernels: an N-D dst, bool bytes other than
    0 and 1, sources and dst that require grad (autograd never sees the writes), an inference tensor."""
    from ztriton.kernels import Piece, Tuning, make_plan

    def both(make_dst, pieces, zeros):
        outs = []
        for tuning in (Tuning(), Tuning(torch_pieces=0)):
            dst = make_dst()
            plan = make_plan(dst, pieces, zeros, tuning=tuning)
            assert plan.torch_copies == (tuning.torch_pieces > 0)
            plan.launch()
            outs.append(dst)
        assert torch.equal(bits(outs[0]), bits(outs[1])), (outs[0], outs[1])
        return outs[0]

    src = random_tensor([6], torch.float32)
    out = both(lambda: poisoned(8, torch.float32).view(4, 2), [Piece(src, 1, 3, 2)], [(0, 2), (5, 3)])
    assert torch.equal(bits(out.view(-1)[2:5]), bits(src[1:4]))
    raw = torch.tensor([0, 2, 0xAB, 1], dtype=torch.uint8, device=DEVICE).view(torch.bool)
    out = both(lambda: poisoned(4, torch.bool), [Piece(raw, 0, 4, 0)], [])
    assert out.view(torch.uint8).tolist() == [0, 2, 0xAB, 1]
    grad_src = random_tensor([4], torch.float32).requires_grad_()
    out = both(lambda: poisoned(6, torch.float32), [Piece(grad_src, 0, 4, 1)], [(0, 1), (5, 1)])
    assert not out.requires_grad and out.grad_fn is None
    both(lambda: torch.nn.Parameter(poisoned(4, torch.float32)), [Piece(src, 0, 4, 0)], [])
    if hasattr(torch, "float4_e2m1fn_x2"):  # torch can neither fill nor convert it: bytes only
        fp4 = torch.randint(0, 256, (8,), dtype=torch.uint8).view(torch.float4_e2m1fn_x2).to(DEVICE)
        big = 40_000  # past the size where CPU zero_ goes through fill_
        out = both(lambda: poisoned(big, torch.float4_e2m1fn_x2), [Piece(fp4, 0, 8, 3)], [(0, 3), (11, big - 11)])
        assert int(out.view(torch.uint8)[11:].count_nonzero()) == 0
    with torch.inference_mode():
        inference = poisoned(4, torch.float32)
    both(lambda: _inference_copy(inference), [Piece(src, 0, 4, 0)], [])


def _inference_copy(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def test_torch_copies_planned_in_inference_mode_launch_outside_it():
    """A plan's byte views made inside inference mode are inference tensors even over a normal dst: launched
    after the mode has ended, the plan still writes them (inside it again), and a plan made outside never
    enters it."""
    from ztriton.kernels import Piece, make_plan

    src = torch.arange(4, dtype=torch.float32, device=DEVICE)
    dst = torch.full((8,), -1.0, device=DEVICE)
    with torch.inference_mode():
        plan = make_plan(dst, [Piece(src, 0, 4, 0)], [(4, 4)])
    assert plan.torch_copies and plan.inference
    plan.launch()
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0] and not dst.is_inference()
    assert not make_plan(dst, [Piece(src, 0, 4, 0)], [(4, 4)]).inference


def test_torch_copies_off_with_torch_pieces_0_even_for_zeros_only():
    from ztriton.kernels import Tuning, make_plan

    plan = make_plan(poisoned(8, torch.float16), [], [(0, 8)], tuning=Tuning(torch_pieces=0))
    assert plan.launches and not plan.fills


def test_torch_copies_only_for_few_contiguous_pieces():
    from ztriton.kernels import Piece, Tuning, make_plan

    few = Tuning().torch_pieces
    sources = [random_tensor([8], torch.float16) for _ in range(few + 1)]
    dst = poisoned(8 * (few + 1), torch.float16)
    pieces = [Piece(s, 0, 8, 8 * i) for i, s in enumerate(sources)]
    assert make_plan(dst, pieces[:few]).torch_copies and not make_plan(dst, pieces[:few]).launches
    assert make_plan(dst, pieces).launches and not make_plan(dst, pieces).torch_copies
    strided = random_tensor([4, 2], torch.float16).t()
    assert make_plan(dst, [Piece(strided, 0, 8, 0)]).launches


def test_n_parts_is_not_specialised():
    """An integer argument equal to 1 or a multiple of 16 would be a variant of its own."""
    from ztriton.kernels.copy import copy_words_kernel, gather_tile_kernel

    for kernel in (copy_words_kernel, gather_tile_kernel):
        spec = getattr(kernel, "do_not_specialize", None)
        if spec is None:  # the interpreter keeps the decorator's arguments
            spec = kernel.kwargs["do_not_specialize"]
        names = [kernel.arg_names[i] if isinstance(i, int) else i for i in spec] if hasattr(kernel, "arg_names") \
            else list(spec)
        assert "n_parts" in names


def run_in_threads(work, count: int) -> None:
    """``work(t)`` for t in range(count), each in its own thread at once; any exception (an assertion
    included) fails the test after all threads ended."""
    import threading

    errors = []

    def guarded(t):
        try:
            work(t)
        except Exception as exc:  # surfaced below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_concurrent_launches_from_two_threads():
    """Two threads packing at once get each its own exact result (under the interpreter the launches
    take turns: it patches triton.language module-wide while a kernel runs)."""
    gen = torch.Generator().manual_seed(5)
    jobs = []
    for t in range(2):
        sources = [random_tensor([int(n)], torch.float16, gen) for n in torch.randint(1, 60, (6,), generator=gen)]
        sources.append(random_tensor([7, 4], torch.float16, gen).t())
        offsets, end = layout_of([s.numel() for s in sources], [t + 1] * len(sources))
        jobs.append((sources, offsets, end))
    results = [None, None]

    def work(t):
        sources, offsets, end = jobs[t]
        outs = []
        for _ in range(3):
            out = poisoned(end, torch.float16)
            pack(out, sources, offsets)
            outs.append(out)
        results[t] = outs

    run_in_threads(work, 2)
    for (sources, offsets, end), outs in zip(jobs, results):
        expected = reference_layout(sources, offsets, end, torch.float16)
        assert all(torch.equal(bits(o), bits(expected)) for o in outs)


def test_cpu_kernels_without_the_interpreter_name_the_variable():
    """Outside TRITON_INTERPRET=1 a kernel call on CPU tensors says what to set (not Triton's '0 active
    drivers'), and the torch reference still works there."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from ztriton.kernels import pack, torch_pack\n"
            "dst = torch.full((6,), 7.0)\n"
            "try:\n"
            "    pack(dst, [torch.ones(3)], [1])\n"
            "except ValueError as exc:\n"
            "    print('ERROR', exc)\n"
            "assert dst.tolist() == [7.0] * 6\n"
            "print('REFERENCE', torch_pack(dst, [torch.ones(3)], [1]).tolist())\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR dst is on cpu" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout
    assert "REFERENCE [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]" in out.stdout


@pytest.mark.gpu
def test_gpu_two_threads_two_streams():
    """Concurrent packs from two threads, each on its own stream, with plans made on one stream and
    launched on another: every result exact."""
    gen = torch.Generator().manual_seed(11)
    jobs = []
    for t in range(2):
        sizes = torch.randint(1, 200_000, (300,), generator=gen).tolist()
        sources = [random_tensor([n], torch.bfloat16, gen) for n in sizes]
        sources[5] = random_tensor([700, 300], torch.bfloat16, gen).t()
        offsets, end = layout_of([s.numel() for s in sources], [(-i) % 8 for i in range(len(sources))])
        jobs.append((sources, offsets, end, reference_layout(sources, offsets, end, torch.bfloat16)))
    torch.cuda.synchronize()

    def work(t):
        sources, offsets, end, expected = jobs[t]
        stream = torch.cuda.Stream()
        other = torch.cuda.Stream()
        for i in range(20):
            with torch.cuda.stream(stream):
                out = torch.full((end,), float("nan"), dtype=torch.bfloat16, device="cuda")
                plan = pack_plan(out, sources, offsets)
            with torch.cuda.stream(other if i % 2 else stream):  # odd rounds: launched on another stream
                if i % 2:
                    other.wait_stream(stream)
                plan.launch()
                torch.cuda.current_stream().synchronize()
            assert torch.equal(bits(out), bits(expected)), (t, i)

    run_in_threads(work, 2)


# ---------------------------------------------------------------------------------------------
# Large sizes, on the GPU only.


@pytest.mark.gpu
def test_gpu_past_2_pow_31_int8_elements():
    n = 2**31 + 4099
    src = torch.randint(-128, 127, (n,), dtype=torch.int8, device="cuda")
    dst = torch.empty(n + 64, dtype=torch.int8, device="cuda")
    dst.fill_(0x5A)
    pack(dst, [src], [17])
    assert torch.equal(dst[17:17 + n], src)
    assert bool((dst[:17] == 0).all()) and bool((dst[17 + n:] == 0).all())
    window = torch.empty(5000, dtype=torch.int8, device="cuda")  # ends inside src
    w0 = 2**31 - 1000
    pack(window, [src], [17], window=(w0, w0 + window.numel()))
    assert torch.equal(window, src[w0 - 17:w0 - 17 + window.numel()])
    del src, dst


@pytest.mark.gpu
def test_gpu_ten_thousand_tensors():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 5000, (10_000,), generator=gen).tolist()
    sources = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes]
    offsets, end = layout_of(sizes, [(-i) % 8 for i in range(10_000)])
    flat = torch.full((end + 7,), float("nan"), dtype=torch.bfloat16, device="cuda")
    pack(flat, sources, offsets)
    assert torch.equal(bits(flat), bits(reference_layout(sources, offsets, end + 7, torch.bfloat16)))


@pytest.mark.gpu
def test_gpu_transposed_large():
    src = torch.randn(4096, 3000, device="cuda").to(torch.bfloat16).t()
    out = torch.empty(src.numel(), dtype=torch.bfloat16, device="cuda")
    copy_chunk(src, out)
    assert torch.equal(bits(out), bits(src))
    part = torch.empty(1_000_003, dtype=torch.bfloat16, device="cuda")
    copy_chunk(src, part, 777_777, part.numel())
    assert torch.equal(bits(part), bits(src.reshape(-1)[777_777:777_777 + part.numel()]))


# --------------------------------------------------------------------------------------------
# The planner's common-case reads (a few comprehensions) and its piece-at-a-time loop must agree.


def _sources_equal(a, b) -> bool:
    return all(bool((getattr(a, f) == getattr(b, f)).all()) for f in
               ("start", "count", "offset", "numel", "lo", "hi", "contiguous", "local"))


@given(st.data())
@FAST
def test_common_case_reads_what_the_loop_reads(data):
    """Contiguous sources of dst's dtype with plain int ranges: the vectorised reads give the same
    columns as the one-piece-at-a-time loop, for any sizes, views into one buffer, params and empties."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool]))
    numels = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
    base = random_tensor([sum(numels) + 3], dtype)
    pieces, at = [], 0
    for k, n in enumerate(numels):
        src = base.narrow(0, at, n)
        if k % 3 == 1:
            src = torch.nn.Parameter(src.clone(), requires_grad=False)
        start = data.draw(st.integers(0, n))
        count = data.draw(st.integers(0, n - start))
        pieces.append((src, start, count, 2 * at))
        at += n
    dst = poisoned(2 * at + 1, dtype)
    common = validation._gather_common(pieces, dst, True)
    assert common is not None
    assert _sources_equal(common, validation._gather_each(pieces, dst, True, "sources"))


@pytest.mark.parametrize("case", ["strided", "numpy int", "bool count", "other dtype", "complex", "not a tuple",
                                  "five fields", "not a tensor", "meta", "huge offset"])
def test_common_case_steps_aside_for_anything_else(case):
    """Every piece that is not the plain case sends the whole call through the loop (which checks it,
    and names it if it is wrong); the plain reads never accept what the loop would refuse."""
    dst = torch.zeros(64)
    good = (torch.arange(8.0), 0, 8, 0)
    bad = {
        "strided": (torch.arange(16.0)[::2], 0, 8, 8),
        "numpy int": (torch.arange(8.0), 0, __import__("numpy").int64(8), 8),
        "bool count": (torch.arange(8.0), 0, True, 8),
        "other dtype": (torch.arange(8, dtype=torch.int32), 0, 8, 8),
        "complex": None,
        "not a tuple": [torch.arange(8.0), 0, 8, 8],
        "five fields": (torch.arange(8.0), 0, 8, 8, 0),
        "not a tensor": ("tensor", 0, 8, 8),
        "meta": (torch.empty(8, device="meta"), 0, 8, 8),
        "huge offset": (torch.arange(8.0), 0, 8, 2**63 - 1),
    }[case]
    if case == "complex":  # 16-byte elements move as word pairs: always the loop
        complex_piece = (torch.zeros(8, dtype=torch.complex64), 0, 8, 0)
        assert validation._gather_common([complex_piece], torch.zeros(64, dtype=torch.complex64), True) is None
        return
    assert validation._gather_common([good, good[:3] + (16,)], dst, True) is not None
    assert validation._gather_common([good, bad], dst, True) is None
    if case in ("strided", "numpy int"):  # fine pieces, just not the plain case
        assert validation.validate(dst, [good, bad])[0].count.tolist() == [8, 8]
    else:
        with pytest.raises((TypeError, ValueError)):
            validation.validate(dst, [good, bad])


def test_plain_slices_are_taken_as_they_are_and_others_checked():
    """pack_slices' common case (4-tuples of a source and ints) is taken whole; a numpy count, a list, or an
    out-of-range int goes through the checks, which name it."""
    dst = torch.zeros(16)
    src = torch.arange(8.0)
    pieces, zeros = slices_to_pieces(dst, [(src, 0, 4, 0), (src, 4, 4, 8)])
    assert list(pieces) == [(src, 0, 4, 0), (src, 4, 4, 8)] and zeros.tolist() == [[4, 4], [12, 4]]
    import numpy as np
    pieces, _ = slices_to_pieces(dst, [(src, 0, np.int64(4), 0)])
    assert type(pieces[0][2]) is int
    with pytest.raises(ValueError, match=r"slices\[1\] offset"):
        slices_to_pieces(dst, [(src, 0, 4, 0), (src, 0, 4, 2**63)])
    with pytest.raises(TypeError, match=r"slices\[0\] count"):
        slices_to_pieces(dst, [(src, 0, 4.0, 0)])


def test_reference_copy_of_a_source_that_requires_grad_is_not_recorded():
    """torch_pack reads params as they are, like the kernels: the destination neither requires grad nor
    holds an autograd history afterwards."""
    param = torch.nn.Parameter(torch.arange(6.0))
    dst = torch.zeros(8)
    torch_pack(dst, [param], [1])
    assert not dst.requires_grad and dst.grad_fn is None
    assert torch.equal(dst, torch.tensor([0.0, 0, 1, 2, 3, 4, 5, 0]))


@pytest.mark.parametrize("impl", [pack, torch_pack])
def test_lazily_negated_views_refused(impl):
    """``c.conj().imag`` is a float view with the negative bit: its memory holds the other sign. Copying its
    bits would write -x; both paths refuse it, naming the fix, and write nothing."""
    c = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64, device=DEVICE)
    negated = c.conj().imag
    assert negated.is_neg() and negated.dtype == torch.float32
    dst = poisoned(4, torch.float32)
    before = dst.clone()
    with pytest.raises(ValueError, match="resolve_neg"):
        impl(dst, [negated], [0])
    assert torch.equal(bits(dst), bits(before))
    impl(dst, [negated.resolve_neg()], [0])
    assert torch.equal(dst[:2], torch.tensor([-2.0, -4.0], device=DEVICE))


def test_int64_min_is_out_of_range_not_wrapped():
    """-2**63 fits an int64 but abs() of it wraps to itself: the range checks compare both bounds."""
    dst = torch.zeros(16)
    with pytest.raises(ValueError, match=r"slices\[0\] count.*out of range"):
        slices_to_pieces(dst, [(torch.arange(8.0), 0, -2**63, 0)])
    assert validation._gather_common([(torch.arange(8.0), 0, -2**63, 0)], dst, True) is None


def test_byte_extents_is_byte_extent_of_each():
    """The batched extents equal the one-at-a-time ones for contiguous, strided, transposed, offset, expanded
    and empty views."""
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    views = [base, base[2:5], base[:, ::2], base.t(), base[3, 1:], base[:0], base[0:1, 0:1].expand(4, 4),
             base.reshape(-1)[7:19]]
    lo, hi = byte_extents(views)
    assert [(int(a), int(b)) for a, b in zip(lo, hi)] == [byte_extent(v) for v in views]


def test_each_reads_through_a_subclass_s_own_method():
    """checks.each maps torch.Tensor's method over tensors whose types inherit it (Parameters), but calls a
    subclass's own override where one type has it: the fast path never skips a method a user's class defines."""
    from ztriton.kernels.checks import each

    class Counted(torch.Tensor):
        def numel(self):
            return -1

    plain = [torch.zeros(3), torch.nn.Parameter(torch.zeros(5))]
    assert each("numel", plain) == [3, 5]
    odd = plain + [torch.zeros(7).as_subclass(Counted)]
    assert each("numel", odd) == [3, 5, -1]
    assert each("data_ptr", odd) == [t.data_ptr() for t in odd]


@FAST
@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.bool, torch.uint8, torch.float64]))
def test_torch_copies_take_pieces_side_by_side_in_one_storage_as_one_copy(data, dtype):
    """Pieces that continue each other in one storage and in dst (a defragment's partitions in their module's
    buffer) are copied as one run, the same bits as the kernels write; pieces of another storage, out of order
    or with a gap between them are not merged."""
    from ztriton.kernels import Piece, Tuning, make_plan

    buffers = [random_tensor([data.draw(st.integers(1, 64))], dtype) for _ in range(data.draw(st.integers(1, 3)))]
    slices = []
    for buffer in buffers:
        cut, end = data.draw(st.integers(0, buffer.numel() - 1)), buffer.numel()
        while cut < end:  # consecutive slices of the buffer, sometimes a gap between them
            n = data.draw(st.integers(1, end - cut))
            slices.append(buffer[cut:cut + n])
            cut += n + data.draw(st.sampled_from([0, 0, 0, 1]))
    if data.draw(st.booleans()):
        slices.reverse()  # dst order against storage order: no run
    pieces, at = [], data.draw(st.integers(0, 3))
    for src in slices[:16]:  # sometimes a gap in dst
        pieces.append(Piece(src, 0, src.numel(), at))
        at += src.numel() + data.draw(st.sampled_from([0, 0, 0, 1]))
    gaps = uncovered([(p.offset, p.offset + p.count) for p in pieces], 0, at)
    own = data.draw(st.sampled_from([1, Tuning().own_copy_bytes]))
    by_torch, by_kernels = poisoned(at, dtype), poisoned(at, dtype)
    torch_plan = make_plan(by_torch, pieces, gaps, tuning=Tuning(own_copy_bytes=own, foreach_from=0, cat_items=0))
    assert torch_plan.torch_copies and not torch_plan.launches
    continues = [a.src.untyped_storage().data_ptr() == b.src.untyped_storage().data_ptr()
                 and a.src.storage_offset() + a.count == b.src.storage_offset() and a.offset + a.count == b.offset
                 for a, b in zip(pieces, pieces[1:])]
    copies = len(torch_plan.copies) + sum(len(outs) for outs, _ in torch_plan.batches)
    assert copies == len(pieces) - sum(continues), "each run of continuing pieces should be one copy"
    torch_plan.launch()
    make_plan(by_kernels, pieces, gaps, tuning=Tuning(torch_pieces=0)).launch()
    assert torch.equal(bits(by_torch), bits(by_kernels))


def test_torch_copies_never_merge_pieces_of_two_storages():
    """Piece 2 starts, in its own storage, where piece 1 ends in another's: not a run (each storage copied
    apart), whatever their positions in dst."""
    from ztriton.kernels import Piece, make_plan

    a, b = torch.arange(8.0), torch.arange(100.0, 108.0)
    dst = torch.zeros(8)
    make_plan(dst, [Piece(a, 0, 4, 0), Piece(b, 4, 4, 4)]).launch()
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0, 104.0, 105.0, 106.0, 107.0]


def test_torch_copies_merge_a_run_only_inside_its_first_storage():
    """Two tensors whose memory continues one another from the same address but whose storages differ in size
    (one made over the other's memory): a run view of the smaller storage would reach past it, so the pieces
    are copied one by one; two slices of one tensor are one copy."""
    import numpy as np

    from ztriton.kernels import Piece, Tuning, make_plan

    memory = np.arange(16, dtype=np.float32)
    short = torch.from_numpy(memory[:8])  # a storage of 8 elements
    rest = torch.from_numpy(memory)[8:]  # the same first address, a storage of 16
    dst = torch.zeros(16)
    plan = make_plan(dst, [Piece(short, 0, 8, 0), Piece(rest, 0, 8, 8)], tuning=Tuning(cat_items=0))
    assert sum(len(outs) for outs, _ in plan.batches) + len(plan.copies) == 2
    plan.launch()
    assert dst.tolist() == list(range(16))
    dst.zero_()
    whole = torch.from_numpy(memory)
    plan = make_plan(dst, [Piece(whole[:5], 0, 5, 0), Piece(whole[5:], 0, 11, 5)], tuning=Tuning(cat_items=0))
    assert sum(len(outs) for outs, _ in plan.batches) + len(plan.copies) == 1
    plan.launch()
    assert dst.tolist() == list(range(16))


def test_torch_copies_view_words_only_at_word_addresses():
    """A storage may start at any address (one imported through DLPack, a numpy buffer at an odd byte): its
    pieces, and a dst there, move as bytes, never as integer words at a misaligned address (CUDA's vector loads
    in _foreach_copy_ fail on those); the bits still land."""
    import numpy as np

    from ztriton.kernels import Piece, Tuning, make_plan

    # 200 bytes at an odd address: by its storage offset (0) and size alone it would look word-aligned
    odd = torch.from_numpy(np.frombuffer(bytearray([255] + list(range(200))), dtype=np.uint8, offset=1))
    assert odd.data_ptr() % 2 == 1 and odd.storage_offset() == 0 and odd.numel() == 200
    for dst in (torch.zeros(64, dtype=torch.uint8), torch.from_numpy(np.frombuffer(bytearray(65), np.uint8, offset=1))):
        for own in (1, Tuning().own_copy_bytes):
            plan = make_plan(dst, [Piece(odd, 0, 32, 0), Piece(odd, 40, 32, 32)],
                             tuning=Tuning(own_copy_bytes=own, foreach_from=0, cat_items=0))
            views = [t for out, src in plan.copies for t in (out, src)] + \
                [t for outs, srcs in plan.batches for t in outs + srcs]
            assert views and all(t.data_ptr() % t.element_size() == 0 for t in views), \
                [(t.dtype, t.data_ptr() % 8) for t in views]
            dst.fill_(0)
            plan.launch()
            assert dst.tolist() == list(range(0, 32)) + list(range(40, 72))


def test_torch_copies_issued_as_planned_go_in_batches(monkeypatch):
    """Under run_now, torch's route issues a _foreach_copy_ each time Tuning.batch_pieces pieces of one width are
    ready (the device starts while the host still makes views), and the bytes are those of one call at the end."""
    from ztriton.kernels import Tuning, make_plan
    from ztriton.kernels.pieces import pack_pieces

    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda outs, srcs: (calls.append(len(outs)), real(outs, srcs)))
    gen = torch.Generator().manual_seed(3)
    sources = [random_tensor([int(n)], torch.float32, gen) for n in torch.randint(1, 9, (150,), generator=gen)]
    offsets, end = layout_of([s.numel() for s in sources], [2] * len(sources))
    flat = poisoned(end, torch.float32)
    tuning = Tuning(torch_pieces=1000, batch_pieces=64, foreach_from=0, cat_items=0)
    assert make_plan(flat, *pack_pieces(flat, sources, offsets), tuning=tuning, run_now=True).launches == []
    assert sum(calls) == 150 and calls[:2] == [64, 64], calls
    assert torch.equal(bits(flat), bits(reference_layout(sources, offsets, end, torch.float32)))
    calls.clear()
    later = poisoned(end, torch.float32)
    make_plan(later, *pack_pieces(later, sources, offsets), tuning=tuning).launch()  # planned first: one call
    assert calls == [150] and torch.equal(bits(later), bits(flat))


def test_torch_copies_one_per_piece_and_zero_per_gap_up_to_foreach_from(monkeypatch):
    """Up to Tuning.foreach_from pieces (gaps), torch's route gives each its own copy_ (zero_): a process's first
    _foreach_copy_ loads a CUDA kernel (17-22 ms on the H200, session 11), a copy_ of contiguous bytes is a memcpy.
    Above it, small pieces share _foreach_copy_ calls and the gaps one _foreach_zero_. The same bytes either way."""
    from ztriton.kernels import Tuning, make_plan
    from ztriton.kernels.pieces import pack_pieces

    calls = []
    for name in ("_foreach_copy_", "_foreach_zero_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *args, _name=name, _real=real: (calls.append(_name), _real(*args)))
    gen = torch.Generator().manual_seed(5)
    sources = [random_tensor([int(n)], torch.float32, gen) for n in torch.randint(1, 9, (40,), generator=gen)]
    offsets, end = layout_of([s.numel() for s in sources], [1] * len(sources))  # a gap after each piece
    expected = reference_layout(sources, offsets, end, torch.float32)
    for foreach_from, foreach_calls in ((40, []), (39, ["_foreach_copy_", "_foreach_zero_"])):
        flat = poisoned(end, torch.float32)
        plan = make_plan(flat, *pack_pieces(flat, sources, offsets), tuning=Tuning(
            torch_pieces=1000, foreach_from=foreach_from, cat_items=0))
        assert len(plan.copies) == (40 if foreach_from == 40 else 0) and plan.zero_each == (foreach_from == 40)
        calls.clear()
        plan.launch()
        assert calls == foreach_calls, (foreach_from, calls)
        assert torch.equal(bits(flat), bits(expected))


@pytest.fixture
def cat_calls(monkeypatch) -> list[int]:
    """The number of inputs of each torch.cat call made while the test runs (torch's route joins runs with it)."""
    calls, real = [], torch.cat
    monkeypatch.setattr(torch, "cat", lambda inputs, **kw: (calls.append(len(inputs)), real(inputs, **kw))[1])
    return calls


def test_torch_copies_join_pieces_side_by_side_in_one_cat(cat_calls):
    """Pieces and gaps that tile a span of dst go through one torch.cat(out=) of their sources and zeros (one call of
    host time for all of them: session 11's fresh-process flatten); a piece whose source is not word-aligned breaks
    the span (its bytes cannot share the cat's integer words), a piece apart from the others is copied alone. The
    bits are those of the kernels."""
    import numpy as np

    from ztriton.kernels import Piece, Tuning, make_plan

    cats = cat_calls
    gen = torch.Generator().manual_seed(9)
    a, b, c, d = (random_tensor([n], torch.float32, gen) for n in (6, 4, 8, 2))
    odd = torch.from_numpy(np.frombuffer(bytearray(41), dtype=np.uint8, offset=1).copy())  # a word-aligned copy
    unaligned = torch.from_numpy(np.frombuffer(bytearray(range(41)), dtype=np.uint8, offset=1)).view(torch.uint8)
    cases = [
        # a, a gap of 2, b, c side by side: one cat of 4 inputs; d apart (a hole before it): its own copy
        ([Piece(a, 0, 6, 0), Piece(b, 0, 4, 8), Piece(c, 0, 8, 12), Piece(d, 0, 2, 30)], [(6, 2)], [4]),
        # two spans split by a hole: two cats
        ([Piece(a, 0, 6, 0), Piece(b, 0, 4, 6), Piece(c, 0, 8, 20), Piece(d, 0, 2, 28)], [], [2, 2]),
    ]
    for pieces, gaps, expected in cases:
        by_torch = poisoned(40, torch.float32)
        by_kernels = poisoned(40, torch.float32)
        cats.clear()
        make_plan(by_torch, pieces, gaps, tuning=Tuning(torch_pieces=16)).launch()
        assert cats == expected, (cats, expected)
        make_plan(by_kernels, pieces, gaps, tuning=Tuning(torch_pieces=0)).launch()
        assert torch.equal(bits(by_torch), bits(by_kernels))
    # bytes at an odd address between word-aligned neighbours: not joined (the two others are not side by side
    # any more), each copied alone; the bits still land
    dst = torch.zeros(40, dtype=torch.uint8)
    cats.clear()
    pieces = [Piece(odd, 0, 8, 0), Piece(unaligned, 0, 8, 8), Piece(odd, 8, 8, 16)]
    make_plan(dst, pieces, tuning=Tuning(torch_pieces=16)).launch()
    assert cats == [] and unaligned.data_ptr() % 2 == 1
    assert dst[:24].tolist() == odd[:8].tolist() + unaligned[:8].tolist() + odd[8:16].tolist()


def test_torch_copies_join_only_short_gaps_into_a_cat(monkeypatch, cat_calls):
    """A gap joins a cat as a view of one zero buffer, device memory beside dst: only gaps up to
    Tuning.cat_gap_bytes do (pads); a longer one (the evict tier's evicted params, session 11's failing peak-memory
    test) is zeroed apart and splits the span, so no buffer as long as it is allocated."""
    from ztriton.kernels import Piece, Tuning, make_plan

    cats, zeros_made = cat_calls, []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: (zeros_made.append(a), real_zeros(*a, **kw))[1])
    gen = torch.Generator().manual_seed(11)
    a, b, c = (random_tensor([n], torch.float32, gen) for n in (6, 4, 8))
    for gap, expected_cats in ((4, [4]), (5, [2])):  # 16 bytes join; 20 bytes (over the limit below) do not
        pieces = [Piece(a, 0, 6, 0), Piece(b, 0, 4, 6 + gap), Piece(c, 0, 8, 10 + gap)]
        by_torch, by_kernels = poisoned(18 + gap, torch.float32), poisoned(18 + gap, torch.float32)
        cats.clear()
        zeros_made.clear()
        plan = make_plan(by_torch, pieces, [(6, gap)], tuning=Tuning(torch_pieces=16, cat_gap_bytes=16))
        assert cats == [] and len(plan.fills) == (gap == 5)
        # the zero buffer goes with the tables: a launch on another stream waits for it and keeps it alive
        assert [t.numel() for t in plan.tables] == ([2] if gap == 4 else []), plan.tables
        plan.launch()
        assert cats == expected_cats and len(zeros_made) == (gap == 4), (gap, cats, zeros_made)
        make_plan(by_kernels, pieces, [(6, gap)], tuning=Tuning(torch_pieces=0)).launch()
        assert torch.equal(bits(by_torch), bits(by_kernels))


def test_torch_copies_join_only_sources_on_dsts_device(monkeypatch, cat_calls):
    """A run whose source is not on dst's device (a host source of a device dst: torch.cat would first move it to
    the device whole) never joins a cat: it splits the span and is copied alone. On the CPU box every source is on
    dst's device, so the run's flag is set here by hand."""
    from ztriton.kernels import Piece, Tuning, make_plan

    cats, real_runs = cat_calls, torch_route._copy_runs

    def second_run_elsewhere(*args):
        runs = real_runs(*args)
        runs.local[1] = False
        return runs

    monkeypatch.setattr(torch_route, "_copy_runs", second_run_elsewhere)
    gen = torch.Generator().manual_seed(13)
    a, b, c = (random_tensor([n], torch.float32, gen) for n in (6, 4, 8))
    pieces = [Piece(a, 0, 6, 0), Piece(b, 0, 4, 6), Piece(c, 0, 8, 10)]
    by_torch, by_kernels = poisoned(18, torch.float32), poisoned(18, torch.float32)
    plan = make_plan(by_torch, pieces, tuning=Tuning(torch_pieces=16))
    assert len(plan.copies) == 3
    plan.launch()
    assert cats == []
    make_plan(by_kernels, pieces, tuning=Tuning(torch_pieces=0)).launch()
    assert torch.equal(bits(by_torch), bits(by_kernels))


def _odd_stride_views(dtype):
    """Tensors torch calls contiguous whose strides are not a new tensor's: 1-element slices, size-1 dims."""
    base = random_tensor((64,), dtype, torch.Generator().manual_seed(31))
    return [base[3::2][:1], base.view(8, 8)[:, :1][5:6], base.view(4, 16)[1:2, 2:9], base[40:41].view(1, 1, 1),
            base.as_strided((1, 3), (7, 1), 20)]


@pytest.mark.parametrize("route", ["kernels", "torch_copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pack_takes_contiguous_tensors_with_odd_strides_on_size_one_dims(route, dtype):
    """Sources and a destination that are contiguous by torch's rule but not of stride 1 (a dtype view of them
    fails): the same bytes as the reference, on both routes."""
    sources = _odd_stride_views(dtype)
    assert all(s.is_contiguous() for s in sources)
    offsets = [0, 2, 5, 13, 16]
    want = torch_pack(poisoned(24, dtype), sources, offsets)
    assert torch.equal(bits(pack(poisoned(24, dtype), sources, offsets)), bits(want))
    dst = poisoned(72, dtype)[7::3][:1]  # one element, stride 3
    assert dst.is_contiguous() and dst.stride() == (3,)
    pack(dst, [sources[0]], [0])
    assert torch.equal(bits(dst), bits(sources[0]))


@FAST
@given(data=st.data())
def test_the_plan_of_aligned_segments_is_the_general_plan(data):
    """Segments whose addresses all divide by 16 take a shortcut (no heads: a body of 16-byte words and a tail
    in the class of its length): the same classes, tables, rows and programs as the general cut into heads,
    bodies and tails, zero fills and empty segments among them."""
    from ztriton.kernels import tables

    n = data.draw(st.integers(0, 40))
    base = 16 * data.draw(st.integers(1, 1 << 20))
    src = 16 * np.array(data.draw(st.lists(st.integers(0, 1 << 30), min_size=n, max_size=n)), dtype=np.int64)
    src[np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)] = 0  # zero fills
    dst = base + 16 * np.array(data.draw(st.lists(st.integers(0, 1 << 30), min_size=n, max_size=n)), dtype=np.int64)
    nbytes = np.array(data.draw(st.lists(st.integers(0, 1 << 16), min_size=n, max_size=n)), dtype=np.int64)
    if data.draw(st.booleans()):
        nbytes = nbytes * 16  # no tails
    program_bytes = data.draw(st.sampled_from([1024, 32 * 1024]))
    short = tables._word_classes(src, dst, nbytes, base, program_bytes)
    general = tables._mixed_word_classes(src, dst, nbytes, base, program_bytes)
    assert [(c.unit, c.at, c.rows, c.programs) for c in short] == [(c.unit, c.at, c.rows, c.programs) for c in general]
    assert all(np.array_equal(a.table, b.table) for a, b in zip(short, general))


def test_each_int64_reads_through_a_subclass_s_own_method():
    from ztriton.kernels.checks import each_int64

    class Counted(torch.Tensor):
        def numel(self):
            return -1

    plain = [torch.zeros(3), torch.nn.Parameter(torch.zeros(5))]
    got = each_int64("numel", plain)
    assert got.dtype == np.int64 and got.tolist() == [3, 5]
    assert each_int64("numel", plain + [torch.zeros(7).as_subclass(Counted)]).tolist() == [3, 5, -1]


def test_a_pack_s_pieces_with_other_zero_ranges_are_still_checked_for_overlap():
    """pack_pieces' pieces skip the overlap check only with none or their own gaps as zero ranges: any other zero
    range overlapping a piece is refused, before anything is written."""
    from ztriton.kernels import make_plan
    from ztriton.kernels.pieces import known_disjoint, pack_pieces

    sources = [torch.arange(4.0), torch.arange(3.0)]
    dst = torch.full((10,), 7.0)
    pieces, gaps = pack_pieces(dst, sources, [0, 6])
    assert known_disjoint(pieces, gaps) and known_disjoint(pieces.take(np.array([1]), distinct=True), gaps)
    assert known_disjoint(pieces, gaps[:0]) and not known_disjoint(pieces, gaps.copy())
    with pytest.raises(ValueError, match=r"sources\[0\].*a pad range.*overlap"):
        make_plan(dst, pieces, np.array([[2, 3]], dtype=np.int64))
    twice = pieces.take(np.array([0, 0]))  # not known distinct: a piece taken twice overlaps itself
    assert not known_disjoint(twice, gaps)
    with pytest.raises(ValueError, match=r"sources\[0\].*sources\[1\].*overlap"):
        make_plan(dst, twice)
    with pytest.raises(ValueError, match=r"zero range 0.*out of range"):  # an end past int64 is refused
        make_plan(dst, pieces, np.array([[2**62, 2**62]], dtype=np.int64))
    assert bool((dst == 7.0).all())
