"""Every public function with arbitrary Python values for each argument (issue 16).

For each (function, argument) pair, the argument is replaced by a drawn junk value (None, strings,
floats, bools, huge and negative ints, lists of junk, dicts, tensors of the wrong dtype, device, dim
or layout) while the others keep valid values. The call either succeeds (the value was acceptable) or
raises a TypeError or ValueError whose message names the argument; and when it raises, no byte of the
destination, of the sources or of any param changed. Any other exception fails the test.

Pairs whose function belongs to another part of the project and that the fuzz found raising another
exception are marked xfail(strict=True) with what was found: they stay visible, and the mark must go
when the owner fixes them. The runs are derandomised so that such a mark is reproducible.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ztriton
from ztriton import layout as zlayout
from ztriton.kernels import bits, copy_chunk, pack, pack_slices, torch_copy_chunk, torch_pack, torch_pack_slices

EXAMPLES = int(os.environ.get("ZT_FUZZ_EXAMPLES", 12))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def junk_tensor(kind: str) -> torch.Tensor:
    return {
        "int8": lambda: torch.ones(3, dtype=torch.int8),
        "meta": lambda: torch.empty(3, device="meta"),
        "0-d": lambda: torch.tensor(1.5),
        "2-d transposed": lambda: torch.ones(2, 3).t(),
        "sparse": lambda: torch.ones(3).to_sparse(),
        "bool": lambda: torch.ones(3, dtype=torch.bool),
        "complex": lambda: torch.ones(3, dtype=torch.complex128),
        "empty": lambda: torch.empty(0),
        "requires_grad": lambda: torch.ones(2, 2, requires_grad=True),
    }[kind]()


JUNK = st.one_of(
    st.none(), st.text(max_size=4), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.sampled_from([2**64, 2**63 - 1, -2**63, 2**70, -1, -7, 0, 1]),
    st.lists(st.one_of(st.none(), st.text(max_size=2), st.integers(-3, 3), st.floats(), st.booleans()), max_size=3),
    st.sampled_from(["int8", "meta", "0-d", "2-d transposed", "sparse", "bool", "complex", "empty",
                     "requires_grad"]).map(junk_tensor),
    st.dictionaries(st.text(max_size=2), st.integers(-2, 2), max_size=2),
    st.builds(object),
)


def snapshot(tensors) -> list:
    return [None if t.device.type == "meta" or t.layout != torch.strided else bits(t.detach()).clone()
            for t in tensors]


def assert_refused_cleanly(call, watched, names):
    """Run ``call``; if it raises, a TypeError/ValueError naming one of ``names``, nothing changed."""
    before = snapshot(watched)
    try:
        call()
    except (TypeError, ValueError) as exc:
        assert any(name in str(exc) for name in names), f"{type(exc).__name__} does not name {names}: {exc}"
        after = snapshot(watched)
        for i, (b, a) in enumerate(zip(before, after)):
            assert (b is None and a is None) or torch.equal(b, a), f"watched tensor {i} changed before the refusal"


def watched_of(args: dict) -> list:
    """Every tensor in the arguments (the valid ones and any junk), nested in lists, tuples, dicts."""
    found = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, torch.nn.Module):
            found.extend(p.data for p in value.parameters())
    for value in args.values():
        walk(value)
    return found


# ------------------------------------------------------------------------------------------- kernels


def poisoned(n, dtype=torch.float32):
    return torch.full((n * torch.empty((), dtype=dtype).element_size(),), 0xA5, dtype=torch.uint8).view(dtype)


def kernel_cases():
    def chunk_args():
        return dict(src=torch.arange(12.0).view(3, 4).t(), dst=poisoned(5), start=2, count=4)

    def pack_args():
        return dict(dst=poisoned(12), sources=[torch.ones(3), torch.arange(4.0).view(2, 2).t()], offsets=[0, 5],
                    window=(1, 9))

    def slices_args():
        return dict(dst=poisoned(8), slices=[(torch.arange(6.0), 1, 3, 0), (torch.ones(2, 2).t(), 0, 4, 4)])

    cases = []
    for impl in (copy_chunk, torch_copy_chunk):
        for arg in ("src", "dst", "start", "count"):
            cases.append((impl.__name__, arg, chunk_args, lambda a, f=impl: f(a["src"], a["dst"], a["start"], a["count"])))
    for impl in (pack, torch_pack):
        for arg in ("dst", "sources", "offsets", "window"):
            cases.append((impl.__name__, arg, pack_args,
                          lambda a, f=impl: f(a["dst"], a["sources"], a["offsets"], window=a["window"])))
    for impl in (pack_slices, torch_pack_slices):
        for arg in ("dst", "slices"):
            cases.append((impl.__name__, arg, slices_args, lambda a, f=impl: f(a["dst"], a["slices"])))
    return cases


# The name a message may use for an argument, where it is not the argument's own.
ALSO_NAMED = {"src": ("src",), "sources": ("sources",), "slices": ("slices",), "dst": ("dst",)}


@pytest.mark.parametrize("func,arg,make,call", kernel_cases(), ids=[f"{c[0]}-{c[1]}" for c in kernel_cases()])
@FUZZ
@given(junk=JUNK)
def test_kernels_refuse_junk(func, arg, make, call, junk):
    args = make()
    args[arg] = junk
    assert_refused_cleanly(lambda: call(args), watched_of(args), ALSO_NAMED.get(arg, (arg,)))


@pytest.mark.parametrize("func,arg,make,call", kernel_cases(), ids=[f"{c[0]}-{c[1]}" for c in kernel_cases()])
@FUZZ
@given(junk=JUNK, slot=st.integers(0, 3))
def test_kernels_refuse_junk_inside_lists(func, arg, make, call, junk, slot):
    """Junk one level down: an element of ``sources``/``offsets``/``slices``/``window``."""
    args = make()
    if arg == "slices":  # one field of one (src, start, count, offset) slice
        entry = list(args["slices"][slot % 2])
        entry[slot] = junk
        args["slices"][slot % 2] = tuple(entry)
    elif isinstance(args[arg], (list, tuple)):
        value = list(args[arg])
        value[slot % len(value)] = junk
        args[arg] = value
    else:
        return  # not a list: covered by test_kernels_refuse_junk
    assert_refused_cleanly(lambda: call(args), watched_of(args), ALSO_NAMED.get(arg, (arg,)))


# -------------------------------------------------------------------------------------------- layout


LAYOUT_CASES = [
    ("zero3_slice", a, lambda: dict(numel=10, world_size=3), lambda k: zlayout.zero3_slice(**k))
    for a in ("numel", "world_size")
] + [
    ("zero12_group_layout", a, lambda: dict(numels=[3, 4, 5], world_size=2, element_size=2, trainable=[True, False, True],
                                            round_robin=True, parameter_alignment=True),
     lambda k: zlayout.zero12_group_layout(k["numels"], k["world_size"], element_size=k["element_size"],
                                           trainable=k["trainable"], round_robin=k["round_robin"],
                                           parameter_alignment=k["parameter_alignment"]))
    for a in ("numels", "world_size", "element_size", "trainable", "round_robin", "parameter_alignment")
] + [
    ("round_robin_order", a, lambda: dict(count=5, world_size=2), lambda k: zlayout.round_robin_order(**k))
    for a in ("count", "world_size")
] + [
    ("param_alignment", a, lambda: dict(element_size=2, enabled=True), lambda k: zlayout.param_alignment(**k))
    for a in ("element_size", "enabled")
] + [
    ("rank_window", "rank", lambda: dict(rank=1), lambda k: zlayout.zero12_group_layout([3, 4], 2, element_size=2).rank_window(k["rank"])),
    ("rank_start", "rank", lambda: dict(rank=1), lambda k: zlayout.zero3_slice(10, 3).rank_start(k["rank"])),
    ("valid_numel", "rank", lambda: dict(rank=1), lambda k: zlayout.zero3_slice(10, 3).valid_numel(k["rank"])),
]


@pytest.mark.parametrize("func,arg,make,call", LAYOUT_CASES, ids=[f"{c[0]}-{c[1]}" for c in LAYOUT_CASES])
@FUZZ
@given(junk=JUNK)
def test_layout_refuses_junk(func, arg, make, call, junk):
    args = make()
    args[arg] = junk
    assert_refused_cleanly(lambda: call(args), [], (arg,))


# ------------------------------------------------------------------ entry points (params must survive)


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))


def _grad_params():
    return [torch.nn.Parameter(torch.arange(7.0)), torch.nn.Parameter(torch.ones(2, 3))]


# (function, argument) pairs of functions owned elsewhere that the fuzz found raising another
# exception class or not naming the argument, each with what it found: they run as xfail(strict=True)
# until fixed. None at present (the last seven, in partition and load_checkpoint, were fixed).
KNOWN_ELSEWHERE: dict[tuple[str, str], str] = {}


def _entry_cases():
    def partition_args():
        return dict(module=_module(), group=None, remote_device=None, pin_memory=True, chunk_bytes=None,
                    headroom_bytes=None, config=None)

    def flatten_args():
        return dict(param_groups=[_grad_params()], group=None, round_robin=False, parameter_alignment=False, tier=None,
                    headroom_bytes=None, chunk_bytes=None)

    def defragment_args():
        return dict(tensors=[torch.arange(5.0), torch.ones(3)], headroom_bytes=None, tier=None)

    def load_args():
        return dict(module=torch.nn.Linear(3, 2), checkpoint=CHECKPOINT, group=None, sources=None, strict=False,
                    progress=False, staging_bytes=None, threads=2)

    return ([("partition", a, partition_args, lambda k: ztriton.partition(**k)) for a in partition_args()]
            + [("flatten_groups", a, flatten_args, lambda k: ztriton.flatten_groups(**k)) for a in flatten_args()]
            + [("defragment", a, defragment_args,
                lambda k: ztriton.defragment(k["tensors"], headroom_bytes=k["headroom_bytes"], tier=k["tier"]))
               for a in defragment_args()]
            + [("load_checkpoint", a, load_args, lambda k: ztriton.load_checkpoint(**k)) for a in load_args()])


CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", ".fuzz_checkpoint.safetensors")  # replaced below


@pytest.fixture(scope="module", autouse=True)
def _checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    global CHECKPOINT
    CHECKPOINT = str(tmp_path_factory.mktemp("fuzz") / "linear.safetensors")
    save_file({"weight": torch.randn(2, 3), "bias": torch.randn(2)}, CHECKPOINT)


def _entry_params():
    cases = []
    for case in _entry_cases():
        reason = KNOWN_ELSEWHERE.get(case[:2])
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        cases.append(pytest.param(*case, marks=marks, id=f"{case[0]}-{case[1]}"))
    return cases


@pytest.mark.parametrize("func,arg,make,call", _entry_params())
@FUZZ
@given(junk=JUNK)
def test_entry_points_refuse_junk(fake_world, func, arg, make, call, junk):
    args = make()
    args[arg] = junk
    if func == "partition":  # needs torch.distributed: a simulated rank of two
        with fake_world(2, 0):
            assert_refused_cleanly(lambda: call(args), watched_of(args), (arg,))
    else:
        assert_refused_cleanly(lambda: call(args), watched_of(args), (arg,))


# Junk one level down in an entry point's params: a group, a group's "params", one param, one partition.
INNER_CASES = [
    ("flatten_groups", "param_groups", lambda junk: ztriton.flatten_groups([{"params": junk}])),
    ("flatten_groups", "param_groups", lambda junk: ztriton.flatten_groups([_grad_params(), junk])),
    ("flatten_groups", "param_groups", lambda junk: ztriton.flatten_groups([[*_grad_params(), junk]])),
    ("defragment", "tensors", lambda junk: ztriton.defragment([torch.arange(5.0), junk])),
]


@pytest.mark.parametrize("func,arg,call", INNER_CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(INNER_CASES)])
@FUZZ
@given(junk=JUNK)
def test_entry_points_refuse_junk_inside_params(func, arg, call, junk):
    assert_refused_cleanly(lambda: call(junk), watched_of({"junk": junk}), (arg,))
