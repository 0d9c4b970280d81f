"""What the installed DeepSpeed itself produces, read back as plain data for conformance tests.

* :func:`zero3_reference`: build a module under ``deepspeed.zero.Init`` (or partition an existing one
  with ``zero.Init(module=...)``) and read every parameter's ZeRO-3 attributes and ``ds_tensor``.
* :func:`zero12_reference`: build a ZeRO-1/2 engine with ``deepspeed.initialize`` and read the
  optimizer's flat groups (``bit16_groups_flat``, ``round_robin_bit16_*``, rank partitions, aliasing).

Both run in the distributed world that is current when they are called (e.g. a rank of
:func:`worlds.run_world`), or, when there is none, enter a :func:`worlds.fake_world` of their own for
the duration. Results are frozen dataclasses of ints, tuples and CPU copies of tensors, so they pickle
back from spawned ranks and outlive the engine.

Parameter values are arbitrary bit patterns from :func:`bits_tensor` (NaNs and infinities included),
so a value check is a check that bytes land where the layout says, compared with :func:`bits`.

A ZeRO-1/2 group DeepSpeed cannot build is not compared (:func:`zero12_reference` says which): a DeepSpeed
without ``zero_optimization.parameter_alignment`` has no aligned layout (the test is skipped, naming it), and
one whose optimizer keeps trainable empty params in its groups (its set-up mostly fails on them; ztriton's
layout leaves them out, as later releases do) is not asked about them (that drawn example is rejected; outside
Hypothesis, skipped).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from factories import random_bits
from ztriton.testing import bits, fake_world

__all__ = [
    "bits",
    "bits_tensor",
    "BitsModule",
    "deepspeed_defragment",
    "gloo_safe_gathers",
    "Zero3Param",
    "zero3_reference",
    "Zero12Group",
    "zero12_reference",
    "dtype_config",
    "has_parameter_alignment",
    "keeps_empty_params_in_groups",
]

_SALT_PER_RANK = 7919


def bits_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int, index: int = 0) -> torch.Tensor:
    """A deterministic tensor of arbitrary bit patterns, the same on every rank and in every process.

    Random bytes rather than a numeric formula, so that every element is distinct with high probability
    (an off-by-one slice shows) and the check needs no float arithmetic in bf16/fp16.
    """
    return random_bits(shape, dtype, torch.Generator().manual_seed(seed * 1_000_003 + index))


class BitsModule(torch.nn.Module):
    """Parameters ``p0, p1, ...`` of the given shapes holding :func:`bits_tensor` values.

    The values are written inside ``__init__``, i.e. before ``zero.Init`` partitions the module, and
    in whatever dtype the parameter was created in (``dtype=None``: the default dtype, which
    ``zero.Init`` overrides with its own). Parameter ``i`` holds ``bits_tensor(shape, dtype, seed, i)``.
    ``frozen`` lists indices created with ``requires_grad=False``. ``rank_salt`` adds the global rank to
    the seed, so ranks start from different values (the expected values are then rank 0's, the source
    of DeepSpeed's broadcasts).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], seed: int = 0, dtype: torch.dtype | None = None,
                 frozen: Sequence[int] = (), rank_salt: bool = False):
        super().__init__()
        if rank_salt:
            seed += _SALT_PER_RANK * torch.distributed.get_rank()
        for index, shape in enumerate(shapes):
            param = torch.nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=index not in frozen)
            with torch.no_grad():
                values = bits_tensor(shape, param.dtype, seed, index)
                bits(param.data).copy_(bits(values))  # a view of param's storage: writes through
            self.register_parameter(f"p{index}", param)


def dtype_config(dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config section that makes ``dtype`` the model dtype (fp32: none)."""
    if dtype == torch.bfloat16:
        return {"bf16": {"enabled": True}}
    if dtype == torch.float16:
        return {"fp16": {"enabled": True}}
    if dtype == torch.float32:
        return {}
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")


@contextlib.contextmanager
def _world(world_size: int, rank: int) -> Iterator[None]:
    """The current world if there is one (it must match), else a fake one for the duration."""
    if not torch.distributed.is_initialized():
        with fake_world(world_size, rank):
            yield
        return
    current = (torch.distributed.get_world_size(), torch.distributed.get_rank())
    if current != (world_size, rank):
        raise ValueError(f"current world is (world_size, rank)={current}, asked for {(world_size, rank)}")
    yield


@contextlib.contextmanager
def _fp16_allowed(dtype: torch.dtype) -> Iterator[None]:
    """Let the engine accept fp16 on a CPU without native fp16 (its check is for compute, not layout).

    ``DeepSpeedEngine._do_sanity_check`` raises "Type fp16 is not supported on your device" unless
    ``get_accelerator().is_fp16_supported()``, which on the CPU accelerator asks oneDNN for AVX512-FP16
    hardware. Nothing in the flatten computes in fp16.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if dtype != torch.float16 or accelerator.is_fp16_supported():
        yield
        return
    accelerator.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        del accelerator.is_fp16_supported  # back to the class's method


# ----------------------------------------------------------------------------------------------- ZeRO-3


def gloo_safe_gathers() -> dict[str, Any]:
    """``zero_optimization`` settings for gathering ZeRO-3 params on gloo. A DeepSpeed whose coalesced all-gather
    (``Init._allgather_params_coalesced``: ``GatheredParameters``, the re-gather of persistent params after each
    step) waits for its last handle only lets gloo's other gathers still be writing while it reads them, so now
    and then a param is read half-gathered (wrong values, nan losses, with or without the key); there, params
    are gathered one by one (``allgather_sequential``)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    source = inspect.getsource(inspect.unwrap(Init._allgather_params_coalesced))
    return {"allgather_sequential": True} if "launch_handles[-1].wait()" in source else {}


def deepspeed_defragment(tensors: list[torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's own stage-3 ``defragment`` (not the hook), wherever this DeepSpeed has it: a function of
    ``stage3`` (from ``zero.utils``), or a staticmethod of the stage-3 optimizer."""
    from deepspeed.runtime.zero import stage3

    own = getattr(stage3, "defragment", None) or stage3.DeepSpeedZeroOptimizer_Stage3.defragment
    return inspect.unwrap(own)(tensors)


@dataclass(frozen=True)
class Zero3Param:
    """One parameter after ``zero.Init`` on one rank.

    ``partition`` is a clone of the whole ``ds_tensor``: past the parameter's end DeepSpeed leaves it
    uninitialised, so compare only the valid prefix.
    """

    name: str
    ds_shape: tuple[int, ...]
    ds_numel: int
    ds_numel_aligned: int
    partition_numel: int  # ds_tensor.ds_numel
    partition: torch.Tensor  # ds_tensor
    data_numel: int  # param.data after partitioning: an empty placeholder
    status: str  # ds_status name
    requires_grad: bool


def zero3_reference(module_factory: Callable[[], torch.nn.Module], world_size: int, rank: int,
                    dtype: torch.dtype, *, wrap_existing: bool = False,
                    config: dict[str, Any] | None = None) -> list[Zero3Param]:
    """Partition ``module_factory()`` with DeepSpeed's ``zero.Init`` as rank ``rank`` of ``world_size``.

    By default the module is built inside ``with zero.Init(config)``, which creates floating tensors
    directly in ``dtype`` and partitions each submodule when its ``__init__`` returns; with
    ``wrap_existing`` it is built first and partitioned by ``zero.Init(module=...)`` (no dtype change).
    ``dtype`` goes through the config's bf16/fp16 section: ``zero.Init(dtype=...)`` is not usable, its
    ``dtype or fp16 if fp16 supported else bf16 ...`` picks bf16 for any dtype on a CPU without fp16.
    ``config`` entries are merged over the generated config.
    """
    import deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, **dtype_config(dtype)}
    ds_config.update(config or {})
    with _world(world_size, rank):
        if wrap_existing:
            module = module_factory()
            deepspeed.zero.Init(module=module, config_dict_or_path=ds_config)
        else:
            with deepspeed.zero.Init(config_dict_or_path=ds_config):
                module = module_factory()
        return [_zero3_param(name, param) for name, param in module.named_parameters()]


def _zero3_param(name: str, param: torch.nn.Parameter) -> Zero3Param:
    return Zero3Param(
        name=name,
        ds_shape=tuple(param.ds_shape),
        ds_numel=param.ds_numel,
        ds_numel_aligned=param.ds_numel_aligned,
        partition_numel=param.ds_tensor.ds_numel,
        partition=param.ds_tensor.detach().to("cpu", copy=True),
        data_numel=param.data.numel(),
        status=param.ds_status.name,
        requires_grad=param.requires_grad,
    )


# --------------------------------------------------------------------------------------------- ZeRO-1/2


@dataclass(frozen=True)
class Zero12Group:
    """One optimizer group of ``DeepSpeedZeroOptimizer`` on one rank, in terms of the params handed in.

    ``numels``/``trainable`` describe the group's params in the order given to the optimizer.
    ``order[k]`` is the index (into those) of the k-th param in the flat buffer, found by identity in
    ``round_robin_bit16_groups``; ``indices`` is DeepSpeed's ``round_robin_bit16_indices`` as a tuple
    (entry j: flat position of the j-th optimized param, i.e. the inverse of the round-robin order).
    ``aliases[i]`` is the element offset of param i's ``.data`` inside ``flat``, ``None`` if it does not
    share the flat buffer's storage. ``windows[r]`` is rank r's partition ``[start, end)`` of ``flat``.
    """

    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    order: tuple[int, ...]
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    paddings: tuple[int, ...]
    flat: torch.Tensor
    windows: tuple[tuple[int, int], ...]
    partition_numel: int
    aliases: tuple[int | None, ...]


def zero12_reference(model_factory: Callable[[], torch.nn.Module], world_size: int, rank: int, stage: int,
                     round_robin: bool, parameter_alignment: bool, dtype: torch.dtype,
                     param_groups_fn: Callable[[torch.nn.Module], list[dict]] | None = None,
                     config: dict[str, Any] | None = None) -> list[Zero12Group]:
    """Build a ZeRO ``stage`` (1 or 2) engine on ``model_factory()`` and read its flat groups.

    ``param_groups_fn(model)`` gives the optimizer's param groups (torch's list of dicts; default: one
    group of all params). The optimizer is a plain ``torch.optim.SGD`` (no JIT build), accepted with
    ``zero_allow_untested_optimizer``. The model should already be in ``dtype`` (the engine's
    ``.half()``/``.bfloat16()`` is then a no-op). Groups without params are dropped by the engine and
    absent here; a group whose params are all frozen or empty makes DeepSpeed fail (it reads the dtype
    of the group's first optimized param).
    """
    import deepspeed

    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    zero_section = {"stage": stage, "round_robin_gradients": round_robin}
    if parameter_alignment:
        _require_parameter_alignment()
    if has_parameter_alignment():  # a DeepSpeed without it refuses the key (its section forbids unknown keys)
        zero_section["parameter_alignment"] = parameter_alignment
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero_section,
        **dtype_config(dtype),
    }
    ds_config.update(config or {})
    with _world(world_size, rank), _fp16_allowed(dtype):
        model = model_factory()
        groups = param_groups_fn(model) if param_groups_fn else [{"params": list(model.parameters())}]
        # Snapshot before the engine rewrites param_groups[i]["params"] to the fp32 partition.
        members = [list(group["params"]) for group in groups if len(group["params"])]
        _require_buildable(members)
        optimizer = torch.optim.SGD(groups, lr=1e-3)
        engine, zero_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        try:
            return [_zero12_group(zero_optimizer, i, params) for i, params in enumerate(members)]
        finally:
            engine.destroy()


def has_parameter_alignment() -> bool:
    """Whether the installed DeepSpeed's ZeRO config has ``parameter_alignment`` (16-byte pads between params)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return "parameter_alignment" in DeepSpeedZeroConfig.model_fields


def keeps_empty_params_in_groups() -> bool:
    """Whether the installed DeepSpeed's ZeRO-1/2 optimizer keeps trainable empty params in its groups (where one
    lies inside a rank's partition its ``get_hp_fragment_mapping`` then fails); one that asks
    ``is_optimized_parameter`` leaves them out."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return "is_optimized_parameter" not in inspect.unwrap(DeepSpeedZeroOptimizer.__init__).__code__.co_names


def _require_parameter_alignment() -> None:
    import deepspeed
    import pytest

    if not has_parameter_alignment():
        pytest.skip(f"DeepSpeed {deepspeed.__version__} has no zero_optimization.parameter_alignment: no aligned "
                    "layout to compare with")


def _require_buildable(members: list[list[torch.nn.Parameter]]) -> None:
    """A group with a trainable empty param is not compared on a DeepSpeed that keeps such params in its groups."""
    if not any(p.requires_grad and p.numel() == 0 for group in members for p in group):
        return
    if not keeps_empty_params_in_groups():
        return
    import deepspeed
    import pytest
    from hypothesis import reject
    from hypothesis.control import currently_in_test_context

    if currently_in_test_context():
        reject()
    pytest.skip(f"DeepSpeed {deepspeed.__version__}'s ZeRO-1/2 optimizer keeps a trainable empty param in its group")


def _zero12_group(zero_optimizer: Any, i: int, params: list[torch.nn.Parameter]) -> Zero12Group:
    flat = zero_optimizer.bit16_groups_flat[i]
    position = {id(param): index for index, param in enumerate(params)}
    indices = zero_optimizer.round_robin_bit16_indices[i]
    if isinstance(indices, dict):  # round robin: {optimized index: flat position}
        indices = [indices[j] for j in range(len(indices))]
    offsets, paddings = _offsets_and_paddings(zero_optimizer, i, flat)
    return Zero12Group(
        numels=tuple(param.numel() for param in params),
        trainable=tuple(param.requires_grad for param in params),
        order=tuple(position[id(param)] for param in zero_optimizer.round_robin_bit16_groups[i]),
        indices=tuple(indices),
        offsets=offsets,
        paddings=paddings,
        flat=flat.detach().to("cpu", copy=True),
        windows=tuple(_window(flat, part) for part in zero_optimizer.parallel_partitioned_bit16_groups[i]),
        partition_numel=zero_optimizer.partition_size[i],
        aliases=tuple(_alias_offset(flat, param) for param in params),
    )


def _offsets_and_paddings(zero_optimizer: Any, i: int, flat: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DeepSpeed's record of group ``i``'s offsets and pads where it keeps one; else where each param's ``.data``
    lies in the flat buffer, each pad being the gap to the next param (none after the last)."""
    if hasattr(zero_optimizer, "round_robin_bit16_offsets"):
        return tuple(zero_optimizer.round_robin_bit16_offsets[i]), tuple(zero_optimizer.round_robin_bit16_padding[i])
    params = zero_optimizer.round_robin_bit16_groups[i]
    offsets = tuple(_alias_offset(flat, param) for param in params)
    assert None not in offsets, "a param of the group that is not a view of its flat buffer"
    ends = [offset + param.numel() for offset, param in zip(offsets, params)]
    return offsets, tuple(start - end for start, end in zip(offsets[1:], ends)) + (0,)


def _window(flat: torch.Tensor, part: torch.Tensor) -> tuple[int, int]:
    start = _alias_offset(flat, part)
    assert start is not None, "a rank partition that is not a view of the flat buffer"
    return start, start + part.numel()


def _alias_offset(flat: torch.Tensor, tensor: torch.Tensor) -> int | None:
    """Element offset of ``tensor`` inside ``flat`` if it is a view of the same storage, else None."""
    data = tensor.data
    if data.numel() == 0 or data.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
        return None
    return data.storage_offset() - flat.storage_offset()


def groups_of(model: torch.nn.Module, sizes: Sequence[int]) -> list[dict]:
    """Optimizer param groups: consecutive runs of ``sizes`` params (module level, so it pickles)."""
    params, groups = list(model.parameters()), []
    for i, size in enumerate(sizes):
        start = sum(sizes[:i])
        groups.append({"params": params[start:start + size], "lr": 1e-3 * (i + 1)})
    return groups
