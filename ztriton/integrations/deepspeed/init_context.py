"""What the ``zero.Init`` hooks know of one Init: whether it partitions through ztriton (decided and said
once), its options (the placeholder threshold and the staging chunk, picked once), its worlds, where its
partitions live, and its progress line."""
from __future__ import annotations

import dataclasses
import logging

import torch

from ztriton import memory, policy
from ztriton.comm import World, world_of
from ztriton.integrations.deepspeed.state import STATE, InitState
from ztriton.integrations.deepspeed.zero3_param import unsupported_reason
from ztriton.memory import format_bytes

logger = logging.getLogger("ztriton")

PROGRESS_EVERY_BYTES = 16 << 30


def uses_ztriton(init) -> bool:
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
                    "more are initialised shard by shard)", offload_device(init) or init.local_device,
                    format_bytes(options_of(init).sharded_init_bytes))
    return state.uses_ztriton


def offload_device(init) -> str | None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return "cpu" if init.remote_device == OffloadDeviceEnum.cpu else None


def options_of(init) -> policy.Options:
    """The Init's options with the placeholder threshold picked, once per Init (a probe of free memory
    when the config does not set it)."""
    state = STATE.init(init)
    if state.options is None:
        options = state.settings.options
        free = 0 if options.sharded_init_bytes is not None else memory.probe_memory(torch.device(init.local_device)).device_free
        state.options = dataclasses.replace(options,
                                            sharded_init_bytes=policy.choose_sharded_init_bytes(free, options.sharded_init_bytes))
    return state.options


def partition_options(init) -> policy.Options:
    """:func:`options_of` with the staging chunk picked too, on the Init's first ztriton partition (an Init
    whose parameters are all initialised shard by shard never probes for it)."""
    options = options_of(init)
    if options.chunk_bytes is None:
        from ztriton.partitioning import staging_chunk_bytes  # on first use (triton only for a launch)

        world = group_world(init, init.ds_process_group)
        chunk, _ = staging_chunk_bytes(torch.device(init.local_device), world.size, options)
        options = STATE.init(init).options = dataclasses.replace(options, chunk_bytes=chunk)
    return options


def group_world(init, group) -> World:
    """The World of ``group``, once per Init and group (each query of torch.distributed costs tens of
    microseconds, and every module's end asks)."""
    worlds = STATE.init(init).worlds
    world = worlds.get(id(group))
    if world is None or world.group is not group:
        world = worlds[id(group)] = world_of(group, required=True)
    return world


def partition_home(init) -> torch.device:
    return torch.device("cpu") if offload_device(init) == "cpu" else torch.device(init.local_device)


def count_progress(state: InitState, params: int, nbytes: int) -> None:
    """An INFO line each time another 16 GiB of parameters has been partitioned: long loads show life."""
    before = state.done_bytes
    state.done_bytes += nbytes
    state.done_params += params
    if state.done_bytes // PROGRESS_EVERY_BYTES > before // PROGRESS_EVERY_BYTES:
        logger.info("ztriton zero.Init: %s of parameters partitioned so far (%d params)",
                    format_bytes(state.done_bytes), state.done_params)
