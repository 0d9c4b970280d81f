"""``deepspeed.zero.Init`` under ``"partition_backend": "triton"``.

Parameters are partitioned through :mod:`ztriton.partitioning` as each module's ``__init__`` returns
(one call per partition group: MoE experts have their own), and tensors of at least
``host_init_bytes`` are created in host memory, so the full tensor never lands on the device. Modes
ztriton does not handle fall back to DeepSpeed's code with one log line naming the mode.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
from typing import Any, Callable

import torch

from ztriton import memory, policy
from ztriton.comm import world_of
from ztriton.integrations.deepspeed.config import settings_from
from ztriton.integrations.deepspeed.state import STATE, InitState
from ztriton.integrations.deepspeed.zero3_param import install_partitions, is_zero3_param, unsupported_reason
from ztriton.memory import format_bytes

logger = logging.getLogger("ztriton")

PROGRESS_EVERY_BYTES = 16 << 30

# Tensor constructors zero.Init redirects to the device; under ztriton the large ones go to the host.
# empty/zeros/ones are created straight in the target dtype there (same values, no full-size
# fp32 transient); the others keep DeepSpeed's create-then-convert so their values do not change.
_HOST_CONSTRUCTORS = {"empty": True, "zeros": True, "ones": True, "full": False, "randn": False}


def init_init(original, self, *args, **kwargs):
    """``Init.__init__``: read the key (an unknown backend fails before DeepSpeed does anything)."""
    bound = inspect.signature(original).bind(self, *args, **kwargs).arguments
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
    reason = unsupported_reason(init)
    if not state.announced:
        state.announced = True
        if reason is not None:
            logger.warning("ztriton: partition_backend='triton' falls back to DeepSpeed's zero.Init for %s, which "
                           "ztriton does not handle", reason)
        else:
            logger.info("ztriton: zero.Init partitions through ztriton (partitions on %s; parameters of %s or "
                        "more are created in host memory)", _offload_device(init) or init.local_device,
                        format_bytes(_options(init).host_init_bytes))
    return reason is None


def _offload_device(init) -> str | None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return "cpu" if init.remote_device == OffloadDeviceEnum.cpu else None


def _options(init) -> policy.Options:
    """The Init's options with the host-init size and the staging chunk picked, once per Init."""
    state = STATE.init(init)
    if state.options is None:
        from ztriton.partitioning import staging_chunk_bytes  # imports triton: on first use only

        options = state.settings.options
        local = torch.device(init.local_device)
        free = 0 if options.host_init_bytes is not None else memory.probe_memory(local).device_free
        world = torch.distributed.get_world_size(init.ds_process_group)
        chunk, _ = staging_chunk_bytes(local, world, options)
        state.options = dataclasses.replace(options, chunk_bytes=chunk,
                                            host_init_bytes=policy.choose_host_init_bytes(free, options.host_init_bytes))
    return state.options


def init_post_init_method(original, self, module):
    """``Init._post_init_method``: a module's own parameters, partitioned as its ``__init__`` returns."""
    if not _uses_ztriton(self):
        return original(self, module)
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as counters

    named = list(module.named_parameters(recurse=False))
    for _, param in named:  # the totals zero.Init logs on exit
        counters.num_module_parameters += 1
        counters.num_module_elements += param.numel()
    _partition_through_ztriton(self, [(n, p) for n, p in named if not is_zero3_param(p)])
    _buffers_to_device(self, module)
    self._keep_in_fp32(module)


def _buffers_to_device(init, module: torch.nn.Module) -> None:
    """Large tensors the module made in host memory (see _large_to_host) that became buffers, not
    params: buffers are never partitioned, and the engine does not move a zero.Init model, so they
    go where DeepSpeed's own zero.Init would have created them."""
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer is not None and getattr(buffer, "_ztriton_host_created", False):
            module._buffers[name] = buffer.to(init.local_device)


def init_convert_to_zero_parameters(original, self, param_list):
    """``Init._convert_to_zero_parameters`` (``zero.Init(module=...)`` and late parameters)."""
    if not _uses_ztriton(self):
        return original(self, param_list)
    params = [p for p in param_list if not is_zero3_param(p)]
    _partition_through_ztriton(self, [(f"param[{i}]", p) for i, p in enumerate(params)])


def _partition_through_ztriton(init, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Partition ``named`` as ``init`` would, one call per partition group (MoE experts have their own)."""
    from ztriton.partitioning import partition_params  # imports triton: on first use only

    _cast_like_deepspeed(named)
    buckets: dict[int, tuple[Any, list]] = {}
    for name, param in named:
        group = getattr(param, "ds_zero_partition_process_group", init.ds_process_group)
        buckets.setdefault(id(group), (group, []))[1].append((name, param))
    options = _options(init)
    local = torch.device(init.local_device)
    home = torch.device("cpu") if _offload_device(init) == "cpu" else local
    nbytes = sum(p.numel() * p.dtype.itemsize for _, p in named)
    for group, items in buckets.values():
        result = partition_params(items, world_of(group, required=True), home=home, probe_device=local,
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


def _cast_like_deepspeed(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Inside a ``zero.Init`` context a floating param that is not in the context's dtype (made by an
    unpatched op, e.g. ``torch.log(torch.arange(...))`` in fp32 under a bf16 Init) ends up in that dtype
    with DeepSpeed: its partition is allocated by the patched ``torch.empty`` and ``copy_`` converts.
    Do the same, so the dtype and values match (outside a context, ``torch.empty`` is torch's own and
    nothing changes)."""
    for _, param in named:
        if param.is_floating_point():
            target = torch.empty(0, dtype=param.dtype, device="cpu").dtype
            if target != param.dtype:
                param.data = param.data.to(target)


def init_add_tensor_creation_wrappers(original, self):
    """``Init._add_tensor_creation_wrappers``: under the key, large tensors are created in host memory."""
    original(self)
    if not _uses_ztriton(self):
        return
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    target = self.dtype if DeepSpeedTensorOverride.dtype in self.tensor_overrides else None
    for name, direct_dtype in _HOST_CONSTRUCTORS.items():
        setattr(torch, name, _large_to_host(getattr(torch, name), name, self, target if direct_dtype else None))


def _large_to_host(constructor: Callable, name: str, init, direct_dtype: torch.dtype | None) -> Callable:
    threshold = _options(init).host_init_bytes
    pin = bool(init.pin_memory) and torch.cuda.is_available()
    state = STATE.init(init)

    @functools.wraps(constructor)
    def create(*args, **kwargs):
        if kwargs.get("device") is None:
            nbytes = _requested_bytes(name, args, kwargs)
            if nbytes is not None and nbytes >= threshold:
                kwargs["device"] = "cpu"
                if pin:
                    kwargs["pin_memory"] = True
                dtype = kwargs.get("dtype") or torch.get_default_dtype()
                if direct_dtype is not None and dtype.is_floating_point:
                    kwargs["dtype"] = direct_dtype
                state.host_created += 1
                logger.debug("ztriton: %s of %s created in host memory (>= %s)", name, format_bytes(nbytes),
                             format_bytes(threshold))
                tensor = constructor(*args, **kwargs)
                tensor._ztriton_host_created = True  # a buffer made from it goes back to the device
                return tensor
        return constructor(*args, **kwargs)

    return create


def _requested_bytes(name: str, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the tensor a constructor call asks for (in the dtype it asks for: what DeepSpeed's path
    would first create on the device), None if the call is not a plain shape."""
    size = kwargs.get("size")
    if size is None:
        if name == "full":
            size = args[0] if args else None
        elif len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
            size = args[0]
        else:
            size = args
    try:
        numel = math.prod(int(s) for s in size)
    except (TypeError, ValueError):
        return None
    # itemsize, not a probe tensor: inside zero.Init torch.empty itself converts to the target dtype
    return numel * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize
