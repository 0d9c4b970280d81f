"""``deepspeed.zero.Init`` under ``"partition_backend": "triton"``.

Parameters are partitioned through :mod:`ztriton.partitioning` as each module's ``__init__`` returns
(one call per partition group: MoE experts have their own). Modes ztriton does not handle fall back to
DeepSpeed's code with one log line naming the mode.

Exact sharded init (:mod:`ztriton.sharded_init`): while the Init's tensor constructors are patched, a
floating tensor of at least ``sharded_init_bytes`` asked of ``torch.empty/zeros/ones/full/randn`` without a
device is a placeholder that allocates nothing and records the init calls made on it. At the module's
end each rank replays them on its own slice only (on CUDA: straight into the partition, the device
generator advanced exactly as the full calls would have), so the values are DeepSpeed's, bit for bit,
and the full tensor is never allocated. Anything the recorder cannot replay materialises that tensor
in full on the device, as DeepSpeed would have made it, with one log line: the values stay exact.
(The option was called ``host_init_bytes`` before; that name is still read, with a warning, for one release.)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any, Callable

import torch

from ztriton.integrations.deepspeed.config import settings_from
from ztriton.integrations.deepspeed.init_context import (count_progress, group_world, partition_home, partition_options,
                                                       uses_ztriton)
from ztriton.integrations.deepspeed.sharded_params import install_sharded, take_placeholders
from ztriton.integrations.deepspeed.state import STATE, InitState
from ztriton.integrations.deepspeed.zero3_param import install_partitions, is_zero3_param
from ztriton.layout import zero3_slice

logger = logging.getLogger("ztriton")

_VF = torch._C._VariableFunctions  # torch's own constructors, whatever zero.Init has patched


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
    uses_ztriton(self)  # the log line, once, even if the module creates no parameters


def init_post_init_method(original, self, *args, **kwargs):
    """``Init._post_init_method``: a module's own parameters, partitioned as its ``__init__`` returns."""
    if not uses_ztriton(self):
        return original(self, *args, **kwargs)
    module = args[0] if args else kwargs["module"]
    recorder = STATE.init(self).recorder
    with recorder.paused() if recorder is not None else contextlib.nullcontext():
        _post_init(self, module)


def _post_init(self, module: torch.nn.Module) -> None:
    """The module's end, with the recorder (if any) paused: its own ops are the integration's, not the model's."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as counters

    sharded = take_placeholders(self, module)
    named = list(module.named_parameters(recurse=False))
    for _, param in named:  # the totals zero.Init logs on exit
        counters.num_module_parameters += 1
        counters.num_module_elements += param.numel()
    placeholder_ids = {id(param) for _, param, _ in sharded}
    _partition_through_ztriton(self, [(n, p) for n, p in named if not is_zero3_param(p) and id(p) not in placeholder_ids])
    install_sharded(self, sharded)
    STATE.variants.keep_in_fp32(self, module)  # what DeepSpeed's _post_init_method does after partitioning


def init_convert_to_zero_parameters(original, self, *args, **kwargs):
    """``Init._convert_to_zero_parameters`` (``zero.Init(module=...)`` and late parameters)."""
    if not uses_ztriton(self):
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
    options = partition_options(init)
    local = torch.device(init.local_device)
    home = partition_home(init)
    for group, items in buckets.values():
        world = group_world(init, group)
        _cast_like_deepspeed(items, world.size, local)
        result = partition_params(items, world, home=home, probe_device=local,
                                  pin_memory=init.pin_memory, options=options, log_level=logging.DEBUG)
        install_partitions(init, result)
    count_progress(STATE.init(init), len(named), nbytes)


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
