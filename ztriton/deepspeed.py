"""The only module that touches DeepSpeed internals.

Today it holds the ZeRO-3 parameter adapter that :mod:`ztriton.partition` uses: turn a torch
Parameter into a DeepSpeed ZeRO-3 parameter (``ds_*`` attributes and the ``all_gather`` /
``partition`` methods, exactly as ``zero.Init`` installs them) and hand it a partition that ztriton
filled, without DeepSpeed's own broadcast and slicing. The ``"partition_backend"`` config key
(issue 6) will live here too.
"""
from __future__ import annotations

from typing import Any

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
