"""A module's placeholder parameters made ZeRO-3 parameters: each rank replays the recorded init calls on
its own slice, straight into its partition (:mod:`ztriton.sharded_init`)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from ztriton.integrations.deepspeed.init_context import count_progress, group_world, partition_home
from ztriton.integrations.deepspeed.state import STATE
from ztriton.integrations.deepspeed.zero3_param import install_partitions
from ztriton.layout import zero3_slice
from ztriton.sharded_init import agree, replay
from ztriton.sharded_init.record import Record

logger = logging.getLogger("ztriton")

_VF = torch._C._VariableFunctions  # torch's own constructors, whatever zero.Init has patched


def take_placeholders(init, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, Record]]:
    """Swap the module's placeholders for real tensors: buffers and attributes in full (they are never
    partitioned), parameters as storage-less stand-ins to be partitioned by replay. A parameter whose
    placeholder was materialised (a fallback) comes back whole and takes the ordinary path."""
    recorder = STATE.init(init).recorder
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


def install_sharded(init, sharded: list[tuple[str, torch.nn.Parameter, Record]]) -> None:
    """Each placeholder parameter's partition, written by replay on this rank's slice only, installed as
    its ``ds_tensor``. One agreement on rank 0's generator states per partition group."""
    if not sharded:
        return
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    from ztriton.partitioning import Partition, Partitioned, Transfer

    recorder = STATE.init(init).recorder
    target = init.dtype if DeepSpeedTensorOverride.dtype in init.tensor_overrides else None
    buckets: dict[int, tuple[Any, list]] = {}
    for item in sharded:
        group = STATE.variants.partition_group(init, item[1])
        buckets.setdefault(id(group), (group, []))[1].append(item)
    home = partition_home(init)
    nbytes = 0
    for group, items in buckets.values():
        world = group_world(init, group)
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
    count_progress(STATE.init(init), len(sharded), nbytes)


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
