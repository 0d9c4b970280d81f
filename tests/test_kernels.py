"""Kernels against the torch reference (``ztriton.kernels.reference``, also the entry points'
fallback), compared on the bytes; the reference itself against ``torch.cat`` constructions.

Every destination is poisoned first, so a test sees both that each element in range was written and
that nothing outside it was. On CPU the kernels run under the Triton interpreter: sizes stay small.
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ztriton.kernels import bits, copy_chunk, pack, pack_slices, torch_copy_chunk, torch_pack, torch_pack_slices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float64]
# ZT_EXAMPLES raises the example count for a longer local run.
FAST = settings(max_examples=int(os.environ.get("ZT_EXAMPLES", 40)), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_tensor(shape, dtype, generator=None) -> torch.Tensor:
    """Random bit patterns of any dtype: raw bytes viewed as ``dtype`` (NaNs included)."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape).to(DEVICE)


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
        meta = torch.empty(4, device="meta")
        with pytest.raises(ValueError, match=r"sources\[0\] is on meta but dst is on cpu"):
            pack(poisoned(4, torch.float32), [meta], [0])
    else:
        with pytest.raises(ValueError, match=r"sources\[0\] is on cpu but dst is on cuda"):
            pack(poisoned(4, torch.float32), [torch.ones(4)], [0])


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
