"""The two torch modes through which a :class:`~.recorder.Recorder` watches construction, and the
context in which it passes every op through.

The function mode answers the Python-level questions a meta tensor would answer wrongly (``device``,
``is_meta``, ``is_cuda``, ``is_cpu``, ``get_device()``, ``.data``, and ``.to()``/``.cuda()``/``.cpu()`` to the
device it already stands for); the dispatch mode hands every aten op on a placeholder to the recorder.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from ztriton.sharded_init.aten_ops import DispatchMode, same_place
from ztriton.sharded_init.record import Record

if TYPE_CHECKING:
    from ztriton.sharded_init.recorder import Recorder

logger = logging.getLogger("ztriton")

_GETTERS = {torch._C.TensorBase.device, torch._C.TensorBase.is_meta, torch._C.TensorBase.is_cuda,
            torch._C.TensorBase.is_cpu, torch._C.TensorBase.data}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.get_device, torch.Tensor.new_tensor,
          torch.Tensor.__setitem__}


class _Watching:
    """A mode of one recorder's."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder


class Functions(_Watching, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.recorder._records:  # every call of the construction passes here: no placeholder, no question
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        if (owner in _GETTERS or func in _MOVES) and args:
            record = self.recorder.record_of(args[0])
            if record is not None:
                return answer(self.recorder, func, owner, record, args, kwargs)
        return func(*args, **kwargs)


class Dispatch(_Watching, DispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder._paused or not recorder._records:
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # our own questions get the meta tensor's true answers
            found = recorder._placeholders_in(args, kwargs)
            if not found:
                return func(*args, **kwargs)
            return recorder._handle(func, args, kwargs, found)


def answer(recorder: Recorder, func, owner, record: Record, args, kwargs):
    """A placeholder's answer to a Python-level question, as the tensor it stands for would answer."""
    tensor = args[0]
    if owner is torch._C.TensorBase.device:
        return record.device
    if owner is torch._C.TensorBase.is_meta:
        return False
    if owner is torch._C.TensorBase.is_cuda:
        return record.device.type == "cuda"
    if owner is torch._C.TensorBase.is_cpu:
        return record.device.type == "cpu"
    if owner is torch._C.TensorBase.data:  # the getter; the setter arrives with two arguments
        if len(args) == 1:
            return func(*args, **kwargs)
        return _set_data(recorder, tensor, record, args[1])
    if func is torch.Tensor.__setitem__:
        # torch turns a number assigned here into a tensor on the target's device (meta: the value
        # would be lost before dispatch), so this one falls back before torch sees it
        if not record.materialised:
            recorder._materialise(record, "Tensor.__setitem__")
        return func(recorder._substitute(tensor, record), *args[1:], **kwargs)
    if func is torch.Tensor.new_tensor:  # made from data on the tensor's device: the one it stands for
        kwargs = {**kwargs, "device": kwargs.get("device") or record.device}
        return func(*args, **kwargs)
    if func is torch.Tensor.get_device:
        return record.device.index if record.device.type == "cuda" else -1
    if func is torch.Tensor.cuda and record.device.type == "cuda" and not kwargs and len(args) == 1:
        return tensor
    if func is torch.Tensor.cpu and record.device.type == "cpu":
        return tensor
    if func is torch.Tensor.to:
        kwargs = dict(kwargs)
        copy = kwargs.pop("copy", False)
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        if same_place(device, record.device):  # .to() the device it stands for: a dtype change at most
            if (dtype is None or dtype == tensor.dtype) and not copy:
                return tensor
            return func(tensor, dtype=dtype or tensor.dtype, copy=copy)
        kwargs["copy"] = copy
    return func(*args, **kwargs)


def _set_data(recorder: Recorder, tensor: torch.Tensor, record: Record, value) -> None:
    """``placeholder.data = value``. Another placeholder: re-point, as torch does. A real tensor: the
    placeholder (and every alias) then stands for that tensor."""
    if recorder.record_of(value) is not None:
        tensor.data = value
        return None
    if (not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype
            or not value.is_contiguous() or tensor.storage_offset() != 0 or tensor.numel() != record.numel):
        raise NotImplementedError(
            f"cannot set .data of {record.describe()} to a {getattr(value, 'dtype', type(value))} tensor of shape "
            f"{tuple(getattr(value, 'shape', ()))}: while recording, only a contiguous tensor of the same shape "
            "and dtype can replace a whole placeholder; assign the parameter itself instead")
    if not record.materialised:
        logger.warning("ztriton sharded init: .data of %s set to a real tensor; it is no longer generated by "
                       "replay", record.describe())
        recorder.fallbacks.append(("Tensor.data (set)", record))
    record.real = value.view(record.shape)
    return None


class Paused:
    """Every op passes through; the modes step aside while they are innermost (the integration's own
    work at a module's end would otherwise pay for them op by op) and come back if a record is left."""

    def __init__(self, recorder: Recorder, step_aside: bool = True):
        self.recorder, self.before, self.stepped_aside = recorder, False, False
        self.step_aside = step_aside

    def __enter__(self):
        self.before, self.recorder._paused = self.recorder._paused, True
        self.stepped_aside = self.step_aside and self.recorder._step_aside()
        return self

    def __exit__(self, *exc):
        self.recorder._paused = self.before
        if self.stepped_aside and self.recorder._records and self.recorder.active:
            self.recorder._watch()
