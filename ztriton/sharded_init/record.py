"""What a placeholder remembers: the init calls made on it, in order, each with what replay needs.

A :class:`Record` belongs to one placeholder (a storage-less tensor, see :mod:`.recorder`). Its ops are
of four kinds, and each knows how to run itself on a real tensor — the full tensor (CPU replay and
fallbacks) or any contiguous run of its elements (CUDA windows; elementwise ops only):

* :class:`RandomOp` (``normal_``, ``uniform_``): overwrites every element with draws; keeps the
  generator and its state before the call. Recording one advances the generator exactly as the full
  call would have (arithmetic on CUDA, the call itself on a scratch tensor on the CPU), so random calls
  on other tensors later during construction see the numbers they would have seen.
* :class:`FillOp` (``fill_``, ``zero_``): overwrites every element with one value.
* :class:`PointwiseOp` (``mul_``, ``add_``, ``clamp_``, ``erfinv_``, ...): an in-place elementwise op
  whose other operands are scalars or 0-dim tensors.
* :class:`CastOp`: a dtype conversion (``.to(dtype)``), which starts a new record (see :meth:`Record.derive`).
* :class:`CompositeOp`: a whole function run on the tensor (torch's rejection-sampling
  ``trunc_normal_`` of torch >= 2.13, whose number of draws depends on the values), CPU only.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ztriton.sharded_init import philox, rng

__all__ = ["CastOp", "CompositeOp", "FillOp", "PointwiseOp", "RandomOp", "Record"]

_VF = torch._C._VariableFunctions  # torch's own constructors: zero.Init replaces torch.empty & co.


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor, whatever constructor wrappers are active (zero.Init converts dtypes)."""
    return _VF.empty(shape, dtype=dtype, device=device)


def _name(func) -> str:
    return str(getattr(func, "__name__", func))


@dataclass(frozen=True)
class RandomOp:
    func: Any  # the aten overload, e.g. aten.normal_.default
    args: tuple  # after self
    kwargs: dict  # without the generator
    dtype: torch.dtype
    shape: torch.Size
    generator: torch.Generator
    start: rng.State  # the generator's state before the call
    overwrites = True

    def run(self, tensor: torch.Tensor) -> torch.Tensor:
        """The call on ``tensor`` (full, or a window), from whatever state the generator is in."""
        return self.func(tensor, *self.args, generator=self.generator, **self.kwargs)

    def run_full(self, tensor: torch.Tensor) -> torch.Tensor:
        rng.restore(self.generator, self.start)
        self.run(tensor.view(self.shape))
        return tensor

    def describe(self) -> str:
        return f"{_name(self.func)}{self.args}"


class _SameWhole:
    """An op that reads no generator: the whole tensor runs it as a window does."""

    def run_full(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.run(tensor)


@dataclass(frozen=True)
class FillOp(_SameWhole):
    func: Any
    args: tuple
    kwargs: dict
    dtype: torch.dtype
    shape: torch.Size
    overwrites = True

    def run(self, tensor: torch.Tensor) -> torch.Tensor:
        self.func(tensor, *self.args, **self.kwargs)
        return tensor

    def describe(self) -> str:
        return f"{_name(self.func)}{self.args}"


@dataclass(frozen=True)
class PointwiseOp(FillOp):
    overwrites = False


@dataclass(frozen=True)
class CastOp(_SameWhole):
    dtype: torch.dtype
    overwrites = False

    def run(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype)

    def describe(self) -> str:
        return f"to({self.dtype})"


@dataclass(frozen=True)
class CompositeOp:
    fn: Callable
    args: tuple
    kwargs: dict
    dtype: torch.dtype
    shape: torch.Size
    generator: torch.Generator
    start: rng.State
    overwrites = True

    def run_full(self, tensor: torch.Tensor) -> torch.Tensor:
        rng.restore(self.generator, self.start)
        self.fn(tensor.view(self.shape), *self.args, generator=self.generator, **self.kwargs)
        return tensor

    def describe(self) -> str:
        return f"{getattr(self.fn, '__qualname__', self.fn)}{self.args}"


Op = RandomOp | FillOp | PointwiseOp | CastOp | CompositeOp


@dataclass(eq=False)
class Record:
    """The history of one placeholder tensor of ``shape``/``dtype`` that stands for a tensor on ``device``.

    ``initial_dtype`` is the dtype the history starts in (a derived record starts in its parent's);
    ``origin`` says where the placeholder was made, ``name`` what the integration calls it (for logs).
    ``real`` is set once the record has been materialised (a fallback): from then on every alias of
    the placeholder stands for a view of it.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    initial_dtype: torch.dtype
    ops: list = field(default_factory=list)
    origin: str = ""
    name: str | None = None
    real: torch.Tensor | None = None
    storage: Any = None  # keeps the placeholder's meta storage alive, so its key is never reused
    placeholder: Any = None  # weak reference to the placeholder tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def materialised(self) -> bool:
        return self.real is not None

    def describe(self) -> str:
        what = self.name or "placeholder"
        return f"{what} {tuple(self.shape)} {self.dtype} on {self.device}" + (f" (made at {self.origin})" if self.origin else "")

    def effective_ops(self) -> tuple[torch.dtype, list]:
        """The ops that decide the values — from the last one that overwrites every element — and the
        dtype the first of them starts in. Without any overwrite, the values start as zeros."""
        ops = self.ops
        for i in range(len(ops) - 1, -1, -1):
            if ops[i].overwrites:
                return ops[i].dtype, ops[i:]
        return self.initial_dtype, list(ops)

    def random_ops(self) -> list[tuple[int, RandomOp | CompositeOp]]:
        return [(i, op) for i, op in enumerate(self.ops) if isinstance(op, (RandomOp, CompositeOp))]

    def with_start(self, index: int, start: rng.State) -> None:
        """Replay op ``index`` from ``start`` (another rank's state: see :func:`.replay.agree`)."""
        self.ops[index] = replace(self.ops[index], start=start)

    def derive(self, dtype: torch.dtype, tensor: torch.Tensor) -> "Record":
        """The record of a converted copy (``.to(dtype)``, ``clone``) of this placeholder: same history,
        then the cast. Later ops on either do not affect the other, as with real tensors."""
        ops = list(self.ops) + ([CastOp(dtype)] if dtype != self.dtype else [])
        child = Record(tensor.shape, dtype, self.device, self.initial_dtype, ops, self.origin, self.name)
        child.attach(tensor)
        return child

    def attach(self, tensor: torch.Tensor) -> None:
        self.storage = tensor.untyped_storage()
        self.placeholder = weakref.ref(tensor)

    # ---- recording

    def record_random(self, func, target: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Record ``func(target, *args, **kwargs)`` and advance the generator as the full call would."""
        kwargs = dict(kwargs)
        generator = rng.generator_for(self.device, kwargs.pop("generator", None))
        start = rng.capture(generator)
        op = RandomOp(func, tuple(args), kwargs, target.dtype, target.shape, generator, start)
        if self.device.type == "cuda":
            layout = philox.call_layout(self.numel, target.element_size(), philox.Geometry.of(self.device),
                                        philox.unroll(target.dtype))
            rng.restore(generator, start.advanced(layout[0]))
        else:  # mt19937 cannot be skipped ahead: draw for real, one scratch tensor at a time
            op.run(empty(target.shape, target.dtype, self.device))
        self.ops.append(op)

    def record_composite(self, fn: Callable, target: torch.Tensor, args: tuple, kwargs: dict) -> None:
        kwargs = dict(kwargs)
        generator = rng.generator_for(self.device, kwargs.pop("generator", None))
        start = rng.capture(generator)
        op = CompositeOp(fn, tuple(args), kwargs, target.dtype, target.shape, generator, start)
        if self.device.type != "cpu":
            raise NotImplementedError("composite ops are recorded on the CPU only")
        fn(empty(target.shape, target.dtype, self.device), *args, generator=generator, **kwargs)
        self.ops.append(op)

    def record_fill(self, func, target: torch.Tensor, args: tuple, kwargs: dict, overwrites: bool) -> None:
        kind = FillOp if overwrites else PointwiseOp
        self.ops.append(kind(func, tuple(args), dict(kwargs), target.dtype, target.shape))
