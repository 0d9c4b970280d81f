"""The only module that touches DeepSpeed internals.

Today it holds the ZeRO-3 parameter adapter that :mod:`ztriton.partition` uses: turn a torch
Parameter into a DeepSpeed ZeRO-3 parameter (``ds_*`` attributes and the ``all_gather`` /
``partition`` methods, exactly as ``zero.Init`` installs them) and hand it a partition that ztriton
filled, without DeepSpeed's own broadcast and slicing. It also sets up DeepSpeed's communication on
an existing torch.distributed world (:func:`deepspeed_world`, :func:`simulated_world`), which the
demo and the tests use to play any rank of a world on torch's fake process group. The
``"partition_backend"`` config key (issue 6) will live here too.
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import sys
from typing import Any, Iterator

import torch

# Config used when the caller gives none: ZeRO stage 3 with DeepSpeed's defaults. Only the
# partitioning machinery is used from it (process group, remote device, persistence thresholds).
DEFAULT_ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def is_zero3_param(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed already converted (``zero.Init`` or an earlier ``partition``)."""
    return hasattr(param, "ds_id")


def zero3_context(group, remote_device: str | None, pin_memory: bool, config: dict[str, Any] | None):
    """A ``deepspeed.zero.Init`` object that is never entered: it only converts parameters.

    Entering it would patch module constructors; constructing it only reads the config and the
    process group, which the converted parameters' methods then use.
    """
    import deepspeed

    return deepspeed.zero.Init(module=None, data_parallel_group=group, remote_device=remote_device,
                               pin_memory=pin_memory, config_dict_or_path=config or DEFAULT_ZERO3_CONFIG)


def local_device(context) -> torch.device:
    """The device a gathered parameter lives on (``zero.Init``'s ``local_device``)."""
    return torch.device(context.local_device)


def convert(context, param: torch.nn.Parameter) -> None:
    """Give ``param`` the attributes and methods of a ZeRO-3 parameter, still unpartitioned."""
    context._convert_to_deepspeed_param(param)


def install_partition(param: torch.nn.Parameter, ds_tensor: torch.Tensor, aligned_numel: int,
                      placeholder_device: torch.device) -> None:
    """Make ``ds_tensor`` (this rank's slice, a view of a per-rank buffer) the param's partition and
    free the full tensor, leaving the state ``Init._partition_param`` leaves after a first partition."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

    ds_tensor.requires_grad = False
    param.ds_tensor = ds_tensor
    ds_tensor.ds_numel = ds_tensor.numel()
    ds_tensor.status = PartitionedParamStatus.AVAILABLE
    ds_tensor.final_location = None
    param.ds_numel_aligned = aligned_numel
    # param.data holds nothing in the partitioned state; DeepSpeed gathers onto its device.
    param.data = torch.empty(0, dtype=param.dtype, device=placeholder_device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def unsupported_reason(context) -> str | None:
    """A DeepSpeed mode whose partitions ztriton does not build, named; None if none is on."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    if context.remote_device == OffloadDeviceEnum.nvme:
        return "NVMe parameter offload (offload_param.device='nvme')"
    if getattr(context, "quantized_weights", False) or getattr(context, "quantized_nontrainable_weights", False):
        return "quantized weights (zero_quantized_weights / zero_quantized_nontrainable_weights)"
    if getattr(context, "num_ranks_in_param_group", 1) != getattr(context, "dp_world_size", 1) and \
            getattr(context, "zero_param_process_group", None) is not None:
        return "hpZ secondary partitions (zero_hpz_partition_size > 1)"
    return None


# --------------------------------------------------------------------------------------------
# Worlds: torch.distributed plus DeepSpeed's wrapper of it, set up and torn down cleanly.


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration, then restore the previous values (or absence)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def _no_shm_comm() -> Iterator[None]:
    """Keep DeepSpeed from JIT-building its shared-memory comm op when it wraps torch.distributed.

    ``deepspeed.comm.torch.TorchBackend.__init__`` builds ``deepspeed_shm_comm`` on the CPU accelerator
    (about 45 s with a cold cache); the op only serves ``inference_all_reduce``. ``import
    deepspeed.comm.torch as m`` would bind the *torch* package (``deepspeed.comm`` re-exports it),
    hence ``sys.modules``.
    """
    importlib.import_module("deepspeed.comm.torch")
    module = sys.modules["deepspeed.comm.torch"]
    saved = module.build_shm_op
    module.build_shm_op = lambda: None
    try:
        yield
    finally:
        module.build_shm_op = saved


def _reset_deepspeed_comm() -> None:
    """Forget DeepSpeed's wrapper of torch.distributed, so the next world gets a fresh one.

    ``deepspeed.comm.destroy_process_group`` destroys torch's groups and releases DeepSpeed's group
    caches, but keeps ``cdb``, a ``TorchBackend`` bound to the old world.
    """
    importlib.import_module("deepspeed.comm.comm").cdb = None


def teardown_world() -> None:
    """Destroy whatever world is initialised (torch.distributed and DeepSpeed's wrapper of it)."""
    comm = importlib.import_module("deepspeed.comm.comm")
    try:
        if torch.distributed.is_initialized():
            if comm.cdb is not None:
                comm.destroy_process_group()
            else:
                torch.distributed.destroy_process_group()
    finally:
        _reset_deepspeed_comm()


def rank_environment(world_size: int, rank: int, local_rank: int, port: int, master: str = "127.0.0.1") -> dict[str, str]:
    """What DeepSpeed's launcher would set for one rank (``zero.Init`` reads LOCAL_RANK unconditionally)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master, "MASTER_PORT": str(port)}


@contextlib.contextmanager
def deepspeed_world(backend: str, store: torch.distributed.Store, world_size: int, rank: int,
                    env: dict[str, str]) -> Iterator[None]:
    """Initialise torch.distributed on ``store``, hand it to DeepSpeed, tear both down afterwards.

    ``env`` (see :func:`rank_environment`) is set for the duration.
    """
    if torch.distributed.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; worlds do not nest")
    with environment(env), _no_shm_comm():
        import deepspeed.comm

        _reset_deepspeed_comm()
        try:
            torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                                 timeout=datetime.timedelta(seconds=120))
            # DeepSpeed sees an initialised torch.distributed and only wraps it.
            deepspeed.comm.init_distributed(dist_backend=backend, verbose=False)
            yield
        finally:
            teardown_world()


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int, extra_env: dict[str, str] | None = None) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` on torch's fake process group, DeepSpeed included.

    Collectives return at once without moving data (a broadcast leaves the local tensor as it is):
    enough for everything whose layout depends on the rank, not for values that travel. This process
    drives one device whatever rank it plays (LOCAL_RANK 0).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {**rank_environment(world_size, rank, local_rank=0, port=29500), **(extra_env or {})}
    with deepspeed_world("fake", FakeStore(), world_size, rank, env):
        yield
