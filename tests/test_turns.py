"""A copy into a fresh buffer in turns (``kernels/turns.py``): the same bytes and the same errors as one
plan, what no turn can check alone checked before the first write, the sources never written.

On CPU the kernels run under the Triton interpreter: sources stay a few elements each, so the tests lift the
bytes a piece needs on average for turns (``MIN_MEAN_BYTES``) unless they test that rule.
"""
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from factories import random_bits, record_calls
from ztriton.kernels import bits, pack, pack_slices, torch_pack, torch_pack_slices
from ztriton.kernels import plan as plan_module
from ztriton.kernels import torch_route
from ztriton.kernels import turns as turns_module
from ztriton.kernels.pieces import PackPieces, pack_pieces, slices_to_pieces
from ztriton.kernels.turns import FIRST_TURN, GROWTH, MIN_PIECES, schedule, turns

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = MIN_PIECES + 3 * FIRST_TURN + 5  # enough pieces for turns, and more than one turn after the first


@pytest.fixture(autouse=True)
def small_pieces_go_in_turns(monkeypatch):
    monkeypatch.setattr(turns_module, "MIN_MEAN_BYTES", 0)


def planned_turns(monkeypatch) -> list:
    """Record the pieces and zero ranges of each plan :func:`run_fresh` makes."""
    made = []
    real = turns_module.make_plan

    def recording(dst, pieces, zero_ranges, *args, **kwargs):
        plan = real(dst, pieces, zero_ranges, *args, **kwargs)
        made.append((pieces, np.array(zero_ranges).reshape(-1, 2), plan))
        return plan

    monkeypatch.setattr(turns_module, "make_plan", recording)
    return made


def is_the_pack(dst: torch.Tensor, sources: list, offsets, window=None) -> bool:
    """Whether ``dst`` holds, bit for bit, what the torch reference packs of ``sources`` at ``offsets``."""
    expected = torch.empty_like(dst)
    torch_pack(expected, sources, offsets, window)
    return torch.equal(bits(dst), bits(expected))


@given(n=st.integers(0, 3000), first=st.integers(1, 100), growth=st.integers(1, 4), last=st.integers(1, 700))
@settings(max_examples=60, deadline=None)
def test_turns_cover_every_index_once_in_order(n, first, growth, last):
    spans = list(turns(n, first, growth, last))
    assert [i for a, b in spans for i in range(a, b)] == list(range(n))
    full, size = [], first  # first, growth times more each turn, at most last; the final one what is left
    while sum(full) < n:
        full.append(size)
        size = min(last, growth * size)
    assert [b - a for a, b in spans][:-1] == full[:len(spans) - 1]


def random_source(numel: int, dtype: torch.dtype, g: torch.Generator, at_offset: bool) -> torch.Tensor:
    """``numel`` elements of random bits (raw bool bytes too), one element into their storage if ``at_offset``."""
    raw = random_bits((numel + 1,), dtype, g).to(DEVICE)
    return raw[1:] if at_offset else raw[:numel]


def sources_of(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """``n`` sources of 1-9 elements of random bits (raw bool bytes too), some 2-D, some views at an offset."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        numel = int(torch.randint(1, 10, (), generator=g))
        src = random_source(numel, dtype, g, at_offset=k % 3 == 0)  # every third one starts one element in
        out.append(src.view(1, numel) if k % 5 == 0 else src)
    return out


@pytest.fixture(params=["kernels"])
def route(request):
    """In turns for the kernels (the route is the job's alone: a job of this many pieces always takes them)."""
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float32])
@pytest.mark.parametrize("window", [None, (37, 900)])
def test_fresh_pack_is_the_pack(route, dtype, window):
    sources = sources_of(N, dtype, seed=7)
    offsets, at = [], 3
    for s in sources:
        offsets.append(at)
        at += s.numel() + 2  # a gap after each source: zeroed by the last turn
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
    sources = sources_of(N, torch.bfloat16, seed=3)
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


def _first_turn_then_rest(sources: list, first: list[int], itemsize: int) -> list[list[tuple[int, int, int]]]:
    """What a fresh pack with a first turn by room copies, turn by turn, as (source index, start, count): the sources
    ``first`` (in that order) of one 16-byte word or more, each its whole words; then every other source and each
    tail those words left, biggest first (ties in the job's order), in turns from the second turn's size."""
    per_word = 16 // itemsize
    first = [i for i in first if sources[i].numel() >= per_word]
    bodies = {i: sources[i].numel() - sources[i].numel() % per_word for i in first}
    rest = [(i, bodies.get(i, 0), sources[i].numel() - bodies.get(i, 0)) for i in range(len(sources))
            if bodies.get(i, -1) != sources[i].numel()]
    rest.sort(key=lambda r: (-r[2], r[0]))
    return [[(i, 0, bodies[i]) for i in first]] + [rest[a:b] for a, b in turns(len(rest), FIRST_TURN * GROWTH)]


def _copied(made: list, sources: list) -> list[list[tuple[int, int, int]]]:
    """Each recorded turn's pieces as (source index, start, count)."""
    index = {id(s): i for i, s in enumerate(sources)}
    return [[(index[id(s)], int(p.start[k]), int(p.count[k])) for k, s in enumerate(p.sources)] for p, _, _ in made]


def test_the_biggest_pieces_go_first_and_the_zero_ranges_last(monkeypatch):
    """The copy really goes in turns (:func:`turns`' sizes): the biggest first (the device gets the most to copy
    while the host checks the rest; the first turn only their whole 16-byte words, one launch of one word class,
    their tails with the rest), every zero range in the last turn."""
    made = planned_turns(monkeypatch)
    sources = sources_of(N, torch.float32, seed=1)
    offsets, at = [], 0
    for s in sources:  # a pad before each: the room before the next offset orders the sources as their sizes do
        offsets.append(at + 1)
        at += 1 + s.numel()
    dst = torch.empty(at + 1, device=DEVICE)
    pack(dst, sources, offsets, fresh=True)
    biggest = [int(i) for i in schedule(pack_pieces(dst, sources, offsets)[0])[0]]
    assert _copied(made, sources) == _first_turn_then_rest(sources, biggest, 4) and len(made) > 2
    assert any(sources[i].numel() % 4 for i in biggest), "no tail left to a later turn"
    assert all(len(z) == 0 for _, z, _ in made[:-1]) and len(made[-1][1]) == N + 1  # a pad before each, one after
    assert all(plan.launches for _, _, plan in made)  # kernel turns, the last too (however few its pieces)
    assert is_the_pack(dst, sources, offsets)


def test_an_aligned_packs_first_turn_is_one_launch(monkeypatch):
    """Sources and offsets on 16-byte boundaries (a flatten's usual job): the first turn's whole words are one
    word class, one launch; the other turns carry the tails' classes too."""
    made = planned_turns(monkeypatch)
    g = torch.Generator().manual_seed(5)
    sources = [random_bits((int(torch.randint(1, 20, (), generator=g)),), torch.float32, g).to(DEVICE)
               for _ in range(N)]
    offsets, at = [], 0
    for s in sources:
        offsets.append(at)
        at += s.numel() + (-s.numel()) % 4 + 4 * int(torch.randint(0, 3, (), generator=g))
    dst = torch.empty(at, device=DEVICE)
    assert dst.data_ptr() % 16 == 0 and all(s.data_ptr() % 16 == 0 for s in sources)
    pack(dst, sources, offsets, fresh=True)
    assert len(made[0][2].launches) == 1 and max(len(plan.launches) for _, _, plan in made[1:]) > 1
    assert is_the_pack(dst, sources, offsets)


def _roomy_pack(n: int = N, seed: int = 17, shuffled: bool = False):
    """``n`` sources of 1-9 elements, each at an offset with a room of 1-40 elements before the next one (dst's end
    after the last): the room does not order the sources as their sizes do. ``shuffled``: also an empty source at
    every 7th source's offset (a tie), and the sources and their offsets in a random order."""
    g = torch.Generator().manual_seed(seed)
    sources = sources_of(n, torch.float32, seed)
    offsets, at = [], 0
    for s in sources:
        offsets.append(at)
        at += s.numel() + int(torch.randint(0, 32, (), generator=g))
    if shuffled:
        ties = range(0, len(sources), 7)
        sources += [torch.empty(0, device=DEVICE) for _ in ties]
        offsets += [offsets[k] for k in ties]
        order = torch.randperm(len(sources), generator=g).tolist()
        sources, offsets = [sources[i] for i in order], [offsets[i] for i in order]
    return sources, offsets, torch.empty(at, device=DEVICE)


def _by_room(offsets: list[int], end: int) -> list[int]:
    """The sources' indices by decreasing room before the next offset up (ties in index order), the room found as
    written: offsets in order (equal ones in index order), each one's room up to the next (``end`` after the last)."""
    placed = sorted(range(len(offsets)), key=lambda i: (offsets[i], i))
    room = {i: (offsets[j] if j is not None else end) - offsets[i]
            for i, j in zip(placed, placed[1:] + [None])}
    return sorted(range(len(offsets)), key=lambda i: (-room[i], i))


@pytest.mark.parametrize("shuffled", [False, True], ids=["offsets in order", "shuffled, with ties"])
def test_a_packs_first_turn_is_chosen_by_room_and_the_rest_goes_biggest_first(monkeypatch, shuffled):
    """A fresh pack's first turn: the FIRST_TURN sources with the most room before the next offset (ties in index
    order), copied before the whole job is read; then the others in the second and later turns' sizes, biggest
    first; the bytes those of one plan."""
    made = planned_turns(monkeypatch)
    sources, offsets, dst = _roomy_pack(shuffled=shuffled)
    n = len(sources)
    pack(dst, sources, offsets, fresh=True)
    by_room = _by_room(offsets, dst.numel())[:FIRST_TURN]
    assert _copied(made, sources) == _first_turn_then_rest(sources, by_room, 4)
    assert sorted(s.numel() for s in made[0][0].sources) != sorted(s.numel() for s in sources)[-FIRST_TURN:]
    assert is_the_pack(dst, sources, offsets)


def test_a_source_under_one_word_inside_dst_is_refused_before_the_first_turn_writes(monkeypatch):
    """A source of less than one 16-byte word that the first turn by room would take, lying inside dst's memory:
    left out of that turn (as an empty piece there its memory would go unchecked), so the whole job's checks refuse
    it with one plan's error (after the first turn's writes, as for a source in a later turn: a just-allocated dst
    holds no source)."""
    sources, offsets, dst = _roomy_pack()
    at = _by_room(offsets, dst.numel())[0]
    buffer = torch.full((dst.numel() + 8,), 7.0, device=DEVICE)
    dst = buffer[:dst.numel()]
    sources[at] = buffer[:3]  # 12 bytes of dst itself
    took = _first_turns_by_room(monkeypatch)
    errors = []
    for fresh in (False, True):
        with pytest.raises(ValueError, match=rf"sources\[{at}\] overlaps dst in memory") as caught:
            pack(dst, sources, offsets, fresh=fresh)
        errors.append(str(caught.value))
        assert fresh or bool((buffer == 7.0).all())
    assert errors[0] == errors[1] and len(took) == 1 and took[0] is not None
    assert at not in took[0][1].tolist()  # taken by room, but not into the first turn


def test_an_offset_whose_int_raises_gives_the_one_plans_error():
    """Whatever error an offset's own int() raises, the first turn by room is not taken and the error is the one
    plan's (a TypeError naming the offset), before any byte is written."""
    class Odd:
        def __int__(self):
            raise RuntimeError("not a number")

    sources, offsets, dst = _roomy_pack()
    offsets[5] = Odd()
    for fresh in (False, True):
        with pytest.raises(TypeError, match=r"offsets\[5\] must be an int, got Odd"):
            pack(dst.fill_(7.0), sources, offsets, fresh=fresh)
        assert bool((dst == 7.0).all())


def test_a_complex_packs_first_turn_by_room_is_the_pack(monkeypatch):
    """16-byte elements (complex128, moved as pairs of 8-byte words): each a whole word, no tails; the same bytes."""
    sources, offsets, dst = _roomy_pack()
    sources = [torch.complex(s.double(), -s.double()) for s in sources]
    dst = torch.empty(dst.numel(), dtype=torch.complex128, device=DEVICE)
    took = _first_turns_by_room(monkeypatch)
    pack(dst, sources, offsets, fresh=True)
    assert is_the_pack(dst, sources, offsets) and took[0] is not None
    assert bool((took[0][2].count == took[0][2].numel).all())


def test_numpy_integers_among_the_offsets_pack_as_ints_do(monkeypatch):
    """A numpy integer among a list's offsets is an int to a pack: outside the first turn by room (whose own offsets
    must be ints), the same bytes as with ints, the first turn still by room."""
    sources, offsets, dst = _roomy_pack()
    late = _by_room(offsets, dst.numel())[-1]
    took = _first_turns_by_room(monkeypatch)
    pack(dst, sources, offsets[:late] + [np.int64(offsets[late])] + offsets[late + 1:], fresh=True)
    assert is_the_pack(dst, sources, offsets) and len(took) == 1 and took[0] is not None


def test_offsets_as_a_numpy_array_pack_as_a_list_does_and_a_masked_array_is_refused():
    """An int64 array of offsets (a pack's own column type) packs as the same list does; a masked array is read as
    its list (a masked value is None) and refused, naming the offset, before anything is written."""
    sources, offsets, dst = _roomy_pack()
    expected = torch.empty_like(dst)
    pack(expected, sources, offsets)
    for fresh in (False, True):
        got = torch.full_like(dst, 7.0)
        pack(got, sources, np.array(offsets, dtype=np.int64), fresh=fresh)
        assert torch.equal(bits(got), bits(expected))
        masked = np.ma.masked_array(np.array(offsets, dtype=np.int64), mask=[k == 5 for k in range(N)])
        with pytest.raises(TypeError, match=r"offsets\[5\] must be an int, got NoneType"):
            pack(got.fill_(7.0), sources, masked, fresh=fresh)
        assert bool((got == 7.0).all())


@pytest.mark.parametrize("case", ["a float offset", "a source past its room", "an offset past dst",
                                  "a room big enough to lead", "a window"])
def test_a_pack_without_a_first_turn_by_room(monkeypatch, case):
    """No first turn by room where a chosen offset is not an int, an offset is outside dst, a chosen source
    overflows its room, a piece could lead, or there is a window: then the job is read whole first, as before,
    with the same bytes (or the one plan's error, before any byte is written)."""
    made = planned_turns(monkeypatch)
    sources, offsets, dst = _roomy_pack()
    window = None
    if case == "a float offset":  # one the first turn would take (its value kept): none by room, nothing written
        took = _first_turns_by_room(monkeypatch)
        at = _by_room(offsets, dst.numel())[0]
        with pytest.raises(TypeError, match=rf"offsets\[{at}\] must be an int, got float"):
            pack(dst.fill_(7.0), sources, offsets[:at] + [float(offsets[at])] + offsets[at + 1:], fresh=True)
        assert took == [None] and made == [] and bool((dst == 7.0).all())
        return
    if case in ("a source past its room", "an offset past dst"):  # the whole job's checks name the fault
        big = int(np.argmax(np.diff(offsets + [dst.numel()])))  # before any byte is written
        if case == "a source past its room":
            sources[big] = torch.zeros(offsets[big + 1] - offsets[big] + 1, device=DEVICE)
            match = rf"sources\[{big}\].*sources\[{big + 1}\].*overlap"
        else:
            offsets[-1] = dst.numel() + 1
            match = rf"sources\[{N - 1}\]: destination range .* does not fit"
        with pytest.raises(ValueError, match=match):
            pack(dst.fill_(7.0), sources, offsets, fresh=True)
        assert made == [] and bool((dst == 7.0).all())
        return
    elif case == "a room big enough to lead":  # a room of 20 elements or more: no source is that big, none leads
        monkeypatch.setattr(turns_module, "LEAD_BYTES", 4 * 20)
    else:
        window = (5, dst.numel())
        dst = dst[5:]
    pack(dst, sources, offsets, window, fresh=True)
    assert is_the_pack(dst, sources, offsets, window)
    biggest = sorted(range(len(sources)), key=lambda i: (-sources[i].numel(), i))
    assert [id(s) for s in made[0][0].sources] == [id(sources[i]) for i in biggest[:len(made[0][0])]]


@pytest.mark.parametrize("fault", ["dtype in the first turn", "too many dims, one in the first turn",
                                   "dtype in a later turn", "overlap in a later turn", "bool offset in a later turn",
                                   "float offset in a later turn"])
def test_a_fault_in_a_pack_with_a_first_turn_by_room_is_the_one_plans(monkeypatch, fault):
    """The first turn's own pieces are checked in full before it is written: a fault there writes nothing. A fault
    that only the whole job shows is found after the first turn's writes (a fresh dst allows them); either way
    the error is the one plan's (the first culprit in the whole job, as its planning names it too), and no source
    changes."""
    sources, offsets, dst = _roomy_pack()
    room = np.diff(offsets + [dst.numel()])
    by_room = _by_room(offsets, dst.numel())
    first, late = by_room[0], by_room[-1]
    if fault == "dtype in the first turn":
        sources[first] = sources[first].double()
    elif fault == "too many dims, one in the first turn":  # the kernels' limit, found when planning a source
        sources = [torch.zeros(1, device=DEVICE) for _ in range(N)]
        sources[0] = torch.zeros([3] * 9, device=DEVICE)[(slice(0, 2),) * 9]  # 512 elements in 9 unmergeable dims
        sources[N // 2] = torch.zeros([3] * 10, device=DEVICE)[(slice(0, 2),) * 10]  # 10 dims: another message
        rooms = [600] * N
        rooms[0], rooms[N // 2] = 512, 1100  # the 10-dim one first by room, the 9-dim one first in the job
        offsets = np.concatenate([[0], np.cumsum(rooms)[:-1]]).tolist()
        dst = torch.empty(sum(rooms), device=DEVICE)
    elif fault == "dtype in a later turn":
        sources[late] = sources[late].double()
    elif fault == "overlap in a later turn":  # a later source's destination reaches into its neighbour's
        sources[late] = torch.zeros(room[late] + 1, device=DEVICE)
    else:  # an offset the first turn does not take, of a type only the whole job's checks look at
        offsets = list(offsets)
        offsets[late] = (bool if fault.startswith("bool") else float)(offsets[late])
    before = [bits(s).clone() for s in sources]
    took = _first_turns_by_room(monkeypatch)
    errors = []
    for fresh in (False, True):
        with pytest.raises((TypeError, ValueError)) as caught:
            pack(dst.fill_(7.0), sources, offsets, fresh=fresh)
        errors.append((type(caught.value), str(caught.value)))
        written = not bool((dst == 7.0).all())
        assert written is (fresh and "later turn" in fault)  # a later fault only shows after the first turn's writes
    assert errors[0] == errors[1]
    assert len(took) == 1 and took[0] is not None, "the fresh pack did not take its first turn by room"
    assert all(torch.equal(bits(s), b) for s, b in zip(sources, before))


@given(counts=st.lists(st.integers(-2, 50), max_size=400))
@example(counts=[-1, 0, 2])  # a negative count sorts as an empty piece, after the others
@settings(max_examples=40, deadline=None)
def test_schedule_takes_every_piece_once_biggest_first_ties_in_order(counts):
    pieces = PackPieces([None] * len(counts), np.zeros(len(counts), dtype=np.int64),
                        np.array(counts, dtype=np.int64), np.zeros(len(counts), dtype=np.int64),
                        np.zeros(len(counts), dtype=np.int64))
    each_turn = schedule(pieces)
    assert [len(t) for t in each_turn] == [b - a for a, b in turns(len(counts))]
    order = np.concatenate(each_turn).tolist() if each_turn else []
    assert sorted(order) == list(range(len(counts)))
    keys = [(-max(counts[i], 0), i) for i in order]
    assert keys == sorted(keys)


@pytest.mark.parametrize("case", ["few pieces", "small pieces", "not columns"])
def test_one_plan_where_turns_do_not_pay(monkeypatch, case):
    """Up to MIN_PIECES pieces, pieces averaging under MIN_MEAN_BYTES, pieces that are not columns: one plan, with
    the same bytes."""
    made = planned_turns(monkeypatch)
    planned_once = []
    real_run_plan = turns_module.run_plan
    monkeypatch.setattr(turns_module, "run_plan", lambda *a, **k: (planned_once.append(1), real_run_plan(*a, **k)))
    sources = sources_of(MIN_PIECES if case == "few pieces" else N, torch.float32, seed=4)
    if case == "small pieces":
        numel = sum(s.numel() for s in sources)
        monkeypatch.setattr(turns_module, "MIN_MEAN_BYTES", 4 * numel // len(sources) + 1)
    slices = [(s, 0, s.numel(), 10 * k) for k, s in enumerate(sources)]
    if case == "not columns":
        slices[5] = (sources[5], np.int64(0), sources[5].numel(), 50)  # a numpy index: checked one piece at a time
    dst = torch.empty(10 * len(sources), device=DEVICE)
    pack_slices(dst, slices, fresh=True)
    assert made == [] and planned_once == [1]
    expected = torch.empty_like(dst)
    torch_pack_slices(expected, slices)
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("short", [0, 1])
def test_turns_from_exactly_the_minimum_mean_bytes(monkeypatch, short):
    """The bytes rule at its boundary: pieces averaging MIN_MEAN_BYTES (counted in bytes of dst's dtype) go in
    turns; six bytes short in all goes as one plan."""
    from ztriton.kernels.turns import worth_turns

    monkeypatch.setattr(turns_module, "MIN_MEAN_BYTES", 6)  # three bf16 elements a piece on average
    n = MIN_PIECES + 1
    dst = torch.empty(4 * n, dtype=torch.bfloat16, device=DEVICE)
    counts = np.full(n, 3, dtype=np.int64)
    counts[0] -= 3 * short  # one piece empty: the job six bytes short of n * MIN_MEAN_BYTES
    pieces = PackPieces([dst] * n, np.zeros(n, dtype=np.int64), counts,
                        np.arange(n, dtype=np.int64) * 4, np.full(n, 4, dtype=np.int64))
    assert worth_turns(dst, pieces) is (short == 0)


def test_take_refuses_a_mask():
    pieces = PackPieces([1, 2, 3], *(np.arange(3, dtype=np.int64),) * 4)
    assert pieces.take(np.array([2, 0])).sources == [3, 1]
    with pytest.raises(TypeError, match="integer numpy array"):
        pieces.take(np.array([True, False, True]))


def test_a_bad_source_in_a_late_turn_is_named_by_its_index_and_no_source_changes():
    sources = sources_of(N, torch.float32, seed=5)
    offsets = [10 * k for k in range(len(sources))]
    dst = torch.empty(10 * len(sources), device=DEVICE)
    bad = int(schedule(pack_pieces(dst, sources, offsets)[0])[-1][3])  # in the last turn
    sources[bad] = sources[bad].to(torch.float64)
    before = [bits(s).clone() for s in sources]
    with pytest.raises(TypeError) as whole:
        pack(torch.empty(10 * len(sources), device=DEVICE), sources, offsets)
    with pytest.raises(TypeError) as in_turns:
        pack(torch.empty(10 * len(sources), device=DEVICE), sources, offsets, fresh=True)
    assert f"sources[{bad}]" in str(in_turns.value)
    assert str(in_turns.value) == str(whole.value)
    assert all(torch.equal(bits(s), b) for s, b in zip(sources, before))


def test_destinations_overlapping_across_turns_are_refused_before_any_write():
    """Two slices in different turns overlap in dst: no single turn sees both, the whole job's check does,
    before the first byte is written."""
    sources = sources_of(N, torch.float32, seed=9)
    slices = [(s, 0, s.numel(), 16 * k) for k, s in enumerate(sources)]
    dst = torch.full((16 * len(sources),), 7.0, device=DEVICE)
    each_turn = schedule(slices_to_pieces(dst, slices)[0])
    one, other = int(each_turn[0][0]), int(each_turn[-1][0])  # a piece of the first turn, one of the last
    slices[other] = (sources[other], 0, 1, slices[one][3])  # smaller still: it stays in the last turn
    each_turn = schedule(slices_to_pieces(dst, slices)[0])
    assert one in each_turn[0].tolist() and other in each_turn[-1].tolist() and len(each_turn) > 2
    early, late = sorted([one, other])
    with pytest.raises(ValueError, match=rf"slices\[{early}\].*slices\[{late}\].*overlap"):
        pack_slices(dst, slices, fresh=True)
    assert bool((dst == 7.0).all())


@pytest.mark.parametrize("segments, gaps", [
    ([(4, 3), (10, 2)], [(7, 3)]),  # tile [4, 12): one split
    ([(4, 3)], [(10, 2)]),  # a hole at 7: a narrow each
    ([(0, 16)], []),  # all of out
    ([], []),
])
def test_cut_gives_the_views_narrow_would(segments, gaps):
    out = torch.arange(16)
    views = torch_route._cut(out, segments, gaps)
    expected = [out.narrow(0, o, c) for o, c in segments + gaps]
    assert [(v.data_ptr(), v.numel()) for v in views] == [(e.data_ptr(), e.numel()) for e in expected]


@pytest.mark.parametrize("case", ["bad dtype beside an overlap", "past dst's end and overlapping"])
def test_a_job_with_several_faults_gets_the_error_one_plan_gives(case):
    """The whole job's overlap check runs before any turn; when it fails, the error is still the one a single
    plan raises first (types before ranges before overlaps), and nothing is written."""
    sources = [torch.arange(4, dtype=torch.float32, device=DEVICE) + k for k in range(N)]
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


def test_a_zero_range_over_a_piece_of_another_turn_is_refused_before_any_write():
    """Zero ranges go with the last turn, the biggest pieces with the first: only the whole job's check sees a
    caller's zero range lying over a first-turn piece (else the last turn would zero that piece's bytes)."""
    sources = sources_of(N, torch.float32, seed=13)
    slices = [(s, 0, s.numel(), 16 * k) for k, s in enumerate(sources)]
    dst = torch.full((16 * len(sources),), 7.0, device=DEVICE)
    pieces, _ = slices_to_pieces(dst, slices)
    biggest = int(schedule(pieces)[0][0])
    over = [(16 * biggest, 1)]  # the first element of a first-turn piece
    with pytest.raises(ValueError, match=rf"sources\[{biggest}\].*a pad range.*overlap"):
        turns_module.run_fresh(dst, pieces, over)
    assert bool((dst == 7.0).all())


class _TurnFault(RuntimeError):
    """Not an allocation failure: the caller must raise it, every input intact."""


def _failing_turn(monkeypatch, at: int, error: type[BaseException]) -> list:
    """The ``at``-th plan made by a copy in turns raises ``error`` (an OOM of its table upload, or any other
    failure) after the turns before it have written their pieces; returns how many plans were made."""
    made = []
    real = turns_module.make_plan

    def failing(*args, **kwargs):
        made.append(1)
        if len(made) == at:
            raise error(f"injected: turn {at}")
        return real(*args, **kwargs)

    monkeypatch.setattr(turns_module, "make_plan", failing)
    return made


def _first_turns_by_room(monkeypatch) -> list:
    """Record what each fresh pack chose from its offsets to copy first (:func:`pack_fresh`): None, or its
    ``(offsets, indices, pieces, led)``."""
    chosen, real = [], turns_module._first_by_room
    monkeypatch.setattr(turns_module, "_first_by_room",
                        lambda *args: chosen.append(real(*args)) or chosen[-1])
    return chosen


@pytest.mark.parametrize("at", [1, 2], ids=["first turn", "second turn"])
@pytest.mark.parametrize("error", [torch.OutOfMemoryError, _TurnFault])
def test_a_flatten_whose_turn_fails_keeps_every_param(monkeypatch, error, at):
    """A fresh buffer is partly written when a later turn fails: the flatten drops it and falls back to its next
    tier on an OOM (the right bytes) or raises anything else, every param holding its values either way. The
    first turn is the one chosen from the offsets, before the other params are read."""
    import ztriton

    def params():
        return [torch.nn.Parameter(s.float()) for s in sources_of(N, torch.float32, seed=17)]

    expected = ztriton.flatten_groups([params()], tier="device")[0].flat.clone()
    by_room = _first_turns_by_room(monkeypatch)
    made = _failing_turn(monkeypatch, at, error)
    group = params()
    before = [bits(p).clone() for p in group]
    if error is torch.OutOfMemoryError:
        (flat,) = ztriton.flatten_groups([group], tier="device")
        assert flat.tier is not None and flat.tier.value != "device"
        assert torch.equal(bits(flat.flat), bits(expected))
    else:
        with pytest.raises(_TurnFault):
            ztriton.flatten_groups([group], tier="device")
    assert len(made) >= at and by_room[0] is not None, "the flatten's pack did not go in turns from a first by room"
    assert all(torch.equal(bits(p), b) for p, b in zip(group, before))


@pytest.mark.parametrize("at", [1, 2], ids=["first turn", "second turn"])
@pytest.mark.parametrize("error", [torch.OutOfMemoryError, _TurnFault])
def test_a_defragment_whose_turn_fails_keeps_every_partition(monkeypatch, error, at):
    from ztriton.defragmenting import defragment

    def partitions():
        return [s.reshape(-1).clone() for s in sources_of(N, torch.float32, seed=19)]

    expected = torch.cat([bits(t) for t in partitions()])
    by_room = _first_turns_by_room(monkeypatch)
    made = _failing_turn(monkeypatch, at, error)
    tensors = partitions()
    before = [bits(t).clone() for t in tensors]
    if error is torch.OutOfMemoryError:  # the tables' OOM: nothing moved yet, so the evict tier
        flat = defragment(tensors, tier="device")
        assert torch.equal(bits(flat), expected)
    else:
        with pytest.raises(_TurnFault):
            defragment(tensors, tier="device")
    assert len(made) >= at and by_room[0] is not None, "the defragment's pack did not go in turns from a first by room"
    assert all(torch.equal(bits(t), b) for t, b in zip(tensors, before))


# --------------------------------------------------------------------------------------------
# The lead: the biggest pieces as torch copies before any plan (LEAD_BYTES lowered to a few elements).


def _sized_sources(counts: list[int], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """A source of random bits per count (raw bool bytes too); every other one a view one element into its storage."""
    g = torch.Generator().manual_seed(seed)
    return [random_source(n, dtype, g, at_offset=k % 2 == 1) for k, n in enumerate(counts)]


def _recorded_lead(monkeypatch) -> list:
    """Record the sources each fresh pack copies in its lead, in order (:func:`_which` gives their indices)."""
    led = []
    real = turns_module._copy_lead

    def recording(dst, pieces, first):
        led.append([pieces.sources[i] for i in first.tolist()])
        return real(dst, pieces, first)

    monkeypatch.setattr(turns_module, "_copy_lead", recording)
    return led


def _which(led: list, sources: list) -> list[int]:
    """The indices in ``sources`` of the tensors one lead copied (the lead's own pieces may be a part of the job's)."""
    return [next(k for k, s in enumerate(sources) if s is t) for t in led]


@pytest.mark.parametrize("many", [False, True], ids=["one plan after", "turns after"])
def test_the_biggest_pieces_lead_biggest_first_and_the_rest_is_planned_in_order(route, monkeypatch, many):
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 2)  # 8 bf16 elements
    led, made = _recorded_lead(monkeypatch), planned_turns(monkeypatch)
    counts = [3, 9, 1, 12, 8, 7, 12, 2] * (N // 8 if many else 1)
    sources = _sized_sources(counts, seed=2)
    offsets, at = [], 1
    for s in sources:
        offsets.append(at)
        at += s.numel() + 1
    dst = torch.full((at,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    one_plan = []
    real_run_plan = turns_module.run_plan
    monkeypatch.setattr(turns_module, "run_plan", lambda d, p, *a, **k: (one_plan.append(p), real_run_plan(d, p, *a, **k)))
    pack(dst, sources, offsets, fresh=True)
    big = [k for k, n in enumerate(counts) if n >= 8]
    assert [_which(e, sources) for e in led] == [sorted(big, key=lambda k: -counts[k])]  # ties: index order
    rest = [id(s) for k, s in enumerate(sources) if k not in big]
    if many and route == "kernels":  # in turns, each biggest first: together every piece not led
        assert not one_plan and sorted(id(s) for p, _, _ in made for s in p.sources) == sorted(rest)
    else:  # one plan of the rest, in the job's order
        assert len(one_plan) == 1 and [id(s) for s in one_plan[0].sources] == rest
    expected = torch.empty_like(dst)
    pack(expected, sources, offsets)
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("fault", ["dtype", "inside dst", "past its source", "past dst", "negated", "conjugated",
                                   "negative start", "meta", "strided"])
def test_a_big_piece_that_fails_a_lead_check_is_left_to_the_plan(monkeypatch, fault):
    """Not copied in the lead: the plan then raises the one plan's error (nothing written) or, for a strided source
    the kernels gather, copies it right."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 4)
    led = _recorded_lead(monkeypatch)
    sources = _sized_sources([16, 12, 3, 20], dtype=torch.float32, seed=4)
    slices = [(s, 0, s.numel(), 32 * k) for k, s in enumerate(sources)]
    dst = torch.full((32 * len(sources),), 7.0, device=DEVICE)
    if fault == "dtype":
        slices[3] = (sources[3].double(), 0, 20, 96)
    elif fault == "inside dst":
        slices[3] = (dst[100:120], 0, 20, 96)
    elif fault == "past its source":
        slices[3] = (sources[3], 1, 20, 96)
    elif fault == "past dst":
        slices[3] = (sources[3], 0, 20, 120)
    elif fault == "negated":
        slices[3] = (torch.zeros(20, dtype=torch.complex64, device=DEVICE).conj().imag, 0, 20, 96)
    elif fault == "conjugated":  # a complex source with its lazy conjugation bit, into a complex dst
        dst = torch.full((32 * len(sources),), 7.0, dtype=torch.complex64, device=DEVICE)
        slices = [(s.to(torch.complex64), 0, s.numel(), 32 * k) for k, s in enumerate(sources)]
        slices[3] = (torch.ones(20, dtype=torch.complex64, device=DEVICE).conj(), 0, 20, 96)
    elif fault == "negative start":  # start + count still inside it: only start < 0 says no
        slices[3] = (torch.arange(21, dtype=torch.float32, device=DEVICE), -1, 20, 96)
    elif fault == "meta":
        slices[3] = (torch.empty(20, device="meta"), 0, 20, 96)
    else:
        slices[3] = (torch.arange(40, dtype=torch.float32, device=DEVICE).view(20, 2).t(), 0, 20, 96)
    if fault == "strided":
        expected = torch.empty_like(dst)
        torch_pack_slices(expected, slices)
        pack_slices(dst, slices, fresh=True)
        assert torch.equal(bits(dst), bits(expected))
        assert [_which(e, [s[0] for s in slices]) for e in led] == [[0, 1]]
        return
    with pytest.raises((TypeError, ValueError)) as one_plan:
        pack_slices(dst, slices)  # raises before writing: dst is still fresh for the call below
    assert bool((dst == 7.0).all())
    if fault == "conjugated":
        monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 8)
    def values(t):  # the bytes a source reads as (a lazy conjugation or negation resolved)
        return bits(t.resolve_conj().resolve_neg()) if t.device.type != "meta" else None

    before = [values(s[0]) for s in slices]
    with pytest.raises(type(one_plan.value)) as fresh:
        pack_slices(dst, slices, fresh=True)
    assert str(fresh.value) == str(one_plan.value) and "slices[3]" in str(fresh.value)
    assert 3 not in _which(led[0], [s[0] for s in slices])  # the others led (dst is fresh: the caller drops it)
    assert all(b is None or torch.equal(values(s[0]), b) for s, b in zip(slices, before))


@pytest.mark.parametrize("fault", [None, "float offset", "overlap"])
def test_a_packs_lead_is_chosen_by_room_before_the_job_is_read(monkeypatch, fault):
    """A pack's lead goes before ``pack_pieces`` reads the other sources: the sources whose room could hold a lead,
    biggest first. A fault that only the whole job shows (an offset of another type, a destination reaching into
    the next) is found after the lead's writes (a fresh dst allows them) and raised as one plan raises it."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 4)
    led = _recorded_lead(monkeypatch)
    leads_before_pieces = []  # at each pack_pieces call, how many leads were copied already
    real_pieces = turns_module.pack_pieces
    monkeypatch.setattr(turns_module, "pack_pieces",
                        lambda *a, **k: leads_before_pieces.append(len(led)) or real_pieces(*a, **k))
    counts = [3, 9, 1, 12, 2, 16, 4]
    sources = _sized_sources(counts, dtype=torch.float32, seed=12)
    offsets = np.concatenate([[0], np.cumsum([n + 1 for n in counts])[:-1]]).tolist()
    dst = torch.full((sum(counts) + len(counts),), 7.0, device=DEVICE)
    if fault is None:
        pack(dst, sources, offsets, fresh=True)
        assert is_the_pack(dst, sources, offsets)
        assert leads_before_pieces == [1] and [_which(e, sources) for e in led] == [[5, 3, 1]]
        return
    if fault == "float offset":
        offsets[2] = float(offsets[2])
    else:
        sources[0] = torch.zeros(counts[0] + 2, device=DEVICE)  # into sources[1]'s destination
    with pytest.raises((TypeError, ValueError)) as one_plan:
        pack(torch.empty_like(dst), sources, offsets)
    with pytest.raises(type(one_plan.value)) as fresh:
        pack(dst, sources, offsets, fresh=True)
    assert str(fresh.value) == str(one_plan.value) and leads_before_pieces[0] == 1


@pytest.mark.parametrize("fault", ["sparse", "not contiguous"])
def test_a_dst_that_a_plan_refuses_gets_its_error_before_a_packs_lead_writes(monkeypatch, fault):
    """A dst the plan's checks refuse is refused before the lead reads its address or writes: the one plan's
    error, and nothing written around a strided dst."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 4 * 4)
    led = _recorded_lead(monkeypatch)
    buffer = torch.full((128,), 7.0, device=DEVICE)
    dst = buffer[::2] if fault == "not contiguous" else torch.zeros(64).to_sparse()
    errors = []
    for fresh in (False, True):
        with pytest.raises((TypeError, ValueError)) as caught:
            pack(dst, [torch.ones(8, device=DEVICE)], [0], fresh=fresh)
        errors.append(f"{type(caught.value).__name__}: {caught.value}")
    assert errors[0] == errors[1] and led == [] and bool((buffer == 7.0).all())


@pytest.mark.parametrize("fault", ["strided", "negated", "dtype"])
def test_a_packs_big_source_that_fails_a_lead_check_is_left_to_the_plan(monkeypatch, fault):
    """Chosen by room but not plainly copyable: not led. The plan then gathers it right, or raises the one
    plan's error (after the other pieces led: a fresh dst)."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 4)
    led = _recorded_lead(monkeypatch)
    sources = _sized_sources([16, 3, 20, 12], dtype=torch.float32, seed=14)
    every_other = torch.arange(40, dtype=torch.float32, device=DEVICE)[::2]  # 20 elements, stride 2
    sources[2] = {"strided": every_other, "negated": every_other.contiguous()._neg_view(),
                  "dtype": sources[2].double()}[fault]
    offsets = [0, 16, 20, 44]
    dst = torch.full((56,), 7.0, device=DEVICE)
    if fault == "strided":
        pack(dst, sources, offsets, fresh=True)
        assert is_the_pack(dst, sources, offsets)
    else:
        with pytest.raises((TypeError, ValueError)) as one_plan:
            pack(torch.empty_like(dst), sources, offsets)
        with pytest.raises(type(one_plan.value)) as fresh:
            pack(dst, sources, offsets, fresh=True)
        assert str(fresh.value) == str(one_plan.value) and "sources[2]" in str(fresh.value)
    assert [_which(e, sources) for e in led] == [[0, 3]]


def test_destinations_overlapping_a_lead_piece_are_refused_before_any_write(monkeypatch):
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 4 * 8)
    led = _recorded_lead(monkeypatch)
    sources = _sized_sources([16, 3, 12], dtype=torch.float32, seed=6)
    slices = [(sources[0], 0, 16, 0), (sources[1], 0, 3, 20), (sources[2], 0, 12, 10)]  # [10, 22) overlaps both
    dst = torch.full((40,), 7.0, device=DEVICE)
    with pytest.raises(ValueError, match=r"slices\[.\].*slices\[.\].*overlap"):
        pack_slices(dst, slices, fresh=True)
    assert bool((dst == 7.0).all()) and led == []


def test_only_lead_pieces_and_zero_ranges(monkeypatch):
    """Every piece leads: the zero ranges still get written (a plan with no pieces)."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 2)
    sources = _sized_sources([5, 9], seed=8)
    dst = torch.full((20,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    pack(dst, sources, [2, 9], fresh=True)
    assert is_the_pack(dst, sources, [2, 9])


@pytest.mark.parametrize("mode", ["dst made in inference mode", "called in inference mode"])
def test_lead_copies_in_and_out_of_inference_mode(monkeypatch, mode):
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 2)
    sources = _sized_sources([5, 9, 1], seed=10)
    if mode == "dst made in inference mode":
        with torch.inference_mode():
            dst = torch.empty(20, dtype=torch.bfloat16, device=DEVICE)
        pack(dst, sources, [0, 6, 16], fresh=True)
    else:
        dst = torch.empty(20, dtype=torch.bfloat16, device=DEVICE)
        with torch.inference_mode():
            pack(dst, sources, [0, 6, 16], fresh=True)
    assert is_the_pack(dst, sources, [0, 6, 16])


@given(counts=st.lists(st.integers(0, 24), min_size=1, max_size=40), lead_bytes=st.integers(1, 60),
       gap=st.integers(0, 3), window=st.booleans())
@settings(max_examples=25, deadline=None)
@example(counts=[24] * 3, lead_bytes=1, gap=0, window=False)  # every piece leads, nothing to zero
def test_a_fresh_pack_with_any_lead_is_the_pack(counts, lead_bytes, gap, window):
    sources = _sized_sources(counts, dtype=torch.int16, seed=len(counts))
    offsets, at = [], gap
    for s in sources:
        offsets.append(at)
        at += s.numel() + gap
    w0 = 1 if window and at > 1 else 0
    win = (w0, at - w0) if window else None  # one element off each end
    numel = at if win is None else win[1] - win[0]
    expected = torch.empty(numel, dtype=torch.int16, device=DEVICE)
    torch_pack(expected, sources, offsets, win)
    got = torch.full_like(expected, -1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(turns_module, "LEAD_BYTES", lead_bytes)
        pack(got, sources, offsets, win, fresh=True)
    assert torch.equal(got, expected)



def test_a_lead_candidate_whose_source_reaches_into_dst_is_refused_as_one_plan_refuses_it(monkeypatch):
    """Its piece's own range lies outside dst, the rest of its source does not: one plan refuses the source as a
    whole, so the lead must not copy it (that copy would write into the source)."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 16)
    memory = torch.arange(3000, dtype=torch.float32, device=DEVICE)
    src, dst = memory[:2000], memory[1500:2500]
    before = memory.clone()
    with pytest.raises(ValueError) as one_plan:
        pack(dst, [src], [0], (0, 1000))
    with pytest.raises(ValueError) as fresh:
        pack(dst, [src], [0], (0, 1000), fresh=True)
    assert str(fresh.value) == str(one_plan.value) and "overlaps dst in memory" in str(fresh.value)
    assert torch.equal(memory, before)


def test_a_dst_the_kernels_cannot_reach_is_refused_even_when_every_piece_leads(monkeypatch):
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 2)
    monkeypatch.setattr(plan_module, "runs_on", lambda device: False)
    errors = []
    for fresh in (False, True):
        dst = torch.full((10,), 7.0, device=DEVICE)
        with pytest.raises(ValueError) as caught:
            pack(dst, [torch.ones(10, device=DEVICE)], [0], fresh=fresh)
        errors.append(str(caught.value))
        assert bool((dst == 7.0).all())
    assert errors[0] == errors[1] and "where the Triton kernels cannot run" in errors[0]


def test_a_one_element_source_with_any_stride_leads(monkeypatch):
    """Contiguous (one element) but with a stride of 2: its bytes are still its storage's from its offset."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 2)
    led = _recorded_lead(monkeypatch)
    odd = torch.arange(6, dtype=torch.bfloat16, device=DEVICE)[1::2][:1]
    assert odd.is_contiguous() and odd.stride() == (2,)
    sources = [odd, torch.arange(5, dtype=torch.bfloat16, device=DEVICE)]
    dst = torch.full((8,), -1.0, dtype=torch.bfloat16, device=DEVICE)
    pack(dst, sources, [0, 2], fresh=True)
    assert is_the_pack(dst, sources, [0, 2]) and sorted(_which(led[0], sources)) == [0, 1]


def test_a_bad_source_in_a_turn_after_the_lead_is_named_by_its_index_in_the_whole_job(monkeypatch):
    """Some pieces lead, the rest goes in turns (re-indexed): the error still names the culprit as one plan does."""
    monkeypatch.setattr(turns_module, "LEAD_BYTES", 10 * 4)  # sources_of makes 1-9 elements: only these three lead
    led = _recorded_lead(monkeypatch)
    sources = sources_of(N, torch.float32, seed=17)
    for k in (2, 40, 90):
        sources[k] = torch.arange(12, dtype=torch.float32, device=DEVICE)  # these lead
    offsets = [16 * k for k in range(len(sources))]
    bad = len(sources) - 5
    sources[bad] = sources[bad].to(torch.float64)
    with pytest.raises(TypeError) as whole:
        pack(torch.empty(16 * len(sources), device=DEVICE), sources, offsets)
    with pytest.raises(TypeError) as fresh:
        pack(torch.empty(16 * len(sources), device=DEVICE), sources, offsets, fresh=True)
    assert [_which(e, sources) for e in led] == [[2, 40, 90]]
    assert f"sources[{bad}]" in str(fresh.value) and str(fresh.value) == str(whole.value)


# ------------------------------------------------------------------------------------------ a fresh pack's errors


def _roomy_job(n: int = N, seed: int = 21):
    """``n`` sources of 1-9 elements, each followed by a gap of 0-9 elements."""
    sources = sources_of(n, torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    offsets, at = [], 0
    for src in sources:
        offsets.append(at)
        at += src.numel() + int(torch.randint(0, 10, (), generator=g))
    return sources, offsets, at


def test_a_bad_source_where_the_kernels_cannot_run_gets_the_one_plans_error(monkeypatch):
    """One plan checks the pieces before the device: a bad source is named even where the kernels cannot run."""

    def cannot_run(dst):
        raise ValueError("the kernels cannot run here")

    monkeypatch.setattr(turns_module, "check_launchable", cannot_run)
    monkeypatch.setattr(plan_module, "check_launchable", cannot_run)
    sources, offsets, at = _roomy_job()
    sources[150] = sources[150].to(torch.float64)
    with pytest.raises(TypeError) as whole:
        pack(torch.empty(at, device=DEVICE), sources, offsets)
    with pytest.raises(TypeError) as fresh:
        pack(torch.empty(at, device=DEVICE), sources, offsets, fresh=True)
    assert str(fresh.value) == str(whole.value) and "sources[150]" in str(fresh.value)
    sources[150] = sources[150].to(torch.float32)
    with pytest.raises(ValueError, match="cannot run here"):
        pack(torch.empty(at, device=DEVICE), sources, offsets, fresh=True)


# --------------------------------------------------------------------------------------------
# pack's ``meanwhile``: the caller's host work, once the first copies are issued.


def _steps(monkeypatch, module=turns_module) -> list[str]:
    """Record, in order, the lead's copies, the plans made (a turn's, or one plan run whole), and the reads of the
    whole job (``pack_pieces``) of ``module``'s packs; a test appends its own steps to the same list."""
    steps = (("_copy_lead", "lead"), ("make_plan", "plan"), ("run_plan", "one plan"), ("pack_pieces", "job read"))
    return record_calls(monkeypatch, [(module, name, label) for name, label in steps if hasattr(module, name)])


@pytest.mark.parametrize("first", ["lead", "lead, then turns", "first turn by room", "nothing first", "not fresh"])
def test_meanwhile_runs_once_the_device_has_the_first_copies(monkeypatch, first):
    """Fresh: after the lead and the first of the turns where the job goes in turns, else before its one plan
    after the lead; not fresh: before the job is read."""
    from ztriton.kernels import ops as ops_module

    if first.startswith("lead"):
        monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 4)
        counts = [3, 9, 1, 12, 2, 16, 4] * (N // 7 if first == "lead, then turns" else 1)
        sources = _sized_sources(counts, dtype=torch.float32, seed=12)
        offsets = np.concatenate([[0], np.cumsum([n + 1 for n in counts])[:-1]]).tolist()
        dst = torch.full((sum(counts) + len(counts),), 7.0, device=DEVICE)
    elif first == "nothing first":
        sources, offsets = _sized_sources([3, 5], dtype=torch.float32, seed=3), [0, 4]
        dst = torch.full((10,), 7.0, device=DEVICE)
    else:
        sources, offsets, dst = _roomy_pack()
    steps = _steps(monkeypatch, ops_module if first == "not fresh" else turns_module)
    pack(dst, sources, offsets, fresh=first != "not fresh", meanwhile=lambda: steps.append("meanwhile"))
    expected = {"lead": ["lead", "job read", "meanwhile", "one plan"],
                "lead, then turns": ["lead", "job read", "plan", "meanwhile", "plan"],
                "first turn by room": ["plan", "job read", "plan", "meanwhile", "plan"],
                "nothing first": ["job read", "meanwhile", "one plan"],
                "not fresh": ["meanwhile", "job read", "one plan"]}[first]
    assert steps[:len(expected)] == expected and steps.count("meanwhile") == 1
    assert is_the_pack(dst, sources, offsets)


class _CallersCheck(ValueError):
    pass


@pytest.mark.parametrize("first", ["lead", "first turn by room"])
def test_what_meanwhile_raises_propagates_and_comes_before_a_first_turns_error(monkeypatch, first):
    """meanwhile's error propagates (dst then partly written: a fresh one); where the first turn's own plan refuses
    a source, meanwhile still runs first, so that a caller's check naming the culprit wins over the plan's error."""
    if first == "lead":
        monkeypatch.setattr(turns_module, "LEAD_BYTES", 8 * 4)
        sources, offsets = _sized_sources([12, 3, 16], dtype=torch.float32, seed=5), [0, 13, 17]
        dst = torch.full((33,), 7.0, device=DEVICE)
    else:
        sources, offsets, dst = _roomy_pack()
        sources[_by_room(offsets, dst.numel())[0]] = torch.ones(4, dtype=torch.float64, device=DEVICE)
    steps = _steps(monkeypatch)

    def refuse():
        steps.append("meanwhile")
        raise _CallersCheck("the caller's check")

    with pytest.raises(_CallersCheck):
        pack(dst, sources, offsets, fresh=True, meanwhile=refuse)
    assert steps[0] == {"lead": "lead", "first turn by room": "plan"}[first]
    assert steps[-1] == "meanwhile" and steps.count("meanwhile") == 1
    if first == "first turn by room":  # without a caller's check: the one plan's error, naming that source
        with pytest.raises(TypeError) as one_plan:
            pack(torch.empty_like(dst), sources, offsets)
        with pytest.raises(TypeError) as fresh:
            pack(dst, sources, offsets, fresh=True, meanwhile=lambda: None)
        assert str(fresh.value) == str(one_plan.value)
