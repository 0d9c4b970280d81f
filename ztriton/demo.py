"""The demo behind ``python -m ztriton demo``: a built-in MoE-shaped model, both paths, side by side."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from einops import rearrange

from ztriton.layout import zero12_group_layout, zero3_slice

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class MoEShape:
    """Sizes of the built-in model: ``layers`` blocks of attention plus ``experts`` fused experts."""

    hidden: int
    ffn: int
    experts: int
    layers: int
    vocab: int


GPU_SHAPE = MoEShape(hidden=2048, ffn=1024, experts=64, layers=2, vocab=32000)
CPU_SHAPE = MoEShape(hidden=64, ffn=32, experts=4, layers=2, vocab=256)


def build_params(shape: MoEShape, device: str) -> dict[str, torch.Tensor]:
    """The model's params in bf16. The fused expert down-projection is stored transposed, as a
    checkpoint loader may hand it over, so one source of each layer is strided."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    h, f, e = shape.hidden, shape.ffn, shape.experts

    def rand(*dims):
        return torch.randn(*dims, generator=gen).to(DTYPE).to(device)

    params = {"embed": rand(shape.vocab, h)}
    for i in range(shape.layers):
        params |= {
            f"l{i}.norm": rand(h), f"l{i}.qkv": rand(3 * h, h), f"l{i}.o": rand(h, h), f"l{i}.router": rand(e, h),
            f"l{i}.experts_up": rand(e, 2 * f, h),
            f"l{i}.experts_down": rearrange(rand(e, f, h), "e f h -> e h f"),  # a strided view
        }
    return params


def _measure(device: str, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float, float | None]:
    """Run ``fn`` once untimed (Triton compiles on first use), then once more: its result, seconds,
    and the peak of newly allocated device memory (MiB)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    return out, seconds, peak


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == b.numel() and torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))


def deepspeed_flatten(tensors, paddings, alignment):
    """DeepSpeed 0.19.8's on-device ZeRO-1/2 flatten: fresh pad tensors, align, ``torch.cat``."""
    from torch._utils import _flatten_dense_tensors

    from deepspeed.runtime.utils import align_dense_tensors

    padded = []
    for t, pad in zip(tensors, paddings):
        padded.append(t)
        if pad:
            padded.append(torch.zeros(pad, dtype=t.dtype, device=t.device))
    return _flatten_dense_tensors(align_dense_tensors(padded, alignment))


class ParamModule(torch.nn.Module):
    """The built-in model's tensors as parameters of one module (names with '.' become '_')."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t))


ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}


def deepspeed_partition(tensors: dict[str, torch.Tensor]) -> ParamModule:
    """DeepSpeed's path: ``zero.Init(module=...)``. Its broadcast views every param as bytes, which
    a strided param refuses, so strided params must first be made contiguous: a full copy each."""
    import deepspeed

    module = ParamModule({n: t.contiguous() for n, t in tensors.items()})
    deepspeed.zero.Init(module=module, config_dict_or_path=ZERO3_CONFIG)
    return module


def ztriton_partition(tensors: dict[str, torch.Tensor]) -> ParamModule:
    """ztriton's path: the tensors as they are, strided ones read in place."""
    import ztriton

    module = ParamModule(tensors)
    ztriton.partition(module)
    return module


def _same_partitions(a: ParamModule, b: ParamModule, world_size: int, rank: int) -> bool:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        valid = zero3_slice(p.ds_numel, world_size).valid_numel(rank)
        if not _same_bits(p.ds_tensor[:valid], q.ds_tensor[:valid]):
            return False
    return True


def zero3_rows(tensors: dict[str, torch.Tensor], device: str, world_size: int):
    """Partition the model as every rank of a simulated world (torch's fake process group), both ways."""
    from ztriton.deepspeed import simulated_world

    ds_total = zt_total = 0.0
    ds_peak = zt_peak = 0.0
    same = True
    for rank in range(world_size):
        with simulated_world(world_size, rank):
            ds_module, s, peak = _measure(device, lambda: deepspeed_partition(tensors))
            ds_total, ds_peak = ds_total + s, max(ds_peak, peak or 0.0)
            zt_module, s, peak = _measure(device, lambda: ztriton_partition(tensors))
            zt_total, zt_peak = zt_total + s, max(zt_peak, peak or 0.0)
            same &= _same_partitions(ds_module, zt_module, world_size, rank)
        print(f"[demo]   rank {rank}: {'identical' if same else 'DIFFERENT'}", flush=True)
    on_cuda = device == "cuda"
    return ("ZeRO-3 partition (every rank)", ds_total, ds_peak if on_cuda else None, zt_total,
            zt_peak if on_cuda else None, same)


def run(device: str, world_size: int) -> int:
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    print(f"[demo] device={device} world_size={world_size} model={shape}", flush=True)
    tensors = build_params(shape, device)
    params = list(tensors.values())
    total = sum(p.numel() for p in params)
    print(f"[demo] {len(params)} params, {total * 2 / 2**20:.1f} MiB bf16 "
          f"({sum(not p.is_contiguous() for p in params)} strided)", flush=True)
    rows = []

    print("[demo] ZeRO-1/2 flatten: DeepSpeed torch.cat path ...", flush=True)
    layout = zero12_group_layout([p.numel() for p in params], world_size, element_size=2)
    ordered = [params[i] for i in layout.order]
    ds_flat, ds_s, ds_peak = _measure(device, lambda: deepspeed_flatten(ordered, layout.paddings, 2 * world_size))
    print("[demo] ZeRO-1/2 flatten: ztriton.flatten_groups ...", flush=True)
    # flatten_groups re-points the params it flattens, so each call (warm-up, timed) gets fresh ones,
    # made before the measurement.
    fresh = [[torch.nn.Parameter(t.clone()) for t in params] for _ in range(2)]

    def zt_flatten():
        import ztriton
        from ztriton.deepspeed import simulated_world

        with simulated_world(world_size, 0):
            return ztriton.flatten_groups([fresh.pop()])[0].flat

    zt_flat, zt_s, zt_peak = _measure(device, zt_flatten)
    same = _same_bits(ds_flat, zt_flat)
    rows.append(("ZeRO-1/2 flatten", ds_s, ds_peak, zt_s, zt_peak, same))
    del ds_flat, zt_flat

    print(f"[demo] ZeRO-3: DeepSpeed zero.Init vs ztriton.partition as each of {world_size} ranks ...", flush=True)
    rows.append(zero3_rows(tensors, device, world_size))

    _print_table(rows, device)
    return 0 if all(r[-1] for r in rows) else 1


def _print_table(rows, device: str) -> None:
    def mib(v):
        return f"{v:9.1f}" if v is not None else "      n/a"

    print()
    print(f"{'step':32s} {'DeepSpeed s':>11s} {'peak MiB':>9s} {'ztriton s':>10s} {'peak MiB':>9s} {'bits':>10s}")
    for name, ds_s, ds_peak, zt_s, zt_peak, same in rows:
        print(f"{name:32s} {ds_s:11.4f} {mib(ds_peak)} {zt_s:10.4f} {mib(zt_peak)} "
              f"{'identical' if same else 'DIFFERENT':>10s}")
    if device == "cpu":
        print("\n(CPU: kernels run under the Triton interpreter, so ztriton's times here say nothing about "
              "its speed; peak device memory is measured on CUDA only. The first call also compiles.)")
