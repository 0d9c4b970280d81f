"""Exact sharded init on CUDA: the window method against the full calls, bit for bit.

For each init, dtype and size (a grid smaller than the device, unaligned and period-aligned sizes, and
tensors over 2**31 bytes that ATen cuts into 32-bit pieces), every rank's replayed partition for W in
{1, 3, 8} must equal the same slice of the full tensor made by the same calls from the same seed; the
CUDA generator after recording must equal its state after the full calls, replay must leave it there,
and the next random call must give the same numbers. The self-check must pass here, cost a few ms,
leave the generator as it was, and on a (forced) failure fall back to full generation exactly.
Run on an H200 (or any CUDA device).
"""
from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from ztriton.sharded_init import Recorder, philox, replay, selfcheck
from ztriton.sharded_init.aten_ops import trunc_normal_is_pointwise
from ztriton.sharded_init.replay import CudaDraws

pytestmark = pytest.mark.gpu

INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
          torch.float64: torch.int64}
INITS = {
    "normal_": lambda t: torch.nn.init.normal_(t, 0.0, 0.02),
    "uniform_": lambda t: torch.nn.init.uniform_(t, -0.5, 0.25),
    "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
    "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
}
RANKS = {1: [0], 3: [0, 1, 2], 8: [0, 3, 7]}


def device():
    return torch.device("cuda", torch.cuda.current_device())


def period() -> int:
    props = torch.cuda.get_device_properties(device())
    return 4 * props.multi_processor_count * props.max_threads_per_multi_processor


def bits(t):
    return t.view(INT_OF[t.dtype])


def shape_of(numel: int) -> tuple[int, int]:
    return (numel, 1)  # 2-D, so kaiming_* has a fan; one column keeps any numel possible


def full_path(init, numel, dtype, seed):
    torch.cuda.manual_seed(seed)
    full = torch.zeros(shape_of(numel), dtype=dtype, device=device())
    with torch.no_grad():
        init(full)
    state = torch.cuda.get_rng_state()
    return full.view(-1), state, torch.rand(8, device=device())


def recorded_path(init, numel, dtype, seed):
    torch.cuda.manual_seed(seed)
    with Recorder() as recorder:
        param = torch.nn.Parameter(recorder.placeholder(shape_of(numel), dtype, device()))
        with torch.no_grad():
            init(param)
        record = recorder.record_of(param)
        fallbacks = list(recorder.fallbacks)
    return record, torch.cuda.get_rng_state(), fallbacks


def check(name, numel, dtype, seed=2024, worlds=(1, 3, 8)):
    init = INITS[name]
    full, state_full, after_full = full_path(init, numel, dtype, seed)
    record, state_recorded, fallbacks = recorded_path(init, numel, dtype, seed)
    assert torch.equal(state_recorded, state_full), f"{name} {dtype} {numel}: generator after recording"
    if name != "trunc_normal_" or trunc_normal_is_pointwise():
        assert not fallbacks, fallbacks
    for world in worlds:
        psize = -(-numel // world)
        for rank in RANKS[world]:
            out = torch.full((psize,), 3, dtype=dtype, device=device())
            replay(record, out, rank * psize, psize)
            valid = max(0, min(psize, numel - rank * psize))
            assert torch.equal(bits(out[:valid]), bits(full[rank * psize:rank * psize + valid])), \
                f"{name} {dtype} numel={numel} W={world} rank={rank}"
            assert not bits(out[valid:]).any()
            del out
    assert torch.equal(torch.cuda.get_rng_state(), state_full), "replay must leave the generator where it was"
    assert torch.equal(torch.rand(8, device=device()), after_full)
    del full


@pytest.mark.parametrize("name", list(INITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_windows_below_2_31_bytes(name, dtype):
    p = period()
    for numel in (1000, p // 8 + 3, 3 * p, 5 * p + 12345, 24 * p + 8 * 3 * 7 + 1):
        check(name, numel, dtype)


@pytest.mark.parametrize("name", ["normal_", "uniform_"])
def test_float64_draws_two_values_per_round(name):
    p = period()
    for numel in (777, 5 * p // 2 + 19):
        check(name, numel, torch.float64)


@pytest.mark.parametrize("name", list(INITS))
def test_bf16_over_2_31_bytes(name):
    """1.2e9 bf16 elements (2.4 GB): ATen cuts the call into two 32-bit pieces."""
    check(name, 1_200_000_000, torch.bfloat16)


@pytest.mark.parametrize("name", ["normal_", "trunc_normal_"])
def test_fp32_over_2_31_bytes_with_an_odd_numel(name):
    check(name, 600_000_001, torch.float32, worlds=(3, 8))


def test_replay_scratch_stays_within_two_periods():
    """Straight into the partition: the only extra device memory is the windows' edges."""
    numel, world, rank = 1_200_000_000, 8, 3
    torch.cuda.manual_seed(1)
    with Recorder() as recorder:
        t = recorder.placeholder((numel,), torch.bfloat16, device())
        t.normal_(0.0, 0.02)
        record = recorder.record_of(t)
    psize = numel // world
    out = torch.empty(psize, dtype=torch.bfloat16, device=device())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    replay(record, out, rank * psize + 1, psize)  # unaligned on purpose: both edges need scratch
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 2 * period() * 2 + (1 << 20), f"replay used {extra} bytes beyond the partition"


def test_cast_and_host_destination_use_chunks():
    """fp32 draws cast to bf16 (zero.Init's create-then-convert), replayed into host memory."""
    p = period()
    numel = 3 * p + 101
    torch.cuda.manual_seed(7)
    ref = torch.empty(numel, device=device()).normal_().to(torch.bfloat16).mul_(0.5)
    torch.cuda.manual_seed(7)
    with Recorder() as recorder:
        t = recorder.placeholder((numel,), torch.float32, device())
        t.normal_()
        t = t.to(torch.bfloat16)
        t.mul_(0.5)
        record = recorder.record_of(t)
    for world in (1, 3):
        psize = -(-numel // world)
        for rank in range(world):
            for where in ("cpu", device()):
                out = torch.empty(psize, dtype=torch.bfloat16, device=where)
                replay(record, out, rank * psize, psize, chunk_bytes=p // 3)
                valid = min(psize, numel - rank * psize)
                assert torch.equal(bits(out[:valid].to(device())), bits(ref[rank * psize:rank * psize + valid]))


def test_interleaved_device_random_calls_match():
    torch.cuda.manual_seed(3)
    a = torch.empty(2 * period() + 5, dtype=torch.bfloat16, device=device()).uniform_()
    r1 = torch.randn(1000, device=device())
    torch.cuda.manual_seed(3)
    with Recorder() as recorder:
        t = recorder.placeholder((2 * period() + 5,), torch.bfloat16, device())
        t.uniform_()
        s1 = torch.randn(1000, device=device())
        record = recorder.record_of(t)
    assert torch.equal(s1, r1)
    out = torch.empty(a.numel(), dtype=torch.bfloat16, device=device())
    replay(record, out, 0, a.numel())
    assert torch.equal(bits(out), bits(a))


# ---- the self-check on this torch and device

KINDS = [(func, dtype) for func in (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default)
         for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]


def check_lines(caplog):
    return [r.getMessage() for r in caplog.records if "window replay of" in r.getMessage()]


def test_self_check_passes_here_and_keeps_the_generator(monkeypatch, caplog):
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    torch.cuda.manual_seed(5)
    torch.rand(3, device=device())
    state = torch.cuda.get_rng_state()
    expected_next = torch.rand(8, device=device())
    torch.cuda.set_rng_state(state)
    with caplog.at_level(logging.WARNING, logger="ztriton"):
        verdicts = [selfcheck.replay_verified(func, dtype, device()) for func, dtype in KINDS]
    assert all(verdicts), check_lines(caplog)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert torch.equal(torch.rand(8, device=device()), expected_next)


def test_self_check_costs_a_few_ms(monkeypatch):
    seconds = {}
    for func, dtype in KINDS:
        for _ in range(2):  # the second run: the kernels loaded, the allocator's blocks cached
            monkeypatch.setattr(selfcheck, "_verdicts", {})
            torch.cuda.synchronize()
            begin = time.perf_counter()
            assert selfcheck.replay_verified(func, dtype, device())
            torch.cuda.synchronize()
            seconds[(str(func), dtype)] = time.perf_counter() - begin
    assert max(seconds.values()) < 0.02, seconds


def test_self_check_finds_a_wrong_geometry_here(monkeypatch, caplog):
    """The check is sensitive on this device: told of one more multiprocessor than the device has, the
    windows it replays are not the call's elements."""

    class OneMoreSM(CudaDraws):
        def geometry(self, device):
            real = super().geometry(device)
            return philox.Geometry(real.sms + 1, real.max_threads_per_sm)

    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selfcheck, "draws_for", lambda device: OneMoreSM())
    state = torch.cuda.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="ztriton"):
        assert not selfcheck.replay_verified(torch.ops.aten.normal_.default, torch.float32, device())
    assert torch.equal(torch.cuda.get_rng_state(), state)
    [line] = check_lines(caplog)
    assert f"torch {torch.__version__} on {device()} ({torch.cuda.get_device_name(device())})" in line
    assert "normal_ on torch.float32" in line and "differ" in line


def test_a_failed_check_falls_back_to_full_generation_here(monkeypatch, caplog):
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(selfcheck, "_same_bytes", lambda a, b: False)
    numel = 3 * period() + 101
    full, state_full, after_full = full_path(INITS["normal_"], numel, torch.bfloat16, 11)
    with caplog.at_level(logging.WARNING, logger="ztriton"):
        record, state_recorded, fallbacks = recorded_path(INITS["normal_"], numel, torch.bfloat16, 11)
    assert record.materialised and len(fallbacks) == 1
    assert torch.equal(bits(record.real.view(-1)), bits(full))
    assert torch.equal(state_recorded, state_full)
    assert torch.equal(torch.rand(8, device=device()), after_full)
    [line] = check_lines(caplog)
    assert "normal_ on torch.bfloat16" in line and torch.__version__ in line
