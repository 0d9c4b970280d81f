"""``deepspeed.zero.Init`` under ``"partition_backend": "triton"``.

Parameters are partitioned through :mod:`ztriton.partitioning` as each module's ``__init__`` returns
(one call per partition group: MoE experts have their own). Modes ztriton does not handle fall back to
DeepSpeed's code with one log line naming the mode.

Exact sharded init (:mod:`ztriton.sharded_init`): while the Init's tensor constructors are patched, a
floating tensor of at least ``host_init_bytes`` asked of ``torch.empty/zeros/ones/full/randn`` without a
device is a placeholder that allocates nothing and records the init calls made on it. At the module's
end each rank replays them on its own slice only (on CUDA: straight into the partition, the device
generator advanced exactly as the full calls would have), so the values are DeepSpeed's, bit for bit,
and the full tensor is never allocated. Anything the recorder cannot replay materialises that tensor
in full on the device, as DeepSpeed would have made it, with one log line: the values stay exact.
(``host_init_bytes`` keeps its name for compatibility; it is now the placeholder threshold.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import time
import weakref
from typing import Any, Callable

import torch

from ztriton import memory, policy
from ztriton.comm import World, world_of
from ztriton.integrations.deepspeed import report
from ztriton.integrations.deepspeed.config import settings_from
from ztriton.integrations.deepspeed.state import STATE, InitState
from ztriton.integrations.deepspeed.zero3_param import install_partitions, is_zero3_param, unsupported_reason
from ztriton.layout import zero3_slice
from ztriton.memory import format_bytes
from ztriton.sharded_init import Recorder, agree, prepare, replay
from ztriton.sharded_init.record import Record

logger = logging.getLogger("ztriton")

PROGRESS_EVERY_BYTES = 16 << 30

# The constructors zero.Init patches whose large floating results become placeholders.
PLACEHOLDER_CONSTRUCTORS = ("empty", "zeros", "ones", "full", "randn")
# Keyword arguments a placeholder can honour; any other (out=, names=, a layout, pinned memory) goes
# to DeepSpeed's constructor as it is.
_PLAIN_KWARGS = {"size", "dtype", "device", "requires_grad", "layout", "pin_memory", "memory_format",
                 "generator", "fill_value"}

_VF = torch._C._VariableFunctions  # torch's own constructors, whatever zero.Init has patched

# The recorder of each Init whose constructors are patched (the top-level Init: nested ones reuse it).
_RECORDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)  # ~0.1 ms a call, once per zero.Init otherwise


def init_init(original, self, *args, **kwargs):
    """``Init.__init__``: read the key (an unknown backend fails before DeepSpeed does anything)."""
    bound = _signature(original).bind(self, *args, **kwargs).arguments
    config = bound.get("config")  # DeepSpeed's precedence: the deprecated config= wins when given
    if config is None:
        config = bound.get("config_dict_or_path")
    STATE.inits[self] = InitState(settings_from(config))
    original(self, *args, **kwargs)
    _uses_ztriton(self)  # the log line, once, even if the module creates no parameters


def _uses_ztriton(init) -> bool:
    """Whether this ``zero.Init`` partitions through ztriton; logs the decision once per Init."""
    state = STATE.init(init)
    if state is None or not state.settings.triton or not hasattr(init, "remote_device"):
        return False  # not ours, or asked before DeepSpeed's __init__ set up the devices
    if state.uses_ztriton is not None:  # decided once: every hook of every module asks
        return state.uses_ztriton
    reason = unsupported_reason(init)
    state.uses_ztriton = reason is None
    if reason is not None:
        logger.warning("ztriton: partition_backend='triton' falls back to DeepSpeed's zero.Init for %s, which "
                       "ztriton does not handle", reason)
    else:
        logger.info("ztriton: zero.Init partitions through ztriton (partitions on %s; parameters of %s or "
                    "more are initialised shard by shard)", _offload_device(init) or init.local_device,
                    format_bytes(_options(init).host_init_bytes))
    return state.uses_ztriton


def _offload_device(init) -> str | None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return "cpu" if init.remote_device == OffloadDeviceEnum.cpu else None


def _options(init) -> policy.Options:
    """The Init's options with the placeholder threshold picked, once per Init (a probe of free memory
    when the config does not set it)."""
    state = STATE.init(init)
    if state.options is None:
        options = state.settings.options
        free = 0 if options.host_init_bytes is not None else memory.probe_memory(torch.device(init.local_device)).device_free
        state.options = dataclasses.replace(options,
                                            host_init_bytes=policy.choose_host_init_bytes(free, options.host_init_bytes))
    return state.options


def _partition_options(init) -> policy.Options:
    """:func:`_options` with the staging chunk picked too, on the Init's first ztriton partition (an Init
    whose parameters are all initialised shard by shard never probes for it)."""
    options = _options(init)
    if options.chunk_bytes is None:
        from ztriton.partitioning import staging_chunk_bytes  # on first use (triton only for a launch)

        world = _world(init, init.ds_process_group)
        chunk, _ = staging_chunk_bytes(torch.device(init.local_device), world.size, options)
        options = STATE.init(init).options = dataclasses.replace(options, chunk_bytes=chunk)
    return options


# ---------------------------------------------------------------------------------- a module's end


def init_post_init_method(original, self, *args, **kwargs):
    """``Init._post_init_method``: a module's own parameters, partitioned as its ``__init__`` returns."""
    if not _uses_ztriton(self):
        return original(self, *args, **kwargs)
    module = args[0] if args else kwargs["module"]
    recorder = _RECORDERS.get(self)
    with recorder.paused() if recorder is not None else contextlib.nullcontext():
        _post_init(self, module)


def _post_init(self, module: torch.nn.Module) -> None:
    """The module's end, with the recorder (if any) paused: its own ops are the integration's, not the model's."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as counters

    sharded = _take_placeholders(self, module)
    named = list(module.named_parameters(recurse=False))
    for _, param in named:  # the totals zero.Init logs on exit
        counters.num_module_parameters += 1
        counters.num_module_elements += param.numel()
    placeholder_ids = {id(param) for _, param, _ in sharded}
    _partition_through_ztriton(self, [(n, p) for n, p in named if not is_zero3_param(p) and id(p) not in placeholder_ids])
    _install_sharded(self, sharded)
    STATE.variants.keep_in_fp32(self, module)  # what DeepSpeed's _post_init_method does after partitioning


def _take_placeholders(init, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, Record]]:
    """Swap the module's placeholders for real tensors: buffers and attributes in full (they are never
    partitioned), parameters as storage-less stand-ins to be partitioned by replay. A parameter whose
    placeholder was materialised (a fallback) comes back whole and takes the ordinary path."""
    recorder = _RECORDERS.get(init)
    if recorder is None or not recorder.records():
        return []
    taken = recorder.take_parameters(module)  # the recorder is paused here (init_post_init_method)
    recorder.take_tensors(module)
    sharded = []
    for name, param, record in taken:
        if record is not None:
            record.name = record.name or f"{type(module).__name__}.{name}"
            sharded.append((name, param, record))
    return sharded


def _install_sharded(init, sharded: list[tuple[str, torch.nn.Parameter, Record]]) -> None:
    """Each placeholder parameter's partition, written by replay on this rank's slice only, installed as
    its ``ds_tensor``. One agreement on rank 0's generator states per partition group."""
    if not sharded:
        return
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    from ztriton.partitioning import Partition, Partitioned, Transfer

    recorder = _RECORDERS[init]
    target = init.dtype if DeepSpeedTensorOverride.dtype in init.tensor_overrides else None
    buckets: dict[int, tuple[Any, list]] = {}
    for item in sharded:
        group = STATE.variants.partition_group(init, item[1])
        buckets.setdefault(id(group), (group, []))[1].append(item)
    home = _partition_home(init)
    nbytes = 0
    for group, items in buckets.values():
        world = _world(init, group)
        agree([record for _, _, record in items], group)
        partitions = []
        for name, param, record in items:
            data = _replayed_partition(record, world.size, world.rank, home, target, init)
            if data.dtype != param.dtype:  # DeepSpeed's param ends in its partition's dtype too
                param.data = _VF.empty((1,), dtype=data.dtype, device=param.device).expand(param.shape)
            partitions.append(Partition(name, param, data, zero3_slice(record.numel, world.size).aligned_numel))
            nbytes += record.numel * data.element_size()
        result = Partitioned({}, [n for n, _, _ in items], world.size, world.rank, Transfer.LOCAL, 0,
                             ["sharded init: each rank replayed its own slice"], partitions)
        install_partitions(init, result)
        for _, _, record in items:
            recorder.release(record)
        if logger.isEnabledFor(logging.DEBUG):  # describing each record costs more than the replay's launch
            logger.debug("ztriton zero.Init: %d param(s) initialised shard by shard (%s)", len(items),
                         ", ".join(r.describe() for _, _, r in items))
    STATE.init(init).sharded_params += len(sharded)
    _progress(STATE.init(init), len(sharded), nbytes)


def _world(init, group) -> World:
    """The World of ``group``, once per Init and group (each query of torch.distributed costs tens of
    microseconds, and every module's end asks)."""
    worlds = STATE.init(init).worlds
    world = worlds.get(id(group))
    if world is None or world.group is not group:
        world = worlds[id(group)] = world_of(group, required=True)
    return world


def _partition_home(init) -> torch.device:
    return torch.device("cpu") if _offload_device(init) == "cpu" else torch.device(init.local_device)


def _replayed_partition(record: Record, world_size: int, rank: int, home: torch.device,
                        target: torch.dtype | None, init) -> torch.Tensor:
    """This rank's partition of ``record`` on ``home``, padding zeroed. A floating record not in the
    Init's dtype is converted as DeepSpeed converts it: its patched ``torch.empty`` makes the partition
    in the Init's dtype and ``copy_`` casts this rank's slice (the same elements, the same length)."""
    layout = zero3_slice(record.numel, world_size)
    count, start = layout.partition_numel, layout.rank_start(rank)
    pin = home.type == "cpu" and bool(init.pin_memory) and torch.cuda.is_available()
    dtype = target if target is not None and record.dtype.is_floating_point and record.dtype != target else record.dtype
    out = _VF.empty((count,), dtype=dtype, device=home, pin_memory=pin)
    if dtype == record.dtype:
        replay(record, out, start, count)
        return out
    own = _VF.empty((count,), dtype=record.dtype, device=record.device)
    replay(record, own, start, count)
    valid = layout.valid_numel(rank)
    out.narrow(0, 0, valid).copy_(own.narrow(0, 0, valid))
    out.narrow(0, valid, count - valid).zero_()
    return out


def init_convert_to_zero_parameters(original, self, *args, **kwargs):
    """``Init._convert_to_zero_parameters`` (``zero.Init(module=...)`` and late parameters)."""
    if not _uses_ztriton(self):
        return original(self, *args, **kwargs)
    param_list = args[0] if args else kwargs["param_list"]
    params = [p for p in param_list if not is_zero3_param(p)]
    _partition_through_ztriton(self, [(f"param[{i}]", p) for i, p in enumerate(params)])


def _partition_through_ztriton(init, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Partition ``named`` as ``init`` would, one call per partition group (MoE experts have their own)."""
    if not named:
        return
    from ztriton.partitioning import partition_params  # on first use (triton only for a launch)

    nbytes = sum(p.numel() * p.dtype.itemsize for _, p in named)  # before partitioning empties them
    buckets: dict[int, tuple[Any, list]] = {}
    for name, param in named:
        group = STATE.variants.partition_group(init, param)
        buckets.setdefault(id(group), (group, []))[1].append((name, param))
    options = _partition_options(init)
    local = torch.device(init.local_device)
    home = _partition_home(init)
    for group, items in buckets.values():
        world = _world(init, group)
        _cast_like_deepspeed(items, world.size, local)
        result = partition_params(items, world, home=home, probe_device=local,
                                  pin_memory=init.pin_memory, options=options, log_level=logging.DEBUG)
        install_partitions(init, result)
    _progress(STATE.init(init), len(named), nbytes)


def _progress(state: InitState, params: int, nbytes: int) -> None:
    """An INFO line each time another 16 GiB of parameters has been partitioned: long loads show life."""
    before = state.done_bytes
    state.done_bytes += nbytes
    state.done_params += params
    if state.done_bytes // PROGRESS_EVERY_BYTES > before // PROGRESS_EVERY_BYTES:
        logger.info("ztriton zero.Init: %s of parameters partitioned so far (%d params)",
                    format_bytes(state.done_bytes), state.done_params)


def _cast_like_deepspeed(named: list[tuple[str, torch.nn.Parameter]], world_size: int, local: torch.device) -> None:
    """Inside a ``zero.Init`` context a floating param that is not in the context's dtype (made by an
    unpatched op, e.g. ``torch.log(torch.arange(...))`` in fp32 under a bf16 Init) ends up in that dtype
    with DeepSpeed: it moves the param to the local device, its patched ``torch.empty`` allocates the
    partition in the context's dtype and ``copy_`` converts this rank's slice. Do the same, slice by
    slice on the local device (a whole-tensor cast can give other NaN payload bits: the CPU's cast
    treats an element by where it falls in the vectorised loop); outside a context nothing changes."""
    targets: dict[torch.dtype, torch.dtype] = {}  # what the patched torch.empty makes of each dtype, asked once
    for _, param in named:
        if param.is_floating_point():
            if param.dtype not in targets:
                targets[param.dtype] = torch.empty(0, dtype=param.dtype, device="cpu").dtype
            target = targets[param.dtype]
            if target != param.dtype:
                param.data = _cast_per_slice(param.data.to(local), target, world_size)


def _cast_per_slice(source: torch.Tensor, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """``source`` in ``dtype``, converted one ZeRO-3 slice at a time, as each rank's ``copy_`` does."""
    flat = source.contiguous().view(-1)
    out = _VF.empty(source.shape, dtype=dtype, device=source.device)
    out_flat = out.view(-1)
    layout = zero3_slice(flat.numel(), world_size)
    for rank in range(world_size):
        valid = layout.valid_numel(rank)
        if valid:
            start = layout.rank_start(rank)
            out_flat.narrow(0, start, valid).copy_(flat.narrow(0, start, valid))
    return out


# ---------------------------------------------------------------------------------- constructors


def init_add_tensor_creation_wrappers(original, self):
    """``Init._add_tensor_creation_wrappers``: under the key, large floating tensors are placeholders
    recorded by a :class:`~ztriton.sharded_init.Recorder` active until the wrappers are removed."""
    if _uses_ztriton(self):
        prepare()  # before DeepSpeed replaces torch.Tensor.__new__
    original(self)
    if not _uses_ztriton(self):
        return
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    overrides = self.tensor_overrides
    target = self.dtype if DeepSpeedTensorOverride.dtype in overrides else None
    device = torch.device(self.local_device) if DeepSpeedTensorOverride.device in overrides else torch.device("cpu")
    _stop_recording(self)  # a wrapper pair left unbalanced by an exception: start afresh
    STATE.init(self).entered = time.perf_counter()
    recorder = Recorder()  # fallbacks materialise on the device the tensor stands for: exact values
    recorder.__enter__()
    _RECORDERS[self] = recorder
    threshold = _options(self).host_init_bytes
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
                        peak_bytes=None, params=state.done_params, sharded=state.sharded_params)
    state.entered = None


def _stop_recording(init) -> None:
    """Deactivate the Init's recorder; a placeholder still alive outside any module cannot be replaced
    (a meta tensor cannot be re-pointed at memory): say so, naming it."""
    recorder = _RECORDERS.pop(init, None)
    if recorder is None:
        return
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
