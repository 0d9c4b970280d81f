"""The benchmarks' models and parameter values: tensor mixes, the fused-expert and LLM-mix models,
and a fixed bit pattern written in place (so both backends and both devices produce the same bits
without a full-size temporary, and a slice placed wrongly shows).
"""
from __future__ import annotations

import math
import time

import torch

from bench.harness import sync


def llm_mix() -> list[list[int]]:
    """Shapes of a 7B-class LLM's params (8.6 GiB of bf16): 200 [4096, 4096] + 400 [4096] + 2 [151936, 4096]."""
    return [[4096, 4096]] * 200 + [[4096]] * 400 + [[151936, 4096]] * 2


def llama_7b() -> list[list[int]]:
    """Shapes of a Llama-2-7B's params (12.6 GiB of bf16, 291 params): no param of 256 MiB or more (its embeddings
    are 250 MiB), so none leads a fresh pack (``kernels/turns.py``)."""
    layer = [[4096, 4096]] * 4 + [[11008, 4096]] * 2 + [[4096, 11008]] + [[4096]] * 2
    return [[32000, 4096]] + layer * 32 + [[4096], [32000, 4096]]


def log_uniform_mix(count=2000, lo=4 << 10, hi=64 << 20, seed=0) -> list[list[int]]:
    """``count`` 1-D bf16 tensors whose sizes in bytes are log-uniform in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    nbytes = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return [[max(1, int(b) // 2)] for b in nbytes.tolist()]


PERIOD = 1_000_003  # a prime: a slice placed wrongly shows unless it is off by a multiple of this
_PATTERNS: dict[str, torch.Tensor] = {}


def pattern(device) -> torch.Tensor:
    """One period of bf16 bit patterns (int16), the same on every device: finite values (the exponent's
    top bit cleared), both signs."""
    key = str(torch.device(device))
    if key not in _PATTERNS:
        raw = torch.randint(-32768, 32768, (PERIOD,), dtype=torch.int32, generator=torch.Generator().manual_seed(1234))
        _PATTERNS[key] = (raw & -16385).to(torch.int16).to(device)
    return _PATTERNS[key]


@torch.no_grad()
def fill_pattern(param: torch.Tensor, salt: int) -> None:
    """Element j of ``param`` (row-major) gets ``pattern[(j + salt) % PERIOD]``: one period copied in,
    then doubled in place, so a 1 GiB parameter costs a few large copies on whichever device it is on."""
    assert param.element_size() == 2 and param.is_contiguous(), (param.dtype, param.shape)
    flat = param.detach().view(-1).view(torch.int16)
    pat, n, s = pattern(param.device), flat.numel(), salt % PERIOD
    first = min(n, PERIOD)
    head = min(first, PERIOD - s)
    flat[:head].copy_(pat[s:s + head])
    if first > head:
        flat[head:first].copy_(pat[:first - head])
    done = PERIOD
    while done < n:
        step = min(done, n - done)
        flat[done:done + step].copy_(flat[:step])
        done += step


def matches_pattern(values: torch.Tensor, start: int, salt: int) -> bool:
    """``values`` (int16, 1-D) are elements ``[start, start + len)`` of a parameter filled with ``salt``."""
    pat, step = pattern(values.device), 1 << 26
    for a in range(0, values.numel(), step):
        b = min(values.numel(), a + step)
        index = torch.arange(start + a, start + b, dtype=torch.int64, device=values.device).add_(salt).remainder_(PERIOD)
        if not torch.equal(values[a:b], pat[index]):
            return False
    return True


# ------------------------------------------------------------------------------------------- the models


class Experts(torch.nn.Module):
    """Two small layers, then one fused expert tensor created as a model's ``__init__`` would: the
    default dtype (zero.Init converts it), ``nn.init.normal_``. ``construct_done`` is the time its
    ``__init__`` ended (device synchronised), i.e. before zero.Init partitions the experts."""

    def __init__(self, shape: list[int], hidden: int):
        super().__init__()
        self.router = torch.nn.Linear(hidden, shape[0], bias=False)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.experts = torch.nn.Parameter(torch.empty(*shape))
        torch.nn.init.normal_(self.experts, std=0.02)
        sync()
        self.construct_done = time.perf_counter()


def expert_shape(gib: float) -> tuple[list[int], int]:
    """[128, 8192, 512 * gib] bf16 (4 GiB: [128, 8192, 2048]); 0: the smoke size. Also the small layers' width."""
    return ([128, 8192, int(512 * gib)], 2048) if gib else ([4, 8, 16], 16)


def _param(shape: list[int], salt: int, factory: dict) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(*shape, **factory))
    fill_pattern(param, salt)
    param.pattern_salt = salt
    return param


class Block(torch.nn.Module):
    def __init__(self, items: list[tuple[int, list[int]]], factory: dict):
        super().__init__()
        for index, shape in items:
            self.register_parameter(f"p{index}", _param(shape, index * 7919, factory))


class LLMMix(torch.nn.Module):
    """The LLM mix as a model holds it: its two largest tensors (embedding, output head) on the top
    module, the others spread round robin over ``layers`` blocks (the 8.6 GiB mix: 4 x [4096, 4096] and
    8 x [4096] each). Each module's params are created and filled in its own ``__init__``, so under
    zero.Init each module is partitioned on its own (key on: one per-rank buffer per module)."""

    def __init__(self, shapes: list[list[int]], layers: int, **factory):
        super().__init__()
        by_size = sorted(range(len(shapes)), key=lambda i: math.prod(shapes[i]))
        top = sorted(by_size[-2:])
        rest = [i for i in range(len(shapes)) if i not in top]
        self.blocks = torch.nn.ModuleList(Block([(i, shapes[i]) for i in rest[k::layers]], factory)
                                          for k in range(layers))
        for i in top:
            self.register_parameter(f"p{i}", _param(shapes[i], i * 7919, factory))
