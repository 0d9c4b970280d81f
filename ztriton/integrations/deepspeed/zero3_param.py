"""ZeRO-3 parameters: partitions that :mod:`ztriton.partitioning` filled, made into DeepSpeed parameters.

A torch Parameter gets the ``ds_*`` attributes and the ``all_gather`` / ``partition`` methods exactly
as ``zero.Init`` installs them, and its partition (``ds_tensor``) becomes the one ztriton filled,
without DeepSpeed's own broadcast and slicing. :func:`partition` is ``ztriton.partition``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ztriton.comm import world_of
from ztriton.integrations.deepspeed import report
from ztriton.policy import Options

if TYPE_CHECKING:
    from ztriton.partitioning import Partitioned

__all__ = ["DEFAULT_ZERO3_CONFIG", "install_partitions", "is_zero3_param", "partition", "unsupported_reason",
           "zero3_context"]

# Config used when the caller gives none: ZeRO stage 3 with DeepSpeed's defaults. Only the
# partitioning machinery is used from it (process group, remote device, persistence thresholds).
DEFAULT_ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def partition(module: torch.nn.Module, group: dist.ProcessGroup | None = None, *, remote_device: str | None = None,
              pin_memory: bool = True, chunk_bytes: int | None = None, headroom_bytes: int | None = None,
              config: dict | str | os.PathLike | None = None) -> Partitioned:
    """Partition every not-yet-partitioned parameter of ``module`` over ``group`` as ZeRO-3 does.

    Afterwards ``deepspeed.zero.GatheredParameters(list(module.parameters()))`` gives back the full
    tensors and ``deepspeed.initialize(model=module, config=<stage 3>)`` accepts the module.

    Args:
        group: the partition group (default: the whole world). torch.distributed must be initialised.
        remote_device: ``"cpu"`` keeps partitions in host memory (pinned if ``pin_memory`` and CUDA is
            present), as DeepSpeed's ``offload_param``; default: the accelerator.
        chunk_bytes: staging chunk size; default: the policy's pick from free device memory.
        headroom_bytes: device memory the policy leaves free (default 1 GiB).
        config: a DeepSpeed config (a dict, or the path of a JSON file, as ``deepspeed.zero.Init``'s
            ``config_dict_or_path``) for the ZeRO-3 machinery (default: stage 3, its defaults).

    On any error before the partitions are installed, the parameters are left as they were.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    config = _checked_config(config)
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be a bool, got {type(pin_memory).__name__}")
    if remote_device not in (None, "cpu"):
        raise ValueError(f"remote_device must be None (the accelerator) or 'cpu', got {remote_device!r}; "
                         "for NVMe offload use deepspeed.zero.Init")
    world = world_of(group, required=True)
    options = Options.of(headroom_bytes=headroom_bytes, chunk_bytes=chunk_bytes)
    everything = list(module.named_parameters())
    named = [(n, p) for n, p in everything if not is_zero3_param(p)]
    if everything and not named:
        raise ValueError(f"ztriton.partition: every parameter of this {type(module).__name__} ({len(everything)}) is "
                         "already a ZeRO-3 parameter (an earlier ztriton.partition or deepspeed.zero.Init); "
                         "partition a module once and pass it on to deepspeed.initialize (a module to which new "
                         "parameters were added since is fine: only those are partitioned)")
    context = zero3_context(group, remote_device, pin_memory, config)
    reason = unsupported_reason(context)
    if reason is not None:
        raise NotImplementedError(f"ztriton.partition does not build partitions for {reason}; "
                                  "use deepspeed.zero.Init for this mode")
    from ztriton.partitioning import partition_params  # on first use (triton only for a launch)

    local = torch.device(context.local_device)
    result, seconds, peak = report.timed(lambda: partition_params(
        named, world, home=torch.device("cpu") if remote_device == "cpu" else local, probe_device=local,
        pin_memory=pin_memory, options=options))
    install_partitions(context, result)
    report.step_summary("ztriton.partition", tier=result.path.value,
                        nbytes=sum(b.numel() * b.element_size() for b in result.buffers.values()),
                        seconds=seconds, peak_bytes=peak, params=len(named),
                        partitions_on=remote_device or local.type)
    return result


def install_partitions(context, result: Partitioned) -> None:
    """Make every partition of ``result`` its parameter's ``ds_tensor``, converting the parameter with
    ``context``'s (a ``zero.Init`` object's) process group and devices. Only now do parameters change."""
    local = torch.device(context.local_device)
    for part in result.partitions:
        context._convert_to_deepspeed_param(part.param)
        _install_partition(part.param, part.data, part.aligned_numel, local)


def is_zero3_param(param: torch.Tensor) -> bool:
    """True for a parameter DeepSpeed already converted (``zero.Init`` or an earlier ``partition``)."""
    return hasattr(param, "ds_id")


def _checked_config(config: object) -> dict[str, Any] | str | None:
    """``config`` as ``zero.Init``'s ``config_dict_or_path`` takes it (``DeepSpeedConfig``: a dict, or
    a path or base64 string of JSON; a path object made a str, which DeepSpeed does not accept); any
    other type would fail somewhere inside DeepSpeed, unnamed."""
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if config is not None and not isinstance(config, (dict, str)):
        raise TypeError(f"config must be a DeepSpeed config dict, the path (str or os.PathLike) of a JSON config "
                        f"file, or None (ZeRO stage 3 with DeepSpeed's defaults), got {type(config).__name__}")
    return config


def _read_config(config: dict[str, Any] | str | os.PathLike):
    """Parse ``config`` as ``zero.Init`` will, so that a config DeepSpeed cannot read is refused as
    ``config`` (DeepSpeed reports it with asserts and errors that do not say which argument)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(config)
    except (AssertionError, ValueError, TypeError, KeyError, OSError) as exc:
        raise ValueError(f"config: DeepSpeed cannot use this config ({type(exc).__name__}: {exc}); pass a ZeRO "
                         "stage 3 config dict (with train_micro_batch_size_per_gpu), the path of one, or None") \
            from exc


def zero3_context(group, remote_device: str | None, pin_memory: bool,
                  config: dict[str, Any] | str | os.PathLike | None):
    """A ``deepspeed.zero.Init`` object that is never entered: it only converts parameters.

    Entering it would patch module constructors; constructing it only reads the config and the
    process group, which the converted parameters' methods then use.
    """
    import deepspeed

    config = _checked_config(config)
    if config is None:
        config = DEFAULT_ZERO3_CONFIG
    else:
        _read_config(config)
    return deepspeed.zero.Init(module=None, data_parallel_group=group, remote_device=remote_device,
                               pin_memory=pin_memory, config_dict_or_path=config)


def _install_partition(param: torch.nn.Parameter, ds_tensor: torch.Tensor, aligned_numel: int,
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
    if getattr(context, "quantized_initialization", None):
        return "quantized initialization (weight_quantization.quantized_initialization)"
    return None
