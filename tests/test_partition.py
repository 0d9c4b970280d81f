"""ztriton.partition against deepspeed.zero.Init: partitions, gathers, updates, training, errors.

Each check builds two identical modules (same bits), partitions one with DeepSpeed's ``zero.Init``
and the other with ``ztriton.partition``, and compares ``ds_tensor``'s valid prefix byte for byte.
On the fake process group every rank slices its own values (as zero.Init does there); under gloo the
ranks start from different values and both must end with rank 0's.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ztriton
from ds_reference import BitsModule, bits, gloo_safe_gathers, zero3_reference
from ztriton.layout import zero3_slice

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ds_settings = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
numels = st.one_of(st.integers(1, 9), st.sampled_from([11, 13, 17, 31, 37, 61, 97, 101]), st.integers(1, 300))


@st.composite
def module_shapes(draw):
    """1 to 11 params of 1 to 3 dims, some numels below the world size, primes, mixed."""
    shapes = []
    for _ in range(draw(st.integers(1, 11))):  # both sides of policy.PER_PARAM_COPIES
        numel = draw(numels)
        if draw(st.booleans()) and numel > 1:
            first = draw(st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0]))
            shapes.append([first, numel // first])
        else:
            shapes.append([numel])
    return shapes


class StridedBits(BitsModule):
    """BitsModule whose 2-d params hold transposed views: sources ztriton must read in place."""

    def __init__(self, shapes, seed=0, dtype=None, rank_salt=False):
        super().__init__(shapes, seed=seed, dtype=dtype, rank_salt=rank_salt)
        for name, p in list(self.named_parameters()):
            if p.dim() == 2:
                p.data = p.data.t().contiguous().t()  # same values, column-major storage


def assert_matches_reference(module, reference, world_size, rank):
    """Every param: shape metadata as DeepSpeed's, valid prefix byte-identical, padding zeros."""
    params = dict(module.named_parameters())
    assert sorted(params) == sorted(r.name for r in reference)
    for ref in reference:
        p = params[ref.name]
        sl = zero3_slice(ref.ds_numel, world_size)
        assert (tuple(p.ds_shape), p.ds_numel, p.ds_numel_aligned, p.ds_tensor.ds_numel) == \
               (ref.ds_shape, ref.ds_numel, ref.ds_numel_aligned, ref.partition_numel), ref.name
        assert p.ds_status.name == ref.status == "NOT_AVAILABLE" and p.data.numel() == ref.data_numel == 0
        valid = sl.valid_numel(rank)
        assert torch.equal(bits(p.ds_tensor[:valid].cpu()), bits(ref.partition[:valid])), ref.name
        assert not bits(p.ds_tensor[valid:]).any(), f"{ref.name}: padding is not zero"


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
@settings(ds_settings, max_examples=10)
@given(shapes=module_shapes(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**20), strided=st.booleans(),
       data=st.data())
def test_matches_zero_init_on_fake_group(fake_world, world_size, shapes, dtype, seed, strided, data):
    rank = data.draw(st.integers(0, world_size - 1))
    # DeepSpeed itself refuses strided params (its broadcast views them as bytes): its reference
    # module holds the same values contiguously.
    reference = zero3_reference(lambda: BitsModule(shapes, seed, dtype), world_size, rank, dtype, wrap_existing=True)
    factory = (lambda: StridedBits(shapes, seed, dtype)) if strided else (lambda: BitsModule(shapes, seed, dtype))
    with fake_world(world_size, rank):
        module = factory()
        result = ztriton.partition(module)
    assert result.path == "local" and set(result.buffers) == {dtype}
    assert_matches_reference(module, reference, world_size, rank)
    # every ds_tensor is a view of the one per-rank buffer
    buffer = result.buffers[dtype]
    assert all(p.ds_tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
               for p in module.parameters())


def test_fp8_params_partition_bit_exactly(fake_world):
    shapes = [[7, 3], [5]]
    with fake_world(3, 2):
        module = BitsModule(shapes, seed=4, dtype=torch.float8_e4m3fn)
        full = {n: p.detach().clone() for n, p in module.named_parameters()}
        ztriton.partition(module)
        for name, p in module.named_parameters():
            sl = zero3_slice(full[name].numel(), 3)
            flat = full[name].reshape(-1)[sl.rank_start(2):sl.rank_start(2) + sl.valid_numel(2)]
            assert torch.equal(bits(p.ds_tensor[:sl.valid_numel(2)]), bits(flat))


def test_remote_device_cpu_and_gathered_parameters(fake_world):
    shapes = [[6, 5], [9], [1]]
    with fake_world(1, 0):
        module = StridedBits(shapes, seed=1, dtype=torch.bfloat16)
        full = {n: p.detach().clone() for n, p in module.named_parameters()}
        result = ztriton.partition(module, remote_device="cpu")
        import deepspeed

        assert all(p.ds_tensor.device.type == "cpu" for p in module.parameters())
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            for name, p in module.named_parameters():
                assert torch.equal(bits(p.data), bits(full[name])), name
        assert all(p.data.numel() == 0 for p in module.parameters())
        assert result.buffers[torch.bfloat16].numel() == sum(t.numel() for t in full.values())


def test_repeat_is_refused_and_new_params_alone_are_partitioned(fake_world):
    with fake_world(2, 1):
        module = BitsModule([[4, 4], [3]], seed=2, dtype=torch.float32)
        first = ztriton.partition(module)
        before = [p.ds_tensor.data_ptr() for p in module.parameters()]
        with pytest.raises(ValueError, match=r"already a ZeRO-3 parameter.*partition a module once"):
            ztriton.partition(module)
        assert [p.ds_tensor.data_ptr() for p in module.parameters()] == before
        assert first.buffers[torch.float32].numel() == 8 + 2
        module.extra = torch.nn.Parameter(torch.arange(5, dtype=torch.float32))
        second = ztriton.partition(module)
        assert [p.ds_tensor.data_ptr() for n, p in module.named_parameters() if n != "extra"] == before
        assert [part.name for part in second.partitions] == ["extra"]
        assert torch.equal(module.extra.ds_tensor, torch.tensor([3.0, 4.0, 0.0]))


# --------------------------------------------------------------------------------------------- gloo


def _gloo_partition_and_update(rank, world_size, shapes, dtype, strided):
    """On each rank: different starting values, partition, compare with zero.Init, update, regather."""
    import deepspeed

    cls = StridedBits if strided else BitsModule
    reference = zero3_reference(lambda: BitsModule(shapes, 5, dtype, rank_salt=True), world_size, rank, dtype,
                                wrap_existing=True)
    module = cls(shapes, 5, dtype, rank_salt=True)
    ztriton.partition(module, config={"train_micro_batch_size_per_gpu": 1,
                                      "zero_optimization": {"stage": 3, **gloo_safe_gathers()}})
    assert_matches_reference(module, reference, world_size, rank)
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        gathered = [p.detach().clone() for p in params]
    # Rank 0 modifies; the change is broadcast and re-partitioned into ztriton's buffer views.
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                for p in params:
                    p.add_(1)
    with deepspeed.zero.GatheredParameters(params):
        updated = [p.detach().clone() for p in params]
    return [bits(g).tolist() for g in gathered], [bits(u).tolist() for u in updated], \
        [bits(g + 1).tolist() for g in gathered]


@pytest.mark.parametrize("world_size,strided", [(2, False), (3, True)])
def test_gloo_values_are_rank0s_and_updates_repartition(gloo_world, world_size, strided):
    shapes = [[5, 7], [13], [2, 3]]
    results = gloo_world(_gloo_partition_and_update, world_size, shapes, torch.bfloat16, strided)
    gathered0, updated0, expected0 = results[0]
    for gathered, updated, _ in results:
        assert gathered == gathered0  # everyone sees rank 0's values
        assert updated == expected0  # and rank 0's update


def _gloo_staging_sizes(rank, world_size):
    """Ranks that picked different chunk sizes (each from its own free memory) must agree on one."""
    from ztriton.comm import world_of
    from ztriton.partitioning import _staging

    buffer = torch.empty(2 << 20, dtype=torch.bfloat16)  # 4 MiB: more than any rank's chunk (staging never is)
    chunk_bytes = (2 + rank) << 20  # 2 MiB, 3 MiB, ...
    elems, rows, recv = _staging(world_of(None), chunk_bytes, buffer)
    return elems, None if rows is None else tuple(rows.shape)


@pytest.mark.slow
def test_gloo_ranks_with_different_chunk_sizes_agree(gloo_world):
    results = gloo_world(_gloo_staging_sizes, 3)
    assert [r[0] for r in results] == [(2 << 20) // 2] * 3  # everyone uses the smallest: 2 MiB of bf16
    assert results[0][1] == (3, (2 << 20) // 2) and results[1][1] is None


def _gloo_train(rank, world_size, use_ztriton):
    """Two SGD steps of a ZeRO-3 engine on a partitioned linear model; the losses."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **gloo_safe_gathers()},
              "zero_allow_untested_optimizer": True}
    if use_ztriton:
        ztriton.partition(model)
    else:
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_gloo_deepspeed_initialize_trains_the_same(gloo_world):
    with_ztriton = gloo_world(_gloo_train, 2, True)
    with_deepspeed = gloo_world(_gloo_train, 2, False)
    assert with_ztriton == with_deepspeed
    assert with_ztriton[0][1] != with_ztriton[0][0]  # the step changed the model


def _arange_module(rank, numel=10, sparse=False):
    """One fp32 param whose values differ per rank (rank 0's: 0, 1, 2, ...)."""
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.arange(numel, dtype=torch.float32) + 1000 * rank)
    if sparse:
        module.s = torch.nn.Parameter(torch.ones(4).to_sparse())
    return module


def _outcome(rank, world_size, module, **kwargs):
    """Partition; the error (class, message) or whether each rank holds rank 0's slice; and that a
    failure left the param as it was."""
    before = module.w.detach().clone()
    try:
        ztriton.partition(module, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- the outcome is what the test compares
        untouched = not hasattr(module.w, "ds_id") and torch.equal(module.w.data, before)
        return type(exc).__name__, str(exc), untouched
    sl = zero3_slice(before.numel(), world_size)
    start, valid = sl.rank_start(rank), sl.valid_numel(rank)
    expected = torch.arange(before.numel(), dtype=torch.float32)[start:start + valid]
    return "ok", torch.equal(module.w.ds_tensor[:valid], expected), bool((module.w.ds_tensor[valid:] == 0).all())


def _gloo_failures_agreed(rank, world_size):
    """Each scenario on both ranks: every rank ends the same way, none waits forever."""
    from ztriton import memory
    import ztriton.partitioning as partitioning

    results = {}
    # A chunk size far beyond memory: clamped to the per-rank buffer, not allocated W times on rank 0.
    results["huge_chunk"] = _outcome(rank, world_size, _arange_module(rank), chunk_bytes=2**40)

    # Rank 0's staging allocation fails with the CPU allocator's kind of error (a plain RuntimeError).
    def fail_staging(what):
        if rank == 0 and what == "scatter staging":
            raise RuntimeError("DefaultCPUAllocator: not enough memory (injected)")
    memory.fault_hook = fail_staging
    try:
        results["staging_fails"] = _outcome(rank, world_size, _arange_module(rank))
    finally:
        memory.fault_hook = None

    # ... once only, with room to halve: 4 MiB of fp32 over 2 ranks is a 2 MiB per-rank buffer.
    calls = []

    def fail_once(what):
        if rank == 0 and what == "scatter staging" and not calls:
            calls.append(what)
            raise RuntimeError("DefaultCPUAllocator: not enough memory (injected)")
    memory.fault_hook = fail_once
    try:
        results["staging_fails_once"] = _outcome(rank, world_size, _arange_module(rank, numel=1 << 20))
    finally:
        memory.fault_hook = None

    # Rank 0 fails while filling a staging chunk.
    fill = partitioning._fill

    def broken_fill(*args):
        raise RuntimeError("kernel launch failed (injected)")
    if rank == 0:
        partitioning._fill = broken_fill
    try:
        results["fill_fails"] = _outcome(rank, world_size, _arange_module(rank))
    finally:
        partitioning._fill = fill

    # Only rank 1's module is refused by the checks.
    results["check_fails_on_rank1"] = _outcome(rank, world_size, _arange_module(rank, sparse=rank == 1))
    return results


def test_gloo_every_failure_is_agreed(gloo_world):
    """Issue 16: a failure on one rank (any exception class) makes every rank raise, none hangs (the
    world's timeout fails the test), params untouched; chunk_bytes=2**40 works."""
    rank0, rank1 = gloo_world(_gloo_failures_agreed, 2, timeout=240)
    assert rank0["huge_chunk"] == rank1["huge_chunk"] == ("ok", True, True)
    assert rank0["staging_fails_once"] == rank1["staging_fails_once"] == ("ok", True, True)
    for case in ("staging_fails", "fill_fails", "check_fails_on_rank1"):
        assert rank0[case][2] and rank1[case][2], (case, rank0[case], rank1[case])  # params untouched
    assert rank0["staging_fails"][0] == rank1["staging_fails"][0] == "RuntimeError"
    assert "cannot allocate even" in rank0["staging_fails"][1] and "injected" in rank0["staging_fails"][1]
    assert "on another rank" in rank1["staging_fails"][1]
    assert rank0["fill_fails"][:2] == ("RuntimeError", "kernel launch failed (injected)")
    assert rank1["fill_fails"][0] == "RuntimeError" and "rank 0 filling staging chunk 0 failed on another rank" \
        in rank1["fill_fails"][1]
    assert rank1["check_fails_on_rank1"][0] == "TypeError" and "parameter 's'" in rank1["check_fails_on_rank1"][1]
    assert rank0["check_fails_on_rank1"][0] == "RuntimeError" and "checking the parameters failed on another rank" \
        in rank0["check_fails_on_rank1"][1]


# -------------------------------------------------------------------------------------------- errors


def test_errors_leave_params_intact(fake_world):
    with fake_world(2, 0):
        meta = torch.nn.Linear(3, 2, device="meta")
        with pytest.raises(ValueError, match=r"'weight' is on the meta device.*to_empty"):
            ztriton.partition(meta)
        scalar = torch.nn.Module()
        scalar.s = torch.nn.Parameter(torch.tensor(1.5))
        with pytest.raises(ValueError, match=r"'s' is 0-dimensional.*shape \[1\]"):
            ztriton.partition(scalar)
        assert scalar.s.item() == 1.5 and not hasattr(scalar.s, "ds_id")
        with pytest.raises(ValueError, match=r"remote_device must be None .* or 'cpu', got 'nvme'"):
            ztriton.partition(torch.nn.Linear(2, 2), remote_device="nvme")
        with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
            ztriton.partition([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ztriton.partition(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("lazy", ["conj", "neg"])
def test_lazy_conjugate_or_negated_param_refused_naming_it(fake_world, lazy):
    """Its memory holds other values than it reads as: refused before anything is copied, few params or many."""
    for count in (1, 9):
        module = torch.nn.Module()
        for i in range(count):
            value = torch.randn(6, dtype=torch.complex64)
            view = value.conj() if lazy == "conj" else torch._neg_view(value)
            module.register_parameter(f"p{i}", torch.nn.Parameter(view, requires_grad=False))
        with fake_world(2, 1), pytest.raises(ValueError, match="'p0' is a lazy conjugate or negated view"):
            ztriton.partition(module)
        assert not hasattr(module.p0, "ds_id")


def test_sparse_param_refused_naming_it(fake_world):
    with fake_world(2, 0):
        module = _arange_module(0, sparse=True)
        with pytest.raises(TypeError, match=r"parameter 's' has layout torch.sparse_coo.*to_dense.*partitioned module"):
            ztriton.partition(module)
        assert not hasattr(module.w, "ds_id") and not hasattr(module.s, "ds_id")


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(headroom_bytes=-1), r"headroom_bytes must be an int >= 0 \(bytes\), got -1"),
    (dict(headroom_bytes=True), r"headroom_bytes must be an int >= 0 \(bytes\), got True"),
    (dict(headroom_bytes="1GB"), r"headroom_bytes must be an int >= 0 \(bytes\), got '1GB'"),
    (dict(chunk_bytes=2.0**21), r"chunk_bytes must be an int >= 0 \(bytes\), got 2097152.0"),
    (dict(chunk_bytes="big"), r"chunk_bytes must be an int >= 0 \(bytes\), got 'big'"),
])
def test_bad_options_refused_naming_them(fake_world, kwargs, pattern):
    with fake_world(2, 0):
        module = _arange_module(0)
        with pytest.raises(ValueError, match=pattern):
            ztriton.partition(module, **kwargs)
        assert not hasattr(module.w, "ds_id")


def test_complex128_strided_param(fake_world):
    """DeepSpeed accepts a complex128 param; a strided one partitions bit-exactly too (16-byte
    elements travel as pairs of 8-byte words)."""
    with fake_world(3, 1):
        module = torch.nn.Module()
        full = torch.randn(5, 7, dtype=torch.complex128)
        module.z = torch.nn.Parameter(full.t().contiguous().t())  # column-major storage
        ztriton.partition(module)
        sl = zero3_slice(full.numel(), 3)
        valid, start = sl.valid_numel(1), sl.rank_start(1)
        assert torch.equal(bits(module.z.ds_tensor[:valid]), bits(full.reshape(-1)[start:start + valid]))
        assert not bits(module.z.ds_tensor[valid:]).any()


def test_chunk_bytes_below_minimum_refused_before_anything_changes(fake_world):
    with fake_world(2, 1):
        module = BitsModule([[4]], seed=0, dtype=torch.float32)
        before = bits(module.p0.data).clone()
        with pytest.raises(ValueError, match=r"chunk_bytes=1024 is below the minimum"):
            ztriton.partition(module, chunk_bytes=1024)
        assert torch.equal(bits(module.p0.data), before) and not hasattr(module.p0, "ds_id")


def test_torch_copy_path_matches_zero_init(fake_world, monkeypatch):
    """Without the kernels (CPU tensors outside the interpreter, or sources on another device than
    the partitions) the copies go through torch, with only the padding zeroed: same bytes."""
    import ztriton.partitioning as partitioning

    monkeypatch.setattr(partitioning, "runs_on", lambda device: False)
    shapes = [[7, 3], [13], [2, 2]]
    reference = zero3_reference(lambda: BitsModule(shapes, 9, torch.bfloat16), 3, 2, torch.bfloat16,
                                wrap_existing=True)
    with fake_world(3, 2):
        module = StridedBits(shapes, 9, torch.bfloat16)
        buffer = ztriton.partition(module, chunk_bytes=1 << 20).buffers[torch.bfloat16]
    assert_matches_reference(module, reference, 3, 2)
    assert buffer.numel() == 7 + 5 + 2


class RawBytes(torch.nn.Module):
    """Params of ``dtype`` holding arbitrary bytes (a bool's 2..255 too), frozen (bool cannot require grad),
    on DeepSpeed's accelerator: where ztriton.partition puts the buffer, so the per-param path can apply."""

    def __init__(self, numels, dtype, seed):
        from deepspeed.accelerator import get_accelerator

        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        width = torch.empty(0, dtype=dtype).element_size()
        device = get_accelerator().current_device_name()
        for i, numel in enumerate(numels):
            raw = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=generator).to(device)
            self.register_parameter(f"p{i}", torch.nn.Parameter(raw.view(dtype), requires_grad=False))


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.float32, torch.complex64])
@pytest.mark.parametrize("extra", [0, 1])
def test_few_params_are_copied_one_by_one_more_through_one_plan(fake_world, monkeypatch, dtype, extra):
    """Up to policy.PER_PARAM_COPIES contiguous params beside the buffer take one copy each, more take
    one plan: the same bytes either way (every byte value of a bool), padding zeroed."""
    import ztriton.partitioning as partitioning
    from ztriton import policy

    calls = []
    for name in ("_copy_per_param", "pack_slices"):
        original = getattr(partitioning, name)
        monkeypatch.setattr(partitioning, name, lambda *a, _n=name, _f=original: calls.append(_n) or _f(*a))
    numels = [(7 * i) % 11 + 1 for i in range(policy.PER_PARAM_COPIES + extra)]
    with fake_world(3, 2):
        module = RawBytes(numels, dtype, seed=extra)
        full = {n: bits(p).clone() for n, p in module.named_parameters()}  # a bool's clone() would make bytes 0/1
        ztriton.partition(module)
    assert calls == ["pack_slices" if extra else "_copy_per_param"]
    _check_against_source(module, full, 3, 2)


def _check_against_source(module, full, world_size, rank):
    for name, p in module.named_parameters():
        sl = zero3_slice(full[name].numel(), world_size)
        valid, start = sl.valid_numel(rank), sl.rank_start(rank)
        want = full[name].reshape(-1)[start:start + valid].cpu()
        assert torch.equal(bits(p.ds_tensor[:valid].cpu()), bits(want)), name
        assert not bits(p.ds_tensor[valid:].cpu()).any(), name


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["gpu", "pageable", "pinned"])
@pytest.mark.parametrize("remote_device", [None, "cpu"])
def test_gpu_sources_and_partition_homes(fake_world, source, remote_device):
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().device_name() == "cuda"  # picked before the world sets DS_ACCELERATOR
    shapes = [[300, 70], [1001], [64, 3]]
    with fake_world(4, 3):
        module = StridedBits(shapes, 3, torch.bfloat16)
        for p in module.parameters():
            if source == "gpu":
                p.data = p.data.cuda().t().contiguous().t() if p.dim() == 2 else p.data.cuda()
            elif source == "pinned":
                p.data = p.data.pin_memory()
        full = {n: p.detach().clone() for n, p in module.named_parameters()}
        result = ztriton.partition(module, remote_device=remote_device)
        home = "cpu" if remote_device == "cpu" else "cuda"
        assert all(b.device.type == home for b in result.buffers.values())
        _check_against_source(module, full, 4, 3)
