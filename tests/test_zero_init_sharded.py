"""Exact sharded init under ``deepspeed.zero.Init`` with ``"partition_backend": "triton"`` (issue 14), and
the zero.Init items of issue 16 (buffers derived from large constructors, per-slice casts).

The oracle is DeepSpeed itself: the same module, seed and world with the key off. Key on, tensors at or
above ``sharded_init_bytes`` are placeholders replayed slice by slice; every partition's valid prefix must
equal key off's bit for bit, the generator must end where key off leaves it, and a random call after the
Init must give the same numbers. On torch's fake process group DeepSpeed's broadcast moves nothing, so
every simulated rank keeps its slice of the tensor it generated locally from the same seed: key off is
defined for every rank there, as on a real gloo world (where rank 0's values travel).
"""
from __future__ import annotations

import logging
import math
import re

import pytest
import torch

import deepspeed
from ds_reference import bits
from ztriton.layout import zero3_slice

SHARDED = "initialised shard by shard"
FALLBACK = "cannot be recorded"


def config(backend: str, dtype: torch.dtype = torch.bfloat16, threshold: int = 1024) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    if dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        cfg["fp16"] = {"enabled": True}
    if backend == "triton":
        cfg.update(partition_backend="triton", ztriton={"sharded_init_bytes": threshold})
    return cfg


class FusedExperts(torch.nn.Module):
    """Fused expert params (nn.Parameter(torch.empty(E, out, in))) with the inits MoE models use, beside
    nn.Linear / nn.Embedding / LayerNorm and params made by torch.full / torch.randn / torch.zeros."""

    def __init__(self, experts: int = 4, width: int = 8):
        super().__init__()
        e, w = experts, width
        self.router = torch.nn.Linear(w, e, bias=False)
        self.embed = torch.nn.Embedding(64, w)  # 512 elements: a placeholder (reset_parameters: normal_)
        self.proj = torch.nn.Linear(w, 4 * w)  # kaiming_uniform_ on a placeholder, bias small
        self.gate_up = torch.nn.Parameter(torch.empty(e, 2 * w, w))
        torch.nn.init.normal_(self.gate_up, std=0.02)
        self.down = torch.nn.Parameter(torch.empty(e, w, 2 * w))
        torch.nn.init.trunc_normal_(self.down, std=0.02)
        self.up = torch.nn.Parameter(torch.empty(e, 2 * w, w))
        torch.nn.init.kaiming_uniform_(self.up, a=math.sqrt(5))
        self.xavier_u = torch.nn.Parameter(torch.empty(e, w, 2 * w))
        torch.nn.init.xavier_uniform_(self.xavier_u)
        self.xavier_n = torch.nn.Parameter(torch.empty(e, w, 2 * w))
        torch.nn.init.xavier_normal_(self.xavier_n, gain=0.5)
        self.kaiming_n = torch.nn.Parameter(torch.empty(e, w, 2 * w))
        torch.nn.init.kaiming_normal_(self.kaiming_n, mode="fan_out")
        self.const = torch.nn.Parameter(torch.empty(e, w, 2 * w))
        torch.nn.init.constant_(self.const, 0.3)
        self.uni = torch.nn.Parameter(torch.empty(e, w, 2 * w))
        self.uni.data.uniform_(-0.1, 0.1)  # through .data
        self.full = torch.nn.Parameter(torch.full((e, w, 2 * w), 0.1))  # made in fp32, then converted
        self.randn = torch.nn.Parameter(torch.randn(e, w, 2 * w) * 0 + torch.randn(e, w, 2 * w))  # arithmetic
        self.plain_randn = torch.nn.Parameter(torch.randn(e, w, 2 * w))
        self.zeros = torch.nn.Parameter(torch.zeros(e, w, 2 * w), requires_grad=False)
        self.ones = torch.nn.Parameter(torch.ones(e, w, 2 * w))
        self.norm = torch.nn.LayerNorm(w)


PLACEHOLDER_PARAMS = {"embed.weight", "proj.weight", "gate_up", "down", "up", "xavier_u", "xavier_n", "kaiming_n",
                      "const", "uni", "full", "plain_randn", "zeros", "ones"}


def build(backend: str, world: int, rank: int, dtype: torch.dtype, fake_world, module=FusedExperts, seed: int = 0,
          threshold: int = 1024):
    """Partitions (valid prefix bits), requires_grad, generator state after the Init and the next draws."""
    with fake_world(world, rank):
        torch.manual_seed(seed)
        with deepspeed.zero.Init(config_dict_or_path=config(backend, dtype, threshold)):
            model = module()
        state = torch.get_rng_state()
        after = torch.rand(5)
        out = {}
        for name, p in model.named_parameters():
            valid = zero3_slice(p.ds_numel, world).valid_numel(rank)
            out[name] = (bits(p.ds_tensor)[:valid].clone(), p.ds_tensor.dtype, p.requires_grad, tuple(p.ds_shape))
    return out, state, after, model


def assert_same(off, on):
    assert off[0].keys() == on[0].keys()
    for name in off[0]:
        a, b = off[0][name], on[0][name]
        assert a[1:] == b[1:], name
        assert torch.equal(a[0], b[0]), name
    assert torch.equal(off[1], on[1]), "the generator must end where DeepSpeed's zero.Init leaves it"
    assert torch.equal(off[2], on[2]), "a random call after the Init must give DeepSpeed's numbers"


def sharded_names(caplog) -> set[str]:
    names = set()
    for r in caplog.records:
        message = r.getMessage()
        if SHARDED in message:
            names.update(re.findall(r"(?:shard \(|, )\w+\.(\w+) \(", message))
    return names


@pytest.mark.parametrize("world, ranks", [(1, [0]), (3, [0, 2]), (8, [0, 5, 7])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_key_on_is_bit_identical_to_key_off_on_fake_worlds(world, ranks, dtype, fake_world, caplog):
    for rank in ranks:
        off = build("torch", world, rank, dtype, fake_world)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="ztriton"):
            on = build("triton", world, rank, dtype, fake_world)
        assert_same(off, on)
        fallbacks = [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]
        # only the randn used in arithmetic falls back (materialised on the device, values exact)
        assert len(fallbacks) == 2 and all("aten.mul" in f or "aten.add" in f for f in fallbacks), fallbacks
        assert {"weight", "gate_up", "down", "up", "xavier_u", "full", "plain_randn", "zeros", "ones"} <= \
            sharded_names(caplog), sharded_names(caplog)
        model = on[3]
        assert model.gate_up.ds_tensor.numel() == zero3_slice(4 * 16 * 8, world).partition_numel
        assert not model.zeros.requires_grad and model.ones.requires_grad


def test_partition_padding_is_zero_and_params_are_partitioned(fake_world):
    _, _, _, model = build("triton", 3, 2, torch.bfloat16, fake_world)
    for name, p in model.named_parameters():
        valid = zero3_slice(p.ds_numel, 3).valid_numel(2)
        assert not bits(p.ds_tensor)[valid:].any(), name
        assert p.numel() == 0 and p.ds_status.name == "NOT_AVAILABLE", name


def test_gathered_params_equal_key_off(fake_world):
    """The full tensors a gather gives back (W=1: the partition is the whole tensor)."""
    models = {}
    with fake_world(1, 0):
        for backend in ("torch", "triton"):
            torch.manual_seed(0)
            with deepspeed.zero.Init(config_dict_or_path=config(backend)):
                models[backend] = FusedExperts()
        for (name, a), b in zip(models["torch"].named_parameters(), models["triton"].parameters()):
            with deepspeed.zero.GatheredParameters([a, b]):
                assert a.shape == b.shape and torch.equal(bits(a.data), bits(b.data)), name


# ---- real collectives: rank 0's values everywhere


def _both_backends(rank, world_size):
    out = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(10 + rank)  # ranks start from different states: DeepSpeed keeps rank 0's values
        with deepspeed.zero.Init(config_dict_or_path=config(backend)):
            model = FusedExperts()
        state, after = torch.get_rng_state(), torch.rand(5)
        parts = {}
        for name, p in model.named_parameters():
            valid = zero3_slice(p.ds_numel, world_size).valid_numel(rank)
            parts[name] = bits(p.ds_tensor)[:valid].clone()
        out[backend] = (parts, state, after)
    return out


def test_key_on_matches_key_off_on_gloo(gloo_world):
    results = gloo_world(_both_backends, 2)
    for rank, result in enumerate(results):
        off, on = result["torch"], result["triton"]
        for name in off[0]:
            assert torch.equal(off[0][name], on[0][name]), (rank, name)
        assert torch.equal(off[1], on[1]) and torch.equal(off[2], on[2]), rank
    assert not torch.equal(results[0]["torch"][2], results[1]["torch"][2]), "the ranks' generators did differ"


# ---- fallbacks


def _same_both_ways(module, world: int, rank: int, fake_world, caplog) -> list[str]:
    """Build ``module`` (fp32) key off, then key on capturing ztriton's log; assert the two agree; the messages."""
    off = build("torch", world, rank, torch.float32, fake_world, module)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ztriton"):
        on = build("triton", world, rank, torch.float32, fake_world, module)
    assert_same(off, on)
    return [r.getMessage() for r in caplog.records]


class Unrecordable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ortho = torch.nn.Parameter(torch.empty(16, 32))
        torch.nn.init.orthogonal_(self.ortho)
        self.sliced = torch.nn.Parameter(torch.empty(16, 32))
        torch.nn.init.normal_(self.sliced)
        with torch.no_grad():
            self.sliced[3] = 2.0
            self.sliced.mul_(0.5)
        self.copied = torch.nn.Parameter(torch.empty(16, 32))
        with torch.no_grad():
            self.copied.copy_(torch.arange(512.0).view(16, 32))
        self.after = torch.nn.Parameter(torch.empty(16, 32))
        torch.nn.init.uniform_(self.after)


@pytest.mark.parametrize("world, rank", [(1, 0), (3, 1)])
def test_fallbacks_log_once_each_and_match_key_off(world, rank, fake_world, caplog):
    messages = _same_both_ways(Unrecordable, world, rank, fake_world, caplog)
    lines = [m for m in messages if FALLBACK in m]
    assert len(lines) == 3, lines
    assert any("orthogonal_" in line for line in lines) and any("__setitem__" in line for line in lines)
    assert any("aten.copy_" in line for line in lines)
    assert sharded_names(caplog) == {"after"}


class UnderAUserMode(torch.nn.Module):
    """A large param made while the module's own torch function mode is active (entered after the
    Init's recorder), then one made after it: the first cannot be watched, the second can."""

    def __init__(self):
        super().__init__()
        from torch.overrides import TorchFunctionMode

        class Passing(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Passing():
            self.inside = torch.nn.Parameter(torch.empty(16, 32))
            torch.nn.init.normal_(self.inside)
        self.after = torch.nn.Parameter(torch.empty(16, 32))
        torch.nn.init.normal_(self.after)


@pytest.mark.parametrize("world, rank", [(1, 0), (3, 2)])
def test_a_tensor_made_under_a_user_mode_is_made_in_full_and_matches_key_off(world, rank, fake_world, caplog):
    messages = _same_both_ways(UnderAUserMode, world, rank, fake_world, caplog)
    lines = [m for m in messages if "is created in full" in m]
    assert len(lines) == 1 and "another torch mode is active" in lines[0], lines
    assert sharded_names(caplog) == {"after"}
    assert torch._C._len_torch_function_stack() == 0


def test_no_init_weights_generates_nothing(fake_world, caplog):
    initialization = pytest.importorskip("transformers.initialization")
    with fake_world(3, 0), caplog.at_level(logging.DEBUG, logger="ztriton"):
        torch.manual_seed(1)
        before = torch.get_rng_state()
        with initialization.no_init_weights(), \
                deepspeed.zero.Init(config_dict_or_path=config("triton", torch.float32)):
            model = torch.nn.Linear(32, 64)
        assert torch.equal(torch.get_rng_state(), before)
        assert not bits(model.weight.ds_tensor).any()
    assert sharded_names(caplog) == {"weight"}


def test_a_placeholder_left_outside_modules_is_named(fake_world, caplog):
    with fake_world(2, 0), caplog.at_level(logging.WARNING, logger="ztriton"):
        with deepspeed.zero.Init(config_dict_or_path=config("triton", torch.float32)):
            stray = torch.empty(64, 64)
        assert stray.is_meta
    assert any("never made a module's parameter or buffer" in r.getMessage() for r in caplog.records)


def test_small_and_explicit_device_tensors_are_not_placeholders(fake_world):
    with fake_world(2, 0):
        with deepspeed.zero.Init(config_dict_or_path=config("triton", torch.float32, threshold=1 << 20)) as _:
            small = torch.empty(64, 64)
            here = torch.zeros(1 << 19, device="cpu")
            ints = torch.full((1 << 19,), 3)
        assert not small.is_meta and not here.is_meta and not ints.is_meta and ints.dtype == torch.int64


# ---- issue 16: a buffer derived from a large constructor; an fp16 param in an fp32 Init


class CausalMask(torch.nn.Module):
    """transformers' causal-mask idiom (GPT-2's ``bias`` buffer), bool and float."""

    def __init__(self, n: int = 48):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n, n), dtype=torch.bool)).view(1, 1, n, n))
        self.register_buffer("float_mask", torch.tril(torch.ones((n, n))).view(1, 1, n, n), persistent=False)
        self.weight = torch.nn.Parameter(torch.empty(n, n))
        torch.nn.init.normal_(self.weight)


def test_causal_mask_buffers_are_made_as_deepspeed_makes_them(fake_world, monkeypatch):
    """The tensors a buffer is derived from are created where DeepSpeed creates them (its constructor called
    with the same arguments, or a placeholder materialised on the local device), and end there."""
    from deepspeed.runtime.zero import partition_parameters as pp

    calls = []
    original_ones = pp._orig_torch_ones

    def spy(*args, **kwargs):
        calls.append((args, tuple(sorted((k, str(v)) for k, v in kwargs.items()))))
        return original_ones(*args, **kwargs)

    monkeypatch.setattr(pp, "_orig_torch_ones", spy)
    buffers, seen = {}, {}
    for backend in ("torch", "triton"):
        calls.clear()
        with fake_world(2, 1):
            init = deepspeed.zero.Init(config_dict_or_path=config(backend, torch.float32, threshold=1024))
            with init:
                model = CausalMask()
            local = torch.device(init.local_device)
        buffers[backend] = {n: b for n, b in model.named_buffers()}
        seen[backend] = list(calls)
        for name, b in model.named_buffers():
            assert not b.is_meta and b.device == local, (backend, name)
    assert seen["triton"] == [c for c in seen["torch"] if "torch.bool" in str(c)]  # the float one: a placeholder
    for name, b in buffers["torch"].items():
        assert b.dtype == buffers["triton"][name].dtype and torch.equal(b, buffers["triton"][name]), name


class HalfInFloat(torch.nn.Module):
    """An fp16 param made by an op zero.Init does not patch, holding NaNs with payloads."""

    def __init__(self, numel: int = 301):
        super().__init__()
        raw = torch.randint(-(1 << 15), 1 << 15, (numel,), dtype=torch.int16, generator=torch.Generator().manual_seed(3))
        raw[::2] = raw[::2] | 0x7C00  # exponent all ones: NaNs (payload != 0) and infinities
        self.weight = torch.nn.Parameter(raw.view(torch.float16).clone())


@pytest.mark.parametrize("world", [3, 8])
def test_an_fp16_param_in_an_fp32_init_is_cast_per_slice_like_deepspeed(world, fake_world):
    for rank in range(world):
        off = build("torch", world, rank, torch.float32, fake_world, HalfInFloat)
        on = build("triton", world, rank, torch.float32, fake_world, HalfInFloat)
        assert off[0]["weight"][1] == torch.float32
        assert_same(off, on)


# ---- CUDA (run on the H200): a fused bf16 expert tensor over 2**31 bytes at W = 8


class BigExperts(torch.nn.Module):
    """8 x 2048 x 65600 bf16 = 2.00 GiB + 2 MiB: over 2**31 bytes, so ATen cuts its normal_ into 32-bit pieces."""

    SHAPE = (8, 2048, 65600)

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.Parameter(torch.empty(*self.SHAPE))
        torch.nn.init.normal_(self.experts, std=0.02)


def _cuda_build(backend: str, world: int, rank: int, fake_world) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """The valid prefix of the partition, the CUDA generator state after, the device peak over the start, seconds."""
    import time

    with fake_world(world, rank):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        start = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=config(backend, torch.bfloat16, threshold=64 << 20)):
            model = BigExperts()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - base
        p = model.experts
        assert p.ds_tensor.device.type == "cuda" and p.ds_tensor.dtype == torch.bfloat16
        valid = zero3_slice(p.ds_numel, world).valid_numel(rank)
        part = bits(p.ds_tensor)[:valid].clone()
        state = torch.cuda.get_rng_state()
        del model, p
    return part, state, peak, seconds


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [0, 7])
def test_cuda_fused_expert_over_2_31_bytes_key_on_equals_key_off(rank, fake_world):
    """Key off on a fake world is defined on every rank: DeepSpeed's broadcast moves nothing there, so rank r
    keeps slice r of the full tensor it generated from the same seed. Key on must give those bits, leave the
    CUDA generator where key off does, and hold only the shard (+16 MiB) on the device."""
    world = 8
    shard_bytes = math.prod(BigExperts.SHAPE) // world * 2
    off_part, off_state, off_peak, off_s = _cuda_build("torch", world, rank, fake_world)
    on_part, on_state, on_peak, on_s = _cuda_build("triton", world, rank, fake_world)
    print(f"rank {rank}: key off {off_s:.3f} s peak {off_peak / 2**30:.2f} GiB; "
          f"key on {on_s:.3f} s peak {on_peak / 2**30:.3f} GiB (shard {shard_bytes / 2**30:.3f} GiB)")
    assert torch.equal(off_part, on_part)
    assert torch.equal(off_state, on_state)
    assert off_peak >= math.prod(BigExperts.SHAPE) * 2, "DeepSpeed's path holds the whole tensor"
    assert on_peak <= shard_bytes + (16 << 20), f"key on peak {on_peak} for a shard of {shard_bytes}"
    torch.cuda.set_rng_state(on_state)
    after_on = torch.randn(8, device="cuda")
    torch.cuda.set_rng_state(off_state)
    assert torch.equal(torch.randn(8, device="cuda"), after_on)


@pytest.mark.gpu
def test_cuda_causal_mask_buffers_end_on_the_device(fake_world):
    with fake_world(2, 1):
        init = deepspeed.zero.Init(config_dict_or_path=config("triton", torch.bfloat16, threshold=1024))
        with init:
            model = CausalMask()
        for name, b in model.named_buffers():
            assert b.device == torch.device(init.local_device) and b.device.type == "cuda", name


_NO_DYNAMO_SCRIPT = """
import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1"); os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, deepspeed
imported_by_deepspeed = "torch._dynamo" in sys.modules
from ztriton.testing import simulated_world
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(64, 64)); torch.nn.init.trunc_normal_(self.a, std=0.02)
        self.b = torch.nn.Parameter(torch.empty(64, 64)); torch.nn.init.normal_(self.b, std=0.02)
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
       "partition_backend": "triton", "ztriton": {"sharded_init_bytes": 1024}}
with simulated_world(2, 1):
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        m = M()
print("RESULT", imported_by_deepspeed, "torch._dynamo" in sys.modules, m.a.ds_tensor.numel(), m.b.ds_tensor.numel())
"""


def test_a_fresh_process_records_without_importing_dynamo():
    """Placeholders under zero.Init in a fresh process: no crash (torch._dynamo cannot be imported once
    DeepSpeed has patched Tensor.__new__) and no torch._dynamo import by ztriton (1.3-1.8 s of fixed cost): none
    at all where ``import deepspeed`` did not import it already (some DeepSpeed releases do)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NO_DYNAMO_SCRIPT], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    _, by_deepspeed, after_init, *numels = lines[-1].split()
    assert numels == ["2048", "2048"] and after_init == by_deepspeed, lines[-1]


@pytest.mark.parametrize("rank", [0, 1])
def test_one_summary_line_per_init_on_rank_0(rank, fake_world, caplog):
    """The key's zero.Init ends with one summary line (what moved and how), on rank 0 only."""
    with fake_world(2, rank), caplog.at_level(logging.INFO, logger="ztriton"):
        with deepspeed.zero.Init(config_dict_or_path=config("triton")):
            torch.nn.Linear(64, 64)
    # ztriton's logger's records (pytest 9.2 on also captures DeepSpeed's non-propagating logger, which says it too)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "ztriton" and r.getMessage().startswith("ztriton: zero.Init: ")]
    if rank:
        assert lines == []
    else:
        assert len(lines) == 1 and "tier=sharded init + partition" in lines[0], lines
        assert "params=2, sharded=1" in lines[0]  # the 64 x 64 weight (8 KiB >= 1 KiB) is drawn shard by shard
