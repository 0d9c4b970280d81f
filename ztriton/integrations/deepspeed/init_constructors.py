"""``zero.Init``'s tensor constructors under the key: a large floating tensor asked for without a device
is a placeholder of the Init's :class:`~ztriton.sharded_init.Recorder` (no storage; its init calls
recorded), active from the wrappers' installation to their removal."""
from __future__ import annotations

import functools
import logging
import math
import numbers
import time
from typing import Callable

import torch

from ztriton.integrations.deepspeed import report
from ztriton.integrations.deepspeed.init_context import options_of, uses_ztriton
from ztriton.integrations.deepspeed.state import STATE, InitState
from ztriton.sharded_init import Recorder, prepare

logger = logging.getLogger("ztriton")

# The constructors zero.Init patches whose large floating results become placeholders.
PLACEHOLDER_CONSTRUCTORS = ("empty", "zeros", "ones", "full", "randn")
# Keyword arguments a placeholder can honour; any other (out=, names=, a layout, pinned memory) goes
# to DeepSpeed's constructor as it is.
_PLAIN_KWARGS = {"size", "dtype", "device", "requires_grad", "layout", "pin_memory", "memory_format",
                 "generator", "fill_value"}


def init_add_tensor_creation_wrappers(original, self):
    """``Init._add_tensor_creation_wrappers``: under the key, large floating tensors are placeholders
    recorded by a :class:`~ztriton.sharded_init.Recorder` active until the wrappers are removed."""
    if uses_ztriton(self):
        prepare()  # before DeepSpeed replaces torch.Tensor.__new__
    original(self)
    if not uses_ztriton(self):
        return
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    overrides = self.tensor_overrides
    target = self.dtype if DeepSpeedTensorOverride.dtype in overrides else None
    device = torch.device(self.local_device) if DeepSpeedTensorOverride.device in overrides else torch.device("cpu")
    _stop_recording(self)  # a wrapper pair left unbalanced by an exception: start afresh
    STATE.init(self).entered = time.perf_counter()
    STATE.init(self).launched = report.launch_count()
    recorder = Recorder()  # fallbacks materialise on the device the tensor stands for: exact values
    recorder.__enter__()
    STATE.init(self).recorder = recorder
    threshold = options_of(self).sharded_init_bytes
    for name in PLACEHOLDER_CONSTRUCTORS:
        setattr(torch, name, _placeholder_constructor(getattr(torch, name), name, recorder, threshold, target, device,
                                                      STATE.init(self)))
    remove = type(self)._remove_tensor_creation_wrappers

    def _remove_tensor_creation_wrappers():  # an instance attribute: DeepSpeed calls it through self
        try:
            remove(self)
        finally:
            _stop_recording(self)
            _summarise(self)

    self._remove_tensor_creation_wrappers = _remove_tensor_creation_wrappers


def _summarise(init) -> None:
    """One summary line on rank 0 when a zero.Init context that partitioned anything ends (what moved,
    how: sharded init and/or the partition path, bytes, time since the context was entered)."""
    state = STATE.init(init)
    if not state.done_params or state.entered is None:
        return
    how = "sharded init + partition" if state.sharded_params else "partition"
    report.step_summary("zero.Init", tier=how, nbytes=state.done_bytes, seconds=time.perf_counter() - state.entered,
                        peak_bytes=None, launches=report.launch_count() - state.launched, params=state.done_params,
                        sharded=state.sharded_params)
    state.entered = None


def _stop_recording(init) -> None:
    """Deactivate the Init's recorder; a placeholder still alive outside any module cannot be replaced
    (a meta tensor cannot be re-pointed at memory): say so, naming it."""
    state = STATE.init(init)
    recorder = None if state is None else state.recorder
    if recorder is None:
        return
    state.recorder = None
    try:
        for record in recorder.records():
            alive = record.placeholder() if record.placeholder is not None else None
            if alive is not None and not record.materialised:
                logger.warning("ztriton sharded init: %s was never made a module's parameter or buffer; outside "
                               "zero.Init it is a meta tensor without values (create it inside a module, or with "
                               "device= given)", record.describe())
    finally:
        recorder.__exit__(None, None, None)


def _placeholder_constructor(constructor: Callable, name: str, recorder: Recorder, threshold: int,
                             target: torch.dtype | None, device: torch.device, state: InitState) -> Callable:
    """``constructor`` (DeepSpeed's wrapper), except that a large floating tensor it would create on the
    device is a placeholder whose recorded values are those DeepSpeed's call gives: empty/zeros/ones
    straight in the Init's dtype (the same values), full/randn made in the dtype asked for and then
    converted, as DeepSpeed's wrapper converts them."""

    @functools.wraps(constructor)
    def create(*args, **kwargs):
        request = _placeholder_request(name, args, kwargs, threshold)
        if request is None or recorder._paused or not recorder.active:
            return constructor(*args, **kwargs)
        if not recorder.can_watch():
            _log_cannot_watch(state, name, request)
            return constructor(*args, **kwargs)
        shape, dtype = request
        direct = name in ("empty", "zeros", "ones")
        tensor = recorder.placeholder(shape, target if direct and target is not None else dtype, device)
        if name == "zeros":
            tensor.zero_()
        elif name == "ones":
            tensor.fill_(1)
        elif name == "full":
            tensor.fill_(kwargs["fill_value"] if "fill_value" in kwargs else args[1])
        elif name == "randn":
            tensor.normal_(generator=kwargs.get("generator"))
        if target is not None and tensor.dtype != target:
            tensor = tensor.to(target)
        if kwargs.get("requires_grad"):
            tensor.requires_grad_(True)
        return tensor

    return create


def _log_cannot_watch(state: InitState, name: str, request: tuple) -> None:
    """One line per Init: a large tensor made where the recorder cannot watch it is made in full."""
    if state.told_unwatchable:
        return
    state.told_unwatchable = True
    logger.info("ztriton zero.Init: torch.%s of shape %s is created in full (as DeepSpeed does), not by sharded init: "
                "another torch mode is active or it is made on another thread than the Init's; the same holds for "
                "any later such tensor of this Init", name, tuple(request[0]))


def _placeholder_request(name: str, args: tuple, kwargs: dict, threshold: int) -> tuple[torch.Size, torch.dtype] | None:
    """The shape and dtype of a constructor call that can be a placeholder: no device, a plain shape, a
    floating dtype, at least ``threshold`` bytes; None for any other call."""
    if kwargs.get("device") is not None or set(kwargs) - _PLAIN_KWARGS:
        return None
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory") \
            or kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        return None
    if ("generator" in kwargs and name != "randn") or ("fill_value" in kwargs and name != "full"):
        return None
    size = _requested_size(name, args, kwargs)
    if size is None:
        return None
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = _full_dtype(args, kwargs) if name == "full" else torch.get_default_dtype()
    if dtype is None or not dtype.is_floating_point:
        return None
    nbytes = math.prod(size) * dtype.itemsize  # in the dtype asked for: what DeepSpeed's path first creates
    return (size, dtype) if nbytes >= threshold else None


def _full_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype ``torch.full`` infers from its fill value: floats take the default dtype."""
    value = kwargs["fill_value"] if "fill_value" in kwargs else (args[1] if len(args) > 1 else None)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, numbers.Integral):
        return None
    return torch.get_default_dtype()


def _requested_size(name: str, args: tuple, kwargs: dict) -> torch.Size | None:
    """The shape a constructor call asks for, None if the call is not a plain shape."""
    size = kwargs.get("size")
    if size is None:
        if name == "full":
            if len(args) != 2 and not (len(args) == 1 and "fill_value" in kwargs):
                return None
            size = args[0]
        elif len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
            size = args[0]
        else:
            size = args
    elif args:
        return None
    if not isinstance(size, (tuple, list, torch.Size)):
        return None
    try:
        dims = [int(s) for s in size if isinstance(s, int) or (isinstance(s, torch.SymInt))]
    except (TypeError, ValueError):
        return None
    if len(dims) != len(size) or any(d < 0 for d in dims):
        return None
    return torch.Size(dims)
