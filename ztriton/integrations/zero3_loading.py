"""``load_checkpoint``: a module's ZeRO-3 partitions (and its other tensors) filled from a checkpoint.

Each ZeRO-3 parameter (from ``deepspeed.zero.Init`` or ``ztriton.partition``: it carries
``ds_tensor``, ``ds_shape``, ``ds_process_group``) receives its rank's flat window
``[rank * ps, rank * ps + ps)`` of the checkpoint tensor straight into ``ds_tensor``; every other
parameter and persistent buffer is loaded whole. Nothing is gathered and no collective runs: each
rank reads its own bytes (see :mod:`ztriton.loading`). This is the one loading module that reads
DeepSpeed's parameter attributes.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

import torch
import torch.distributed as dist

from ztriton.comm import world_of
from ztriton.loading import (DEFAULT_THREADS, Checkpoint, CheckpointError, Concat, Key, LoadReport, Source, Stack,
                             Target, check_options, leaf_keys, load_into)

__all__ = ["load_checkpoint", "module_targets", "tensor_target"]

logger = logging.getLogger("ztriton")


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_tensor") and hasattr(param, "ds_shape")


def _rank(param: torch.nn.Parameter, group) -> int:
    """This process's rank among the ranks that share ``param``'s partitions (DeepSpeed's
    ``Init._partition_rank``: the rank in ``param.ds_process_group``), unless ``group`` is given."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group if group is not None else getattr(param, "ds_process_group", None))


def tensor_target(name: str, tensor: torch.Tensor, source: Source, group=None) -> tuple[Target, torch.Tensor | None]:
    """The Target filling ``tensor`` on this rank: a ZeRO-3 param's rank partition, anything else whole. The
    second item, when not None, is a contiguous stand-in to copy into ``tensor`` once it is loaded."""
    if _is_zero3(tensor):
        return _zero3_target(name, tensor, source, group), None
    return _whole_target(name, tensor, source)


def _zero3_target(name: str, param: torch.nn.Parameter, source: Source, group) -> Target:
    status = getattr(getattr(param, "ds_status", None), "name", "NOT_AVAILABLE")
    if status != "NOT_AVAILABLE":
        raise CheckpointError(f"parameter {name!r} is gathered (ds_status {status}); load outside "
                              "GatheredParameters, when every parameter is partitioned")
    partition = param.ds_tensor
    size = getattr(partition, "ds_numel", partition.numel())
    if partition.numel() != size:
        raise CheckpointError(f"parameter {name!r}: its partition holds {partition.numel()} elements here but "
                              f"ds_numel says {size} (offloaded to NVMe?); only resident partitions can be loaded")
    return Target(name, source, tuple(param.ds_shape), partition, start=_rank(param, group) * size)


def _whole_target(name: str, tensor: torch.Tensor, source: Source) -> tuple[Target, torch.Tensor | None]:
    """A target for a tensor loaded whole; for a non-contiguous one, a contiguous stand-in to copy back."""
    data = tensor.detach()
    if data.is_contiguous():
        return Target(name, source, tuple(data.shape), data.view(-1)), None
    stand_in = torch.empty(data.numel(), dtype=data.dtype, device=data.device)
    return Target(name, source, tuple(data.shape), stand_in), stand_in


def _persistent_buffers(module: torch.nn.Module):
    """(name, buffer) of every persistent buffer, as ``state_dict`` would name them."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _check_sources(sources: object) -> dict[str, Source]:
    """``sources`` as a dict, refused (naming it) unless it maps param names to Key/Stack/Concat."""
    if sources is None:
        return {}
    if not isinstance(sources, Mapping):
        raise TypeError(f"sources must be a mapping of parameter name -> Key, Stack or Concat (or None), got "
                        f"{type(sources).__name__}")
    for name, source in sources.items():
        if not isinstance(name, str):
            raise TypeError(f"sources keys must be parameter names (str), got {name!r} ({type(name).__name__})")
        if not isinstance(source, (Key, Stack, Concat)):
            raise TypeError(f"sources[{name!r}] must be a ztriton.loading Key, Stack or Concat, got "
                            f"{type(source).__name__}")
    return dict(sources)


def module_targets(module: torch.nn.Module, checkpoint: Checkpoint, group=None,
                   sources: Mapping[str, Source] | None = None):
    """The module's targets (one per tensor object: tied names share one), its missing keys, and the
    stand-ins of non-contiguous tensors to copy back after the load."""
    sources = _check_sources(sources)
    named: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *_persistent_buffers(module)]:
        named.setdefault(id(tensor), []).append((name, tensor))
    unknown = sorted(set(sources) - {name for names in named.values() for name, _ in names})
    if unknown:
        raise CheckpointError(f"sources name {unknown[:5]} which are not parameters or persistent buffers of the "
                              f"module (e.g. {sorted(n for ns in named.values() for n, _ in ns)[:5]})")
    targets, missing, stand_ins = [], [], []
    for names in named.values():
        # Of tied names, the first whose source the checkpoint holds loads the tensor. A source the
        # checkpoint holds only part of is no missing key but a mismatch: its target goes on to the
        # checks, which name the absent tensor.
        held = [(n, t, [k in checkpoint for k in leaf_keys(sources.get(n, Key(n)))]) for n, t in names]
        ready = [(n, t) for n, t, present in held if all(present)]
        ready = ready or [(n, t) for n, t, present in held if any(present)]
        if not ready:
            missing.extend(n for n, _ in names)
            continue
        name, tensor = ready[0]
        source = sources.get(name, Key(name))
        target, stand_in = tensor_target(name, tensor, source, group)
        targets.append(target)
        if stand_in is not None:
            stand_ins.append((tensor, stand_in))
    return targets, missing, stand_ins


def load_checkpoint(module: torch.nn.Module, checkpoint: Checkpoint | str | os.PathLike, group=None, *,
                    sources: Mapping[str, Source] | None = None, strict: bool = False, progress: bool = True,
                    staging_bytes: int | None = None, threads: int = DEFAULT_THREADS) -> LoadReport:
    """Fill ``module``'s tensors from a safetensors checkpoint, each rank reading only its own slices.

    ``checkpoint``: a ``.safetensors`` file, a directory, or a ``*.safetensors.index.json``.
    ``group``: the group whose rank picks each ZeRO-3 partition (default: each param's
    ``ds_process_group``, as DeepSpeed partitioned it). ``sources``: how a param is built from
    checkpoint tensors (``Stack``/``Concat`` of ``Key``), by param name; default ``Key(name)``.
    ``strict``: missing or unexpected keys raise (before anything is written). ``progress``: a
    tqdm bar over bytes, on rank 0 only. ``staging_bytes`` (default 64 MiB) and ``threads`` (reader
    threads, default 2): see :func:`~ztriton.loading.load_into`. Returns a
    :class:`~ztriton.loading.LoadReport`; every problem with the checkpoint raises
    :class:`~ztriton.loading.CheckpointError` first.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    # Every argument is checked before the checkpoint is opened.
    check_options(staging_bytes=staging_bytes, threads=threads, progress=progress)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    sources = _check_sources(sources)
    if group is not None:
        world_of(group)  # a ProcessGroup this process belongs to, in an initialised world
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint(checkpoint)
    targets, missing, stand_ins = module_targets(module, checkpoint, group, sources)
    used = {key for target in targets for key in leaf_keys(target.source)}
    unexpected = [key for key in checkpoint.keys() if key not in used]
    if strict and (missing or unexpected):
        raise CheckpointError(f"strict load from {checkpoint.path}: missing keys {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''} ({len(missing)}), unexpected keys "
                              f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} ({len(unexpected)}); "
                              "nothing was written")
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    report = load_into(targets, checkpoint, staging_bytes=staging_bytes, threads=threads, progress=show)
    with torch.no_grad():
        for tensor, stand_in in stand_ins:
            tensor.copy_(stand_in.view(tensor.shape))
    report.missing_keys = missing
    report.unexpected_keys = unexpected
    if missing:
        logger.info("ztriton load_checkpoint: %d tensors not in %s (left as they were): %s", len(missing),
                    checkpoint.path, missing[:10])
    return report
