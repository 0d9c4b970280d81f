"""The aten ops a placeholder meets while recorded, sorted by what the recorder does with them, and the
checks that decide whether one call can be recorded."""
from __future__ import annotations

import torch
import torch.nn.init as nn_init
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ztriton.sharded_init.record import Record, empty

aten = torch.ops.aten

RANDOM = {aten.normal_.default, aten.uniform_.default}
FILLS = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
POINTWISE = {
    aten.mul_.Scalar, aten.mul_.Tensor, aten.add_.Scalar, aten.add_.Tensor, aten.sub_.Scalar, aten.sub_.Tensor,
    aten.div_.Scalar, aten.div_.Tensor, aten.div_.Tensor_mode, aten.div_.Scalar_mode, aten.clamp_.default,
    aten.clamp_.Tensor, aten.clamp_min_.default, aten.clamp_max_.default, aten.erfinv_.default, aten.neg_.default,
    aten.abs_.default, aten.exp_.default, aten.log_.default, aten.sqrt_.default, aten.pow_.Scalar,
    aten.tanh_.default, aten.sigmoid_.default, aten.reciprocal_.default,
}
FACTORIES = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
             aten.randint_like, aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones, aten.new_full}
COPIES = {aten._to_copy.default, aten.clone.default}
METADATA = {aten._has_compatible_shallow_copy_type.default, aten.is_same_size.default}


class DispatchMode(TorchDispatchMode):
    """A dispatch mode that torch does not wrap in ``torch._dynamo.disable``. torch >= 2.5 wraps every
    mode's ``__torch_dispatch__`` so, and the wrapper imports torch._dynamo on the mode's first op
    (1.5-5 s in a fresh process, and it fails while ``zero.Init`` has replaced ``torch.Tensor.__new__``)
    and adds a Python frame to every op. Our modes only watch eager construction; nothing compiles
    through them."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def tensor_arguments(args, kwargs):
    """The tensors among an aten op's arguments: each one or in a list (``Tensor[]``, ``Tensor?[]``), the
    only nesting aten schemas have. A plain loop rather than a pytree walk: it runs for every op while
    any placeholder is alive."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def same_place(device, home: torch.device) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    if device.type == "meta":
        return True
    if device.type != home.type:
        return False
    return device.index is None or home.index is None or device.index == home.index


def whole(tensor: torch.Tensor, record: Record) -> bool:
    """Whether ``tensor`` covers the record's tensor element for element in the same order."""
    return (tensor.dtype == record.dtype and tensor.numel() == record.numel and tensor.storage_offset() == 0
            and tensor.is_contiguous())


def scalars_only(args, kwargs) -> bool:
    """Other operands of a recordable op: numbers, or 0-dim tensors that are not placeholders."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() != 0 or leaf.is_meta:
                return False
    return True


# Dtypes whose recordable ops all have CPU kernels (float8 has almost none: it is checked on meta).
_CPU_CHECKED = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def check_arguments(func, target: torch.Tensor, args: tuple, kwargs: dict) -> None:
    """torch's own argument checks of a recordable op (``std >= 0``, ``from <= to``, a fill value that
    fits the dtype), raised where the real call would raise them. Run on a one-element CPU tensor, with
    a private generator for random ops, rather than on the meta tensor: the meta kernels of several of
    these ops (``normal_``, ``clamp_``) are Python references whose first call imports torch._dynamo
    (1.5-5 s in a fresh process), and that import fails while ``zero.Init`` has replaced
    ``torch.Tensor.__new__``."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    if target.dtype not in _CPU_CHECKED or any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"
                                               for leaf in tree_leaves((args, kwargs))):
        func(target, *args, **kwargs)  # a device scalar cannot meet a CPU tensor: checked on meta
        return
    if func in RANDOM:
        kwargs["generator"] = torch.Generator()
    func(empty((1,), target.dtype, torch.device("cpu")), *args, **kwargs)


def is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


_POINTWISE_TRUNC_NORMAL: list[bool] = []


def trunc_normal_is_pointwise() -> bool:
    """Whether this torch's ``trunc_normal_`` is one uniform_ followed by elementwise ops (<= 2.12),
    which record op by op; found once by watching it on a tiny tensor with a private generator."""
    if not _POINTWISE_TRUNC_NORMAL:
        seen: set = set()

        class Watch(DispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.add(func)
                return func(*args, **(kwargs or {}))

        with Watch():
            nn_init._no_grad_trunc_normal_(empty((8,), torch.float32, torch.device("cpu")), 0.0, 1.0, -2.0, 2.0,
                                           generator=torch.Generator())
        _POINTWISE_TRUNC_NORMAL.append(seen <= (RANDOM | POINTWISE))
    return _POINTWISE_TRUNC_NORMAL[0]

