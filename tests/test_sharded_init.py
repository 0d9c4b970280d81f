"""Exact sharded init on the CPU: recording on placeholders, replay of each rank's slice, generator
states, fallbacks; and the CUDA window arithmetic against a model of ATen's kernels.

The oracle of every value check is torch itself: the same calls, same seed, on a full tensor of the
same dtype and device. Equality is on the bits (int views), never approximate.
"""
from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ztriton.sharded_init import Recorder, agree, materialise, placeholder, replay
from ztriton.sharded_init import philox, rng, selfcheck
from ztriton.sharded_init.record import RandomOp
from ztriton.sharded_init.replay import generate_range

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
          torch.float64: torch.int64}
fast = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF[t.dtype])


def rank_slice(numel: int, world: int, rank: int) -> tuple[int, int]:
    """ZeRO-3's partition of ``rank``: start and count (padding included)."""
    psize = (numel + (world - numel % world) % world) // world
    return rank * psize, psize


def assert_slices_match(record, full: torch.Tensor, world: int) -> None:
    """Every rank's replayed partition equals the full tensor's slice; padding is zero."""
    flat = full.reshape(-1)
    for rank in range(world):
        start, count = rank_slice(flat.numel(), world, rank)
        out = torch.full((count,), 7, dtype=full.dtype)
        replay(record, out, start, count)
        valid = max(0, min(count, flat.numel() - start))
        assert torch.equal(bits(out[:valid]), bits(flat[start:start + valid])), f"rank {rank} of {world}"
        assert not bits(out[valid:]).any(), f"rank {rank} of {world}: padding is not zero"


# ---- inits: each is a function of the tensor, run once on a real tensor and once on a placeholder

def _trunc(t, **kw):
    torch.nn.init.trunc_normal_(t, **kw)


INITS = {
    "normal_": lambda t: torch.nn.init.normal_(t, 0.1, 0.02),
    "uniform_": lambda t: torch.nn.init.uniform_(t, -0.3, 0.7),
    "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    "trunc_normal_rejecting": lambda t: torch.nn.init.trunc_normal_(t, std=1.0, a=-1.0, b=1.5),
    "trunc_normal_narrow": lambda t: torch.nn.init.trunc_normal_(t, mean=0.0, std=1.0, a=1.0, b=3.0),
    "xavier_uniform_": lambda t: torch.nn.init.xavier_uniform_(t, gain=1.3),
    "xavier_normal_": lambda t: torch.nn.init.xavier_normal_(t),
    "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t: torch.nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu"),
    "constant_": lambda t: torch.nn.init.constant_(t, 0.3),
    "zeros_": lambda t: torch.nn.init.zeros_(t),
    "ones_": lambda t: torch.nn.init.ones_(t),
    "Tensor.normal_": lambda t: t.normal_(),
    "Tensor.uniform_": lambda t: t.uniform_(2.0, 5.0),
    "Tensor.fill_": lambda t: t.fill_(-1.25),
    "Tensor.zero_": lambda t: t.zero_(),
    "trunc_normal_ then mul_": lambda t: (torch.nn.init.trunc_normal_(t, std=0.5), t.mul_(0.5)),
    "normal_ add_ clamp_": lambda t: (t.normal_(), t.add_(1.0), t.clamp_(-0.5, 1.5)),
    "uniform_ then normal_": lambda t: (t.uniform_(), t.normal_(0.0, 3.0)),
    "normal_ then fill_": lambda t: (t.normal_(), t.fill_(2.0)),
    "fill_ then div_": lambda t: (t.fill_(3.0), t.div_(7.0)),
    "through .data": lambda t: t.data.normal_(0.0, 0.5),
    "through a flat view": lambda t: t.view(-1).uniform_(-1.0, 1.0),
    "uninitialised then add_": lambda t: t.add_(2.0),
}


def run_reference(init, shape, dtype, seed):
    """The full-tensor path: the tensor, the generator state after, and the next random numbers."""
    torch.manual_seed(seed)
    full = torch.zeros(shape, dtype=dtype)  # a placeholder's uninitialised values replay as zeros
    with torch.no_grad():
        init(torch.nn.Parameter(full))
    state = torch.get_rng_state()
    return full, state, torch.rand(4)


def run_recorded(init, shape, dtype, seed):
    torch.manual_seed(seed)
    with Recorder() as recorder:
        param = torch.nn.Parameter(recorder.placeholder(shape, dtype))
        with torch.no_grad():
            init(param)
        record = recorder.record_of(param)
    return record, torch.get_rng_state()


@pytest.mark.parametrize("name", list(INITS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_replay_is_bit_identical_to_the_full_calls(name, dtype):
    init = INITS[name]
    shape = (37, 29)  # odd numel, not a multiple of any W > 1 below
    full, state_full, after_full = run_reference(init, shape, dtype, seed=1234)
    record, state_recorded = run_recorded(init, shape, dtype, seed=1234)
    assert torch.equal(state_recorded, state_full), "recording must advance the generator as the full calls do"
    for world in (1, 3, 8):
        assert_slices_match(record, full, world)
    assert torch.equal(torch.get_rng_state(), state_full), "replay must leave the generator where it was"
    assert torch.equal(torch.rand(4), after_full)


@given(name=st.sampled_from(sorted(INITS)), dtype=st.sampled_from(DTYPES),
       shape=st.sampled_from([(1, 1), (2, 1), (1, 17), (5, 3), (16, 16), (33, 2), (7, 11), (64, 3), (3, 101)]),
       world=st.integers(1, 9), seed=st.integers(0, 2**31))
@fast
def test_replay_matches_full_calls_for_drawn_shapes(name, dtype, shape, world, seed):
    init = INITS[name]
    full, state_full, _ = run_reference(init, shape, dtype, seed)
    record, state_recorded = run_recorded(init, shape, dtype, seed)
    assert torch.equal(state_recorded, state_full)
    assert_slices_match(record, full, world)


def test_cast_to_the_target_dtype_is_replayed_after_the_ops():
    """zero.Init's create-then-convert (torch.full/randn in fp32, then .data = .data.to(bf16))."""
    torch.manual_seed(5)
    ref = torch.empty(13, 7).normal_(0.0, 2.0).to(torch.bfloat16).mul_(3.0)
    torch.manual_seed(5)
    with Recorder() as recorder:
        t = recorder.placeholder((13, 7), torch.float32)
        t.normal_(0.0, 2.0)
        t.data = t.data.to(torch.bfloat16)
        t.mul_(3.0)
        record = recorder.record_of(t)
        assert t.dtype == torch.bfloat16 and record.dtype == torch.bfloat16
    assert_slices_match(record, ref, 3)


def test_interleaved_real_random_calls_see_the_same_numbers():
    torch.manual_seed(9)
    a = torch.empty(40, 3)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    r1 = torch.randn(6)
    b = torch.empty(17, dtype=torch.bfloat16).normal_()
    r2 = torch.rand(5)
    torch.manual_seed(9)
    with Recorder() as recorder:
        pa = recorder.placeholder((40, 3))
        torch.nn.init.kaiming_uniform_(pa, a=math.sqrt(5))
        s1 = torch.randn(6)
        pb = recorder.placeholder((17,), torch.bfloat16)
        pb.normal_()
        s2 = torch.rand(5)
        ra, rb = recorder.record_of(pa), recorder.record_of(pb)
    assert torch.equal(s1, r1) and torch.equal(s2, r2)
    assert_slices_match(ra, a, 3)
    assert_slices_match(rb, b, 8)


def test_an_explicit_generator_is_recorded_and_the_default_one_untouched():
    gen = torch.Generator().manual_seed(77)
    ref = torch.empty(50).uniform_(generator=gen)
    default_before = torch.get_rng_state()
    gen.manual_seed(77)
    with Recorder() as recorder:
        t = recorder.placeholder((50,))
        torch.nn.init.uniform_(t, generator=gen)
        record = recorder.record_of(t)
    assert torch.equal(torch.get_rng_state(), default_before)
    after_record = gen.get_state()
    assert_slices_match(record, ref, 3)
    assert torch.equal(gen.get_state(), after_record)


# ---- modules

def test_nested_modules_reset_parameters_on_placeholders():
    torch.manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.Linear(19, 23), torch.nn.Embedding(31, 5))
    ref_next = torch.rand(3)
    torch.manual_seed(3)
    with Recorder() as recorder:
        model = torch.nn.Sequential(torch.nn.Linear(19, 23, device="meta"), torch.nn.Embedding(31, 5, device="meta"))
        # replace the meta params by placeholders and re-run reset_parameters in construction order
        torch.manual_seed(3)
        for layer in model:
            for name, p in list(layer.named_parameters()):
                setattr(layer, name, torch.nn.Parameter(recorder.placeholder(p.shape, p.dtype)))
            layer.reset_parameters()
        taken = {f"{i}.{n}": (p, r) for i, layer in enumerate(model) for n, p, r in recorder.take_parameters(layer)}
    assert torch.equal(torch.rand(3), ref_next)
    for name, ref_param in ref.named_parameters():
        new_param, record = taken[name]
        assert record is not None, name
        assert new_param.shape == ref_param.shape and new_param.stride() == (0,) * ref_param.dim()
        assert dict(model.named_parameters())[name] is new_param
        assert_slices_match(record, ref_param.detach(), 3)


def test_take_parameters_copies_attributes_and_keeps_ties():
    with Recorder() as recorder:
        module = torch.nn.Module()
        ph = recorder.placeholder((4, 4))
        module.w = torch.nn.Parameter(ph)
        module.w._no_weight_decay = True
        module.register_parameter("tied", module.w)
        module.plain = torch.nn.Parameter(torch.ones(2))
        taken = recorder.take_parameters(module)
    assert [n for n, _, _ in taken] == ["w"]
    assert module.w is module.tied and module.w._no_weight_decay is True
    assert not module.w.is_meta and module.plain.device.type == "cpu"


def test_buffers_and_attributes_are_materialised():
    torch.manual_seed(2)
    ref = torch.empty(6, 5).normal_()
    torch.manual_seed(2)
    with Recorder() as recorder:
        module = torch.nn.Module()
        buf = recorder.placeholder((6, 5))
        buf.normal_()
        module.register_buffer("buf", buf)
        module.scale = recorder.placeholder((3,)).fill_(2.0)
        assert recorder.take_tensors(module) == ["buf", "scale"]
    assert torch.equal(module.buf, ref) and torch.equal(module.scale, torch.full((3,), 2.0))


def _mode_depths() -> tuple[int, int]:
    from torch.utils._python_dispatch import _len_torch_dispatch_stack

    return torch._C._len_torch_function_stack(), _len_torch_dispatch_stack()


def test_modes_watch_only_while_a_placeholder_is_held():
    """Every op of a construction pays for a Python mode: none is pushed until a placeholder exists, and
    they go when the last record is released."""
    base = _mode_depths()
    with Recorder() as recorder:
        assert _mode_depths() == base
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(recorder.placeholder((4, 4)))
        assert _mode_depths() == (base[0] + 1, base[1] + 1)
        torch.nn.init.normal_(module.w)
        assert module.w.device.type == "cpu"  # answered by the function mode
        (_, _, record), = recorder.take_parameters(module)
        recorder.release(record)
        assert _mode_depths() == base
        recorder.placeholder((2, 2))  # watched again
        assert _mode_depths() == (base[0] + 1, base[1] + 1)
    assert _mode_depths() == base


def test_a_mode_pushed_after_ours_keeps_ours_until_the_recorder_exits():
    from torch.overrides import TorchFunctionMode

    base = _mode_depths()
    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(recorder.placeholder((4, 4)))
        with Count():
            (_, _, record), = recorder.take_parameters(module)
            recorder.release(record)  # ours are not innermost: they stay, and Count's exit pops Count
            assert _mode_depths() == (base[0] + 2, base[1] + 1)
            torch.ones(2).add_(1)
        assert seen and _mode_depths() == (base[0] + 1, base[1] + 1)
    assert _mode_depths() == base


def test_no_placeholder_under_a_mode_entered_after_the_recorder():
    """Our modes would land above a user's mode, whose exit would pop ours: no placeholder is made there
    (can_watch says so, placeholder() raises naming why), and nothing is left on the stacks."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassingDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    base = _mode_depths()
    with Recorder() as recorder:
        for mode in (Passing, PassingDispatch):
            with mode():
                assert not recorder.can_watch()
                with pytest.raises(RuntimeError, match="another torch mode is active"):
                    recorder.placeholder((4, 4))
            assert _mode_depths() == base and recorder.can_watch()
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(recorder.placeholder((4, 4)))
        with Passing():  # entered after ours: it exits first, ours stay and keep recording
            torch.nn.init.normal_(module.w)
        assert [op.describe() for op in recorder.record_of(module.w).ops] == ["normal_.default()"]
    assert _mode_depths() == base


def test_a_device_context_does_not_stop_placeholders():
    """torch.device(...) keeps itself at the bottom of the stack: ours may go above it."""
    with torch.device("cpu"), Recorder() as recorder:
        assert recorder.can_watch()
        t = recorder.placeholder((3,))
        t.fill_(2.0)
        assert recorder.record_of(t).ops


def test_no_placeholder_from_another_thread():
    """Torch's mode stacks are per thread and the recorder's exit pops its own thread's: another thread
    gets no placeholder, and the recorder still exits cleanly."""
    import threading

    base = _mode_depths()
    errors = []
    with Recorder() as recorder:
        def elsewhere():
            errors.append(recorder.can_watch())
            try:
                recorder.placeholder((4, 4))
            except RuntimeError as exc:
                errors.append(str(exc))

        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join(10)
        assert recorder.can_watch()
    assert errors[0] is False and "not the thread that entered" in errors[1]
    assert _mode_depths() == base


# ---- placeholders look like the tensor they stand for

def test_placeholder_answers_as_the_device_it_stands_for():
    with Recorder() as recorder:
        t = recorder.placeholder((3, 2), torch.bfloat16, "cuda:1")
        p = torch.nn.Parameter(t)
        for x in (t, p, p.data, p.view(-1)):
            assert x.device == torch.device("cuda", 1) and not x.is_meta and x.is_cuda and not x.is_cpu
            assert x.get_device() == 1
        assert t.to("cuda:1") is t and t.cuda() is t and t.to(torch.device("cuda", 1), torch.bfloat16) is t
        assert p.dtype == torch.bfloat16 and p.shape == (3, 2) and p.requires_grad
    assert t.is_meta  # outside the recorder, the truth


def test_factory_ops_on_a_placeholder_make_real_tensors():
    with Recorder() as recorder:
        t = recorder.placeholder((3, 4), torch.float16)
        for made in (torch.empty_like(t), torch.zeros_like(t), t.new_zeros(5), t.new_ones((2, 2)), t.new_full((2,), 3.0)):
            assert made.device.type == "cpu" and not made.is_meta and made.dtype == torch.float16
        assert torch.equal(torch.ones_like(t), torch.ones(3, 4, dtype=torch.float16))
        assert recorder.record_of(t).ops == [] and not recorder.fallbacks


def test_placeholder_needs_an_active_recorder():
    with pytest.raises(RuntimeError, match="active Recorder"):
        placeholder((2,))
    recorder = Recorder()
    with pytest.raises(RuntimeError, match="recorder to be active"):
        recorder.placeholder((2,))


def test_in_place_init_on_a_leaf_that_requires_grad_still_raises():
    with Recorder() as recorder:
        p = torch.nn.Parameter(recorder.placeholder((4,)))
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            p.normal_()
        assert recorder.record_of(p).ops == []


# ---- transformers

def test_transformers_wrappers_are_recorded_and_honour_is_hf_initialized():
    initialization = pytest.importorskip("transformers.initialization")
    torch.manual_seed(4)
    ref = torch.empty(21, 6)
    initialization.trunc_normal_(ref, std=0.02)
    initialization.normal_(ref, std=0.5)
    torch.manual_seed(4)
    with Recorder() as recorder:
        t = recorder.placeholder((21, 6))
        initialization.trunc_normal_(t, std=0.02)
        initialization.normal_(t, std=0.5)
        done = torch.nn.Parameter(recorder.placeholder((5,)))
        done._is_hf_initialized = True
        initialization.normal_(done)
        record = recorder.record_of(t)
        assert len(record.ops) >= 2 and recorder.record_of(done).ops == []
    assert_slices_match(record, ref, 8)


def test_no_init_weights_generates_nothing():
    initialization = pytest.importorskip("transformers.initialization")
    torch.manual_seed(6)
    state = torch.get_rng_state()
    with Recorder() as recorder, initialization.no_init_weights():
        layer = torch.nn.Linear(8, 3, device="meta")
        layer.weight = torch.nn.Parameter(recorder.placeholder((3, 8)))
        layer.bias = torch.nn.Parameter(recorder.placeholder((3,)))
        layer.reset_parameters()
        records = [recorder.record_of(layer.weight), recorder.record_of(layer.bias)]
    assert all(r.ops == [] for r in records)
    assert torch.equal(torch.get_rng_state(), state)
    out = torch.full((24,), 5.0)
    replay(records[0], out, 0, 24)
    assert not out.any()


# ---- fallbacks: materialise (the recorded ops replayed on the full tensor), then run the op

def _orthogonal(t):
    torch.nn.init.orthogonal_(t)


def _sparse(t):
    t.normal_()
    torch.nn.init.sparse_(t, sparsity=0.3)


def _slice_assign(t):
    t.normal_()
    t[2] = 1.5
    t[:, 1].mul_(3.0)


def _copy_from(t):
    t.uniform_()
    t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
    t.add_(1.0)


def _partial_normal(t):
    t.zero_()
    t[1:].normal_()


FALLBACKS = {"orthogonal_": _orthogonal, "sparse_": _sparse, "slicing assignment": _slice_assign,
             "copy_ from another tensor": _copy_from, "normal_ on a part": _partial_normal}


@pytest.mark.parametrize("name, dtype", [(n, d) for n in FALLBACKS for d in (torch.float32, torch.bfloat16)
                                         if not (n == "orthogonal_" and d == torch.bfloat16)])  # geqrf: fp32 only
def test_fallbacks_log_once_and_match_the_full_path(name, dtype, caplog):
    fn = FALLBACKS[name]
    shape = (9, 7)
    torch.manual_seed(11)
    ref = torch.empty(shape, dtype=dtype)
    with torch.no_grad():
        fn(ref)
    ref_next = torch.rand(3)
    torch.manual_seed(11)
    with caplog.at_level(logging.WARNING, logger="ztriton"), Recorder() as recorder:
        param = torch.nn.Parameter(recorder.placeholder(shape, dtype))
        with torch.no_grad():
            fn(param)
            param.mul_(1.0)  # later ops on a materialised placeholder: no second log line
        module = torch.nn.Module()
        module.weight = param
        [(_, new, record)] = recorder.take_parameters(module)
    lines = [r.getMessage() for r in caplog.records if "cannot be recorded" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "placeholder (9, 7)" in lines[0] and ("aten." in lines[0] or "__setitem__" in lines[0])
    assert record is None and torch.equal(bits(new.detach()), bits(ref))
    assert torch.equal(torch.rand(3), ref_next)


def test_fallback_log_names_the_init_function(caplog):
    with caplog.at_level(logging.WARNING, logger="ztriton"), Recorder() as recorder:
        torch.nn.init.orthogonal_(recorder.placeholder((4, 4)))
    [line] = [r.getMessage() for r in caplog.records if "cannot be recorded" in r.getMessage()]
    assert "torch.nn.init.orthogonal_" in line and "test_sharded_init.py" in line


def test_arithmetic_use_materialises_with_the_same_values(caplog):
    torch.manual_seed(8)
    ref = torch.empty(5, 4).normal_()
    ref_scaled = ref * 2 + 1
    torch.manual_seed(8)
    with caplog.at_level(logging.WARNING, logger="ztriton"), Recorder() as recorder:
        t = recorder.placeholder((5, 4))
        t.normal_()
        scaled = t * 2 + 1
        assert not scaled.is_meta and torch.equal(scaled, ref_scaled)
        assert torch.equal(recorder.real(t), ref)
        assert float(t.sum()) == float(ref.sum())
    assert sum("cannot be recorded" in r.getMessage() for r in caplog.records) == 1


def test_data_set_to_a_real_tensor_stands_for_it():
    with Recorder() as recorder:
        p = torch.nn.Parameter(recorder.placeholder((3, 3)))
        value = torch.arange(9.0).view(3, 3)
        p.data = value
        p.data.add_(1.0)  # an alias of the placeholder: lands in value, as with a real tensor
        assert torch.equal(value, torch.arange(9.0).view(3, 3) + 1)
        with pytest.raises(NotImplementedError, match="same shape"):
            torch.nn.Parameter(recorder.placeholder((2,))).data = torch.zeros(3)


# ---- replay's arguments

def test_replay_rejects_bad_destinations_before_writing():
    with Recorder() as recorder:
        t = recorder.placeholder((10,), torch.bfloat16)
        t.normal_()
        record = recorder.record_of(t)
    good = torch.full((4,), 3.0, dtype=torch.bfloat16)
    for out, start, count, match in [(torch.full((4,), 3.0), 0, 4, "float32"), (good, 0, 5, "holds 4"),
                                     (good.view(2, 2), 0, 4, "1-D"), (good, -1, 4, ">= 0")]:
        with pytest.raises(ValueError, match=match):
            replay(record, out, start, count)
        assert torch.equal(good, torch.full((4,), 3.0, dtype=torch.bfloat16))


def test_replay_past_the_end_is_all_padding():
    with Recorder() as recorder:
        t = recorder.placeholder((5,))
        t.fill_(1.0)
        record = recorder.record_of(t)
    out = torch.full((4,), 9.0)
    replay(record, out, 8, 4)
    assert not out.any()
    replay(record, out, 3, 4)
    assert out.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.equal(materialise(record), torch.ones(5))


# ---- agreement on rank 0's generator states (real gloo world: values travel)

def _agree_rank(rank, world_size):
    torch.manual_seed(100 + rank)  # ranks disagree, as they may without a common seed
    own_after = torch.empty(30).normal_()
    own_state = torch.get_rng_state()
    torch.manual_seed(100 + rank)
    with Recorder() as recorder:
        t = recorder.placeholder((30,))
        t.normal_()
        record = recorder.record_of(t)
    assert torch.equal(torch.get_rng_state(), own_state)
    agree([record], None)
    start, count = rank_slice(30, world_size, rank)
    out = torch.empty(count)
    replay(record, out, start, count)
    kept = torch.equal(torch.get_rng_state(), own_state)
    torch.manual_seed(100)
    rank0 = torch.empty(30).normal_()
    return torch.equal(out, rank0[start:start + count]), kept, torch.equal(own_after, rank0)


def test_agree_takes_rank_zeros_states_over_gloo(gloo_world):
    results = gloo_world(_agree_rank, 2)
    assert [r[:2] for r in results] == [(True, True), (True, True)]
    assert results[1][2] is False  # the ranks really did start from different states


def test_agree_is_a_no_op_on_a_fake_world(fake_world):
    torch.manual_seed(1)
    with Recorder() as recorder:
        t = recorder.placeholder((6,))
        t.uniform_()
        record = recorder.record_of(t)
    before = record.ops[0].start
    with fake_world(3, 2):
        agree([record], None)
    assert record.ops[0].start == before


# ---- the CUDA arithmetic, against what an H200 measured and against a model of the kernel

H200 = philox.Geometry(132, 2048)


def test_call_layout_matches_the_h200():
    """Offsets measured on an H200 (torch 2.11): 24 for 5,419,065 elements; 8,880 for a 1.2e9-element
    bf16 tensor, which with_32bit_indexing cuts in two (the whole-tensor reservation is spent too)."""
    assert philox.call_layout(5_419_065, 4, H200, 4) == (24, [philox.Piece(0, 5_419_065, 0)])
    total, pieces = philox.call_layout(1_200_000_000, 2, H200, 4)
    assert total == 8880
    assert pieces == [philox.Piece(0, 600_000_000, 4440), philox.Piece(600_000_000, 600_000_000, 6660)]
    assert philox.call_layout(0, 4, H200, 4) == (0, [])


SMALL = philox.Geometry(2, 512)  # 4 blocks of 256 threads: a period of 4096 elements (unroll 4)


def _model_call(n, itemsize, unroll, limit, geometry=SMALL, per_round=4):
    """(thread, philox offset, lane) of every element of one call, from the kernel's description,
    not from :func:`philox.call_layout`: the whole reservation first, then pieces depth first.
    ``per_round`` is the philox offsets a round takes (ATen's 4; a changed kernel's other)."""
    def threads(m):
        return 256 * min(geometry.max_blocks, -(-m // 256))

    def reserve(m):
        return ((m - 1) // (threads(m) * unroll) + 1) * per_round

    def fits(m):
        return m <= limit and 1 + (m - 1) * itemsize <= limit

    out, offset = [], [0]

    def launch(m):
        t = threads(m)
        out.extend((e % t, offset[0] + per_round * (e // (unroll * t)), (e // t) % unroll) for e in range(m))
        offset[0] += reserve(m)

    def split(m):
        if fits(m):
            launch(m)
        else:
            split(m // 2)
            split(m - m // 2)

    if n:
        if fits(n):
            launch(n)
        else:
            offset[0] += reserve(n)
            split(n)
    return out, offset[0]


@given(n=st.integers(1, 40_000), itemsize=st.sampled_from([2, 4, 8]), data=st.data(),
       limit=st.sampled_from([philox.INT32_MAX, 20_001, 33_333]))
@fast
def test_windows_reproduce_every_element_of_the_call(n, itemsize, data, limit):
    unroll = 2 if itemsize == 8 else 4
    model, total = _model_call(n, itemsize, unroll, limit)
    got_total, pieces = philox.call_layout(n, itemsize, SMALL, unroll, limit)
    assert got_total == total
    begin = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(begin + 1, n))
    longest = data.draw(st.sampled_from([None, 4096, 3 * 4096]))
    covered = begin
    for w in philox.windows(pieces, begin, end, SMALL, unroll, itemsize, longest, limit):
        assert w.keep_start == covered and w.keep_end > w.keep_start  # in order, no gap, no overlap
        covered = w.keep_end
        fresh, _ = _model_call(w.length, itemsize, unroll, limit)  # a fresh call on the window tensor
        assert len(fresh) == w.length, "a window must not be split itself"
        for e in range(w.keep_start, w.keep_end):
            thread, offset, lane = fresh[e - w.start]
            assert (thread, offset + w.offset, lane) == model[e], (e, w)
    assert covered == end


class ModelDraws:
    """Stands in for the CUDA generator: element i of a fresh call at ``offset`` gets a value made
    from (thread, offset, lane) of the model, so a misplaced element shows."""

    def __init__(self, itemsize, unroll, limit):
        self.itemsize, self.unroll, self.limit = itemsize, unroll, limit
        self.calls = []

    def geometry(self, device):
        return SMALL

    def fill(self, op, target, offset):
        elements, _ = _model_call(target.numel(), self.itemsize, self.unroll, self.limit)
        values = [(t * 7919 + (o + offset) * 104729 + lane * 13) % (1 << 23) for t, o, lane in elements]
        target.copy_(torch.tensor(values, dtype=target.dtype))
        self.calls.append((target.numel(), target.data_ptr()))


@given(n=st.integers(1, 30_000), data=st.data(), dtype=st.sampled_from([torch.float32, torch.float64]))
@fast
def test_generate_range_places_every_window(n, data, dtype):
    itemsize, unroll, limit = torch.empty((), dtype=dtype).element_size(), philox.unroll(dtype), 33_333
    op = RandomOp(None, (), {}, dtype, torch.Size([n]), None, rng.PhiloxState(0, 0))
    draws = ModelDraws(itemsize, unroll, limit)
    reference, _ = _model_call(n, itemsize, unroll, limit)
    expected = torch.tensor([(t * 7919 + o * 104729 + lane * 13) % (1 << 23) for t, o, lane in reference], dtype=dtype)
    begin = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(begin + 1, n))
    dst = torch.full((end - begin,), -1.0, dtype=dtype)
    generate_range(op, n, dst, begin, end, draws, longest=2 * 4096, limit=limit)
    assert torch.equal(dst, expected[begin:end])
    scratch = [numel for numel, ptr in draws.calls
               if not dst.data_ptr() <= ptr < dst.data_ptr() + dst.numel() * itemsize]
    assert all(numel <= 4096 for numel in scratch) or n < 768, "scratch beyond one period"


# ---- the self-check: does this torch generate as the window arithmetic says? (run against the model)

NORMAL, UNIFORM = torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default
CPU = torch.device("cpu")


def _model_values(elements, base):
    return [(t * 7919 + (o + base) * 104729 + lane * 13) % (1 << 23) for t, o, lane in elements]


class KernelModel:
    """torch's random call as the self-check sees it, from the model of the kernel: each element's value
    made from its (thread, offset, lane), the generator's offset left where the call's reservation ends.
    ``kernel`` is the grid the kernel really uses, ``per_round`` its offsets per round; the check is told
    the geometry of :data:`SMALL`. ``disturb`` makes every call reseed the generator it was given, and
    ``fail_at`` raises that exception on the given call."""

    def __init__(self, kernel=SMALL, per_round=4, disturb=False, fail_at=None):
        self.kernel, self.per_round, self.disturb, self.fail_at = kernel, per_round, disturb, fail_at
        self.offset, self.calls = None, 0

    def geometry(self, device):
        return SMALL

    def fill(self, op, target, offset):
        self.calls += 1
        if self.disturb:
            op.generator.manual_seed(self.calls)
        if self.fail_at is not None and self.calls == self.fail_at[0]:
            raise self.fail_at[1]
        elements, total = _model_call(target.numel(), target.element_size(), philox.unroll(op.dtype),
                                      philox.INT32_MAX, self.kernel, self.per_round)
        target.copy_(torch.tensor(_model_values(elements, op.start.offset + offset), dtype=target.dtype))
        self.offset = op.start.offset + offset + total

    def state(self, op):
        return rng.PhiloxState(op.start.seed, self.offset)


@pytest.fixture
def checked_on_cpu(monkeypatch):
    """The self-check run for CPU placeholders too, against a fresh :class:`KernelModel`, with no verdict
    yet in this process."""
    model = KernelModel()
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selfcheck, "WINDOWED", ("cuda", "cpu"))
    monkeypatch.setattr(selfcheck, "draws_for", lambda device: model)
    return model


def _check_lines(caplog):
    return [r.getMessage() for r in caplog.records if "window replay of" in r.getMessage()]


@pytest.mark.parametrize("func", [NORMAL, UNIFORM])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_self_check_passes_against_the_model_of_the_kernel(func, dtype):
    assert selfcheck.check(func, dtype, CPU, KernelModel(), torch.Generator()) == []


def test_self_check_windows_start_past_zero_and_cross_period_boundaries():
    """The cases must exercise what a real replay does: windows at offsets past the call's base, an
    unaligned head through scratch, a window across a period boundary, and a tail padded to a grid."""
    period = 4 * 256 * SMALL.max_blocks
    (n, ranges), _ = selfcheck._cases(period)
    assert n > 2 * period
    _, pieces = philox.call_layout(n, 4, SMALL, 4)
    windows = [w for begin, end in ranges for w in philox.windows(pieces, begin, end, SMALL, 4, 4)]
    assert any(w.offset > 0 for w in windows) and any(not w.exact for w in windows)
    assert any(w.keep_start < k * period < w.keep_end for w in windows for k in (1, 2))
    assert any(w.length > w.keep_end - w.start for w in windows)


@pytest.mark.parametrize("kernel, per_round, expected", [
    (philox.Geometry(2, 768), 4, ["reserved 8 offsets, replay assumes 12", "differ"]),  # one more block per SM
    (SMALL, 8, ["reserved 24 offsets, replay assumes 12", "differ"]),  # 8 offsets per round
])
def test_self_check_finds_a_changed_kernel(kernel, per_round, expected):
    differences = selfcheck.check(NORMAL, torch.float32, CPU, KernelModel(kernel, per_round), torch.Generator())
    for text in expected:
        assert any(text in d for d in differences), differences


def test_a_failed_check_falls_back_to_full_generation_in_one_line(checked_on_cpu, monkeypatch, caplog):
    """normal_ on float32 fails its check (the comparison says every window differs): each such call
    materialises its tensor as full generation does, with one line for the kind; bfloat16 uniform_
    passes and is still recorded and replayed."""
    same = selfcheck._same_bytes
    monkeypatch.setattr(selfcheck, "_same_bytes", lambda a, b: a.dtype != torch.float32 and same(a, b))
    torch.manual_seed(21)
    ref = [torch.empty(6, 5).normal_(0.0, 0.02), torch.empty(9).fill_(1.0).normal_().mul_(3.0),
           torch.empty(4, 4, dtype=torch.bfloat16).uniform_()]
    ref_next = torch.rand(3)
    torch.manual_seed(21)
    with caplog.at_level(logging.DEBUG, logger="ztriton"), Recorder() as recorder:
        module = torch.nn.Module()
        module.a = torch.nn.Parameter(recorder.placeholder((6, 5)))
        module.b = torch.nn.Parameter(recorder.placeholder((9,)))
        module.c = torch.nn.Parameter(recorder.placeholder((4, 4), torch.bfloat16))
        with torch.no_grad():
            module.a.normal_(0.0, 0.02)
            module.b.fill_(1.0)
            module.b.normal_()
            module.b.mul_(3.0)
            module.c.uniform_()
        taken = recorder.take_parameters(module)
    assert [(name, record is None) for name, _, record in taken] == [("a", True), ("b", True), ("c", False)]
    for (_, new, record), expected in zip(taken, ref):
        if record is None:
            assert torch.equal(bits(new.detach()), bits(expected))
        else:
            assert_slices_match(record, expected, 3)
    assert torch.equal(torch.rand(3), ref_next)
    [line] = _check_lines(caplog)
    assert f"torch {torch.__version__} on cpu" in line and "normal_ on torch.float32" in line
    assert "elements [" in line and "differ" in line
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "cannot be recorded" in r.getMessage()]
    assert not warned and len([r for r in caplog.records if "cannot be recorded" in r.getMessage()]) == 2


def test_the_check_runs_once_per_device_and_kind(checked_on_cpu, monkeypatch):
    checked = []
    real = selfcheck.check
    monkeypatch.setattr(selfcheck, "check", lambda func, dtype, *a: checked.append((func, dtype)) or real(func, dtype, *a))
    for func, dtype in [(NORMAL, torch.float32), (NORMAL, torch.float32), (NORMAL, torch.bfloat16),
                        (UNIFORM, torch.float32), (NORMAL, torch.bfloat16)]:
        assert selfcheck.replay_verified(func, dtype, CPU)
    assert checked == [(NORMAL, torch.float32), (NORMAL, torch.bfloat16), (UNIFORM, torch.float32)]


def test_devices_without_windows_are_never_checked(monkeypatch):
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selfcheck, "check", lambda *a: pytest.fail("a CPU generator has no windows to check"))
    assert selfcheck.replay_verified(NORMAL, torch.float32, CPU)
    assert selfcheck._verdicts == {}


def test_the_check_leaves_the_generator_as_it_was(checked_on_cpu):
    checked_on_cpu.disturb = True
    torch.manual_seed(3)
    torch.rand(5)
    state = torch.get_rng_state()
    assert selfcheck.replay_verified(NORMAL, torch.float32, CPU)
    assert checked_on_cpu.calls > 1  # the model really did reseed the generator
    assert torch.equal(torch.get_rng_state(), state)


def test_a_check_that_raises_is_a_failure_and_keeps_the_generator(checked_on_cpu, caplog):
    checked_on_cpu.disturb, checked_on_cpu.fail_at = True, (2, RuntimeError("no such kernel"))
    state = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="ztriton"):
        assert not selfcheck.replay_verified(UNIFORM, torch.float32, CPU)
        assert not selfcheck.replay_verified(UNIFORM, torch.float32, CPU)
    assert torch.equal(torch.get_rng_state(), state)
    [line] = _check_lines(caplog)
    assert "uniform_ on torch.float32" in line and "RuntimeError: no such kernel" in line


def test_out_of_memory_in_the_check_propagates_without_a_verdict(checked_on_cpu):
    checked_on_cpu.disturb, checked_on_cpu.fail_at = True, (1, torch.OutOfMemoryError("out of memory"))
    state = torch.get_rng_state()
    with pytest.raises(torch.OutOfMemoryError):
        selfcheck.replay_verified(NORMAL, torch.float32, CPU)
    assert selfcheck._verdicts == {} and torch.equal(torch.get_rng_state(), state)


def test_the_line_is_said_on_rank_0_only(checked_on_cpu, monkeypatch, caplog):
    monkeypatch.setattr(selfcheck, "_same_bytes", lambda a, b: False)
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="ztriton"):
        assert not selfcheck.replay_verified(NORMAL, torch.float32, CPU)
    assert not _check_lines(caplog)
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="ztriton"):
        assert not selfcheck.replay_verified(NORMAL, torch.bfloat16, CPU)
    assert len(_check_lines(caplog)) == 1
