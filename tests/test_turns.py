"""A copy into a fresh buffer in turns (``kernels/turns.py``): the same bytes and the same errors as one
plan, what no turn can check alone checked before the first write, the sources never written.

On CPU the kernels run under the Triton interpreter: sources stay a few elements each.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ztriton.kernels import bits, pack, pack_slices, torch_pack, torch_pack_slices
from ztriton.kernels import plan as plan_module
from ztriton.kernels import turns as turns_module
from ztriton.kernels.turns import FIRST_TURN, turns

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@given(n=st.integers(0, 3000), first=st.integers(1, 100), last=st.integers(1, 700))
@settings(max_examples=60, deadline=None)
def test_turns_cover_every_index_once_in_order(n, first, last):
    spans = list(turns(n, first, last))
    assert [i for a, b in spans for i in range(a, b)] == list(range(n))
    full, size = [], first  # each turn twice the one before, from first, at most last; the final one what is left
    while sum(full) < n:
        full.append(size)
        size = min(last, 2 * size)
    assert [b - a for a, b in spans][:-1] == full[:-1]


def sources_of(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """``n`` sources of 1-9 elements of random bits (raw bool bytes too), some 2-D, some views at an offset."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        numel = int(torch.randint(1, 10, (), generator=g))
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, ((numel + 1) * itemsize,), dtype=torch.uint8, generator=g).view(dtype).to(DEVICE)
        src = raw[1:] if k % 3 == 0 else raw[:numel]  # every third one starts one element into its storage
        out.append(src.view(1, numel) if k % 5 == 0 else src)
    return out


@pytest.fixture(params=["kernels", "torch_copies"])
def route(request, monkeypatch):
    """Each turn planned for the kernels (CPU under the interpreter counts as loaded), or for torch's copies as
    in a process that has not loaded the kernels yet."""
    if request.param == "torch_copies":
        monkeypatch.setattr(plan_module, "kernels_loaded", lambda device: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float32])
@pytest.mark.parametrize("window", [None, (37, 900)])
def test_fresh_pack_is_the_pack(route, dtype, window):
    sources = sources_of(3 * FIRST_TURN + 5, dtype, seed=7)
    offsets, at = [], 3
    for s in sources:
        offsets.append(at)
        at += s.numel() + 2  # a gap after each source: zeroed by the first turn
    numel = at if window is None else window[1] - window[0]
    expected = torch.empty(numel, dtype=dtype, device=DEVICE)
    pack(expected, sources, offsets, window)  # one plan: every source checked before the first byte moves
    if dtype != torch.bool:  # the reference writes bool bytes as 0/1, the kernels keep raw ones
        reference = torch.empty_like(expected)
        torch_pack(reference, sources, offsets, window)
        assert torch.equal(bits(reference), bits(expected))
    before = [bits(s).clone() for s in sources]
    got = torch.full((numel * expected.element_size(),), 0xA5, dtype=torch.uint8, device=DEVICE).view(dtype)
    pack(got, sources, offsets, window, fresh=True)
    assert torch.equal(bits(got), bits(expected))
    assert all(torch.equal(bits(s), b) for s, b in zip(sources, before))


def test_fresh_pack_slices_is_pack_slices(route):
    sources = sources_of(2 * FIRST_TURN + 1, torch.bfloat16, seed=3)
    slices, at = [], 0
    for s in sources:
        count = max(0, s.numel() - 1)
        slices.append((s, 1 if count else 0, count, at))
        at += count + 1
    expected = torch.empty(at + 4, dtype=torch.bfloat16, device=DEVICE)
    torch_pack_slices(expected, slices)
    got = torch.full_like(expected, float("nan"))
    pack_slices(got, slices, fresh=True)
    assert torch.equal(bits(got), bits(expected))


def test_each_turn_is_one_plan_and_the_first_starts_small(monkeypatch):
    """The copy really goes in turns: the first plan holds FIRST_TURN pieces, the ones after more each."""
    sizes = []
    real = turns_module.make_plan

    def counting(dst, pieces, *args, **kwargs):
        sizes.append(len(pieces))
        return real(dst, pieces, *args, **kwargs)

    monkeypatch.setattr(turns_module, "make_plan", counting)
    sources = sources_of(4 * FIRST_TURN, torch.float32, seed=1)  # turns of FIRST_TURN, twice that, the rest
    offsets = [10 * k for k in range(len(sources))]
    pack(torch.empty(10 * len(sources), device=DEVICE), sources, offsets, fresh=True)
    assert sizes == [FIRST_TURN, 2 * FIRST_TURN, FIRST_TURN]


def test_a_bad_source_in_a_late_turn_is_named_by_its_index_and_no_source_changes():
    sources = sources_of(4 * FIRST_TURN, torch.float32, seed=5)
    bad = 3 * FIRST_TURN + 7  # in the third turn: [3, 4) x FIRST_TURN
    assert [a for a, b in turns(len(sources)) if a <= bad < b] == [3 * FIRST_TURN]
    sources[bad] = sources[bad].to(torch.float64)
    offsets = [10 * k for k in range(len(sources))]
    before = [bits(s).clone() for s in sources]
    with pytest.raises(TypeError) as whole:
        pack(torch.empty(10 * len(sources), device=DEVICE), sources, offsets)
    with pytest.raises(TypeError) as in_turns:
        pack(torch.empty(10 * len(sources), device=DEVICE), sources, offsets, fresh=True)
    assert f"sources[{bad}]" in str(in_turns.value)
    assert str(in_turns.value) == str(whole.value)
    assert all(torch.equal(bits(s), b) for s, b in zip(sources, before))


def test_destinations_overlapping_across_turns_are_refused_before_any_write():
    """Slices 3 (first turn) and 200 (second) overlap in dst: no single turn sees both, the whole job's check
    does, before the first byte is written."""
    sources = sources_of(3 * FIRST_TURN + 10, torch.float32, seed=9)
    slices = [(s, 0, s.numel(), 16 * k) for k, s in enumerate(sources)]
    assert [a for a, b in turns(len(slices)) if a <= 200 < b] == [FIRST_TURN]
    slices[200] = (sources[200], 0, 1, slices[3][3])
    dst = torch.full((16 * len(sources),), 7.0, device=DEVICE)
    with pytest.raises(ValueError, match=r"slices\[3\].*slices\[200\].*overlap"):
        pack_slices(dst, slices, fresh=True)
    assert bool((dst == 7.0).all())


def test_each_pad_goes_with_the_turn_of_the_piece_before_it_so_a_turn_tiles_one_span():
    """With the sources laid out in order, a turn's pieces and the pads after them cover one span of dst, so
    torch's route cuts that turn's views with one split; a pad before every piece goes with the first turn."""
    sources = sources_of(3 * FIRST_TURN + 5, torch.float32, seed=11)
    offsets, at = [], 3
    for s in sources:
        offsets.append(at)
        at += s.numel() + 2
    dst = torch.empty(at, device=DEVICE)
    pieces, zeros = plan_module.pack_pieces(dst, sources, offsets)
    spans = list(turns(len(pieces)))
    turn_of = turns_module._turn_of_each_zero_range(pieces, zeros, spans)
    assert turn_of[0] == 0 and zeros[0, 0] == 0  # the pad before the first source
    for t, (a, b) in enumerate(spans):
        mine = zeros[turn_of == t]
        segments = sorted([(int(o), int(c)) for o, c in zip(pieces.offset[a:b], pieces.count[a:b])] +
                          [(int(o), int(c)) for o, c in mine])
        assert all(o2 == o1 + c1 for (o1, c1), (o2, _) in zip(segments, segments[1:])), f"turn {t} leaves a hole"
    assert set(turn_of.tolist()) <= set(range(len(spans)))


@pytest.mark.parametrize("segments, gaps", [
    ([(4, 3), (10, 2)], [(7, 3)]),  # tile [4, 12): one split
    ([(4, 3)], [(10, 2)]),  # a hole at 7: a narrow each
    ([(0, 16)], []),  # all of out
    ([], []),
])
def test_cut_gives_the_views_narrow_would(segments, gaps):
    out = torch.arange(16)
    views = plan_module._cut(out, segments, gaps)
    expected = [out.narrow(0, o, c) for o, c in segments + gaps]
    assert [(v.data_ptr(), v.numel()) for v in views] == [(e.data_ptr(), e.numel()) for e in expected]


@pytest.mark.parametrize("case", ["bad dtype beside an overlap", "past dst's end and overlapping"])
def test_a_job_with_several_faults_gets_the_error_one_plan_gives(case):
    """The whole job's overlap check runs before any turn; when it fails, the error is still the one a single
    plan raises first (types before ranges before overlaps), and nothing is written."""
    sources = [torch.arange(4, dtype=torch.float32, device=DEVICE) + k for k in range(2 * FIRST_TURN)]
    slices = [(s, 0, 4, 8 * k) for k, s in enumerate(sources)]
    size = 8 * len(sources)
    if case == "bad dtype beside an overlap":
        slices[150] = (sources[150].double(), 0, 4, slices[150][3])
        slices[20] = (sources[20], 0, 4, slices[10][3])
    else:
        slices[150] = (sources[150], 0, 4, size + 2)
        slices[151] = (sources[151], 0, 4, size)
    errors = []
    for fresh in (False, True):
        dst = torch.full((size,), 7.0, device=DEVICE)
        with pytest.raises((TypeError, ValueError)) as caught:
            pack_slices(dst, slices, fresh=fresh)
        errors.append((type(caught.value), str(caught.value)))
        assert bool((dst == 7.0).all())
    assert errors[0] == errors[1]
