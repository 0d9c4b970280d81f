"""Which known variant of each DeepSpeed internal the installed DeepSpeed has, told by what it has (signatures,
attributes, the names its functions use), never by its version number.

:func:`detect` checks, at install and before anything is wrapped, every signature and attribute the hooks rely
on, and picks one small adapter per internal that differs between the DeepSpeed releases ztriton supports. An
internal that matches no known variant raises :class:`UnknownInternals`; :func:`~.install.install` then stands
aside (DeepSpeed runs as it is).

The variants known (first seen in 0.18.x / in 0.19.x):

* the ZeRO-1/2 init-time flatten: ``flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data)``, params
  end to end, DeepSpeed records no offsets (:func:`unpadded_flatten_call`); or ``..., param_padding=None)``
  with ``parameter_alignment`` pads between params, offsets and pads recorded in ``round_robin_bit16_offsets``
  / ``round_robin_bit16_padding`` (:func:`padded_flatten_call`);
* the stage-3 optimizer's ``defragment``: a staticmethod of ``DeepSpeedZeroOptimizer_Stage3`` (called as
  ``__class__.defragment``), or a function of ``deepspeed.runtime.zero.utils`` that ``stage3`` imports and calls;
* ``zero.Init._post_init_method``: ends with nothing more, or with ``self._keep_in_fp32(module)``
  (:func:`keep_nothing_in_fp32` / :func:`keep_in_fp32`);
* a parameter's ZeRO-3 partition group: always the Init's ``ds_process_group``, or the param's own
  ``ds_zero_partition_process_group`` where set (:func:`init_group` / :func:`param_group`).
"""
from __future__ import annotations

import dis
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["FlattenCall", "UnknownInternals", "Variants", "detect", "init_group", "keep_in_fp32",
           "keep_nothing_in_fp32", "padded_flatten_call", "param_group", "unpadded_flatten_call"]

# The ZeRO-3 partition group attribute DeepSpeed's engine sets on MoE expert params.
PARTITION_GROUP_ATTR = "ds_zero_partition_process_group"


class UnknownInternals(RuntimeError):
    """One of DeepSpeed's internals that a hook relies on is not one of the variants ztriton knows."""


@dataclass(frozen=True)
class FlattenCall:
    """The ZeRO-1/2 optimizer's init-time flatten of group ``index``, as ztriton needs it: the tensors in flat
    order, DeepSpeed's end alignment, whether params are padded to 16 bytes, and the offsets and pads
    DeepSpeed computed itself (None where this variant keeps none)."""

    index: int
    tensors: list
    alignment: int
    parameter_alignment: bool
    offsets: Sequence[int] | None
    paddings: Sequence[int] | None


@dataclass(frozen=True)
class Variants:
    """The adapters chosen for the installed DeepSpeed."""

    # (optimizer, args, kwargs of flatten_dense_tensors_aligned) -> the init-time call, or None for any other
    flatten_call: Callable[[Any, tuple, dict], FlattenCall | None]
    defragment_owner: Any  # the module or class whose attribute "defragment" the stage-3 optimizer calls
    defragment_static: bool  # it is a staticmethod of that class
    keep_in_fp32: Callable[[Any, Any], None]  # (init, module): what _post_init_method does after partitioning
    partition_group: Callable[[Any, Any], Any]  # (init, param) -> the group DeepSpeed partitions param over


# ------------------------------------------------------------------------------------------- adapters


def _bound(signature: inspect.Signature, optimizer, args: tuple, kwargs: dict) -> dict:
    bound = signature.bind(optimizer, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def padded_flatten_call(signature: inspect.Signature) -> Callable[[Any, tuple, dict], FlattenCall | None]:
    """The variant with ``param_padding``: only the init-time call passes it (``step()`` and checkpoint loading
    pass none); DeepSpeed recorded the group's offsets and pads just before."""

    def call(optimizer, args: tuple, kwargs: dict) -> FlattenCall | None:
        arguments = _bound(signature, optimizer, args, kwargs)
        if arguments["use_cpu_data"] or arguments["param_padding"] is None:
            return None
        index = len(optimizer.bit16_groups_flat)
        return FlattenCall(index, arguments["tensor_list"], arguments["alignment"], bool(optimizer.parameter_alignment),
                           optimizer.round_robin_bit16_offsets[index], optimizer.round_robin_bit16_padding[index])

    return call


def unpadded_flatten_call(signature: inspect.Signature) -> Callable[[Any, tuple, dict], FlattenCall | None]:
    """The variant without ``param_padding``: params lie end to end; the init-time call is the one that flattens
    the group being built (``round_robin_bit16_groups[index]`` itself), from the device."""

    def call(optimizer, args: tuple, kwargs: dict) -> FlattenCall | None:
        arguments = _bound(signature, optimizer, args, kwargs)
        index = len(optimizer.bit16_groups_flat)
        groups = optimizer.round_robin_bit16_groups
        if arguments["use_cpu_data"] or index >= len(groups) or arguments["tensor_list"] is not groups[index]:
            return None
        return FlattenCall(index, arguments["tensor_list"], arguments["alignment"], False, None, None)

    return call


def keep_in_fp32(init, module) -> None:
    """``_post_init_method`` ends by putting the module's fp32 buffers back in fp32."""
    init._keep_in_fp32(module)


def keep_nothing_in_fp32(init, module) -> None:
    """``_post_init_method`` ends with the partitioning."""


def param_group(init, param):
    """Each param is partitioned over its own ``ds_zero_partition_process_group`` where set (MoE experts)."""
    return getattr(param, PARTITION_GROUP_ATTR, init.ds_process_group)


def init_group(init, param):
    """Every param is partitioned over the Init's ``ds_process_group``."""
    return init.ds_process_group


# ------------------------------------------------------------------------------------------- detection


def detect() -> Variants:
    """Check every internal the hooks rely on and pick the adapters; raises :class:`UnknownInternals` naming the
    first internal that matches no known variant. Wraps nothing."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime import config as config_module
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import offload_config, partition_parameters, stage3, stage_1_and_2

    _check_config(config_module.DeepSpeedConfig)
    _check_engine(engine_module.DeepSpeedEngine)
    _check_zero_init(partition_parameters)
    _check_members(offload_config.OffloadDeviceEnum, "OffloadDeviceEnum", ("cpu", "nvme"))
    _check_function(type(get_accelerator()), "available_memory", None)
    owner, static = _defragment(stage3)
    init = partition_parameters.Init
    return Variants(flatten_call=_flatten_variant(stage_1_and_2.DeepSpeedZeroOptimizer), defragment_owner=owner,
                    defragment_static=static, keep_in_fp32=_keep_in_fp32_variant(init),
                    partition_group=_partition_group_variant(init))


def _check_config(config_class) -> None:
    _check_function(config_class, "__init__", ("self", "config"), prefix=True)
    _check_stores(config_class, ("_param_dict",))


def _check_engine(engine_class) -> None:
    _check_function(engine_class, "_configure_zero_optimizer", ("self", "optimizer"))
    _check_function(engine_class, "_do_sanity_check", ("self",))
    _check_function(engine_class, "zero_optimization_stage", ("self",))
    _check_stores(engine_class, ("_config", "device"))


def _check_zero_init(module) -> None:
    init = module.Init
    _check_function(init, "__init__", None, having=("config", "config_dict_or_path"))
    _check_function(init, "_post_init_method", ("self", "module"))
    _check_function(init, "_convert_to_zero_parameters", ("self", "param_list"))
    _check_function(init, "_convert_to_deepspeed_param", ("self", "param"))
    _check_function(init, "_add_tensor_creation_wrappers", ("self",))
    _check_function(init, "_remove_tensor_creation_wrappers", ("self",))
    _check_stores(init, ("remote_device", "local_device", "pin_memory", "ds_process_group", "dtype",
                         "tensor_overrides"))
    _check_members(module.InsertPostInitMethodToModuleSubClasses, "InsertPostInitMethodToModuleSubClasses",
                   ("num_module_parameters", "num_module_elements"))
    _check_members(module.DeepSpeedTensorOverride, "DeepSpeedTensorOverride", ("dtype", "device"))
    _check_members(module.PartitionedParamStatus, "PartitionedParamStatus", ("AVAILABLE",))
    _check_members(module.ZeroParamStatus, "ZeroParamStatus", ("NOT_AVAILABLE",))


_FLATTEN_PADDED = ("self", "tensor_list", "alignment", "use_cpu_data", "param_padding")
_FLATTEN_UNPADDED = ("self", "tensor_list", "alignment", "use_cpu_data")
_ZERO12_STORES = ("bit16_groups_flat", "real_dp_process_group", "round_robin_bit16_groups")
_ZERO12_PADDED_STORES = ("parameter_alignment", "round_robin_bit16_offsets", "round_robin_bit16_padding")


def _flatten_variant(optimizer_class) -> Callable[[Any, tuple, dict], FlattenCall | None]:
    """By ``flatten_dense_tensors_aligned``'s parameters; the padded variant needs the optimizer's
    ``parameter_alignment`` and its record of offsets and pads, the unpadded one must have neither."""
    _check_function(optimizer_class, "__init__", None)
    signature = _check_function(optimizer_class, "flatten_dense_tensors_aligned", None)
    names = tuple(signature.parameters)
    _check_stores(optimizer_class, _ZERO12_STORES)
    stores = _stores(optimizer_class, _ZERO12_PADDED_STORES)
    if names == _FLATTEN_PADDED and stores.issuperset(_ZERO12_PADDED_STORES):
        return padded_flatten_call(signature)
    if names == _FLATTEN_UNPADDED and not stores.intersection(_ZERO12_PADDED_STORES):
        return unpadded_flatten_call(signature)
    raise UnknownInternals(f"DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned{signature} with "
                           f"{sorted(stores.intersection(_ZERO12_PADDED_STORES))} of {list(_ZERO12_PADDED_STORES)} is "
                           "neither known variant")


def _defragment(stage3) -> tuple[Any, bool]:
    """Where the stage-3 optimizer's ``defragment`` lives: a function of ``stage3``'s namespace that its
    ``_create_fp16_partitions_with_defragmentation`` calls, or a staticmethod of the optimizer class; exactly one."""
    optimizer_class = stage3.DeepSpeedZeroOptimizer_Stage3
    in_module = inspect.isfunction(getattr(stage3, "defragment", None))
    in_class = isinstance(vars(optimizer_class).get("defragment"), staticmethod)
    if in_module == in_class:
        raise UnknownInternals("the stage-3 optimizer's defragment is "
                               + ("both a function of stage3 and a staticmethod of DeepSpeedZeroOptimizer_Stage3"
                                  if in_module else "neither a function of stage3 nor a staticmethod of "
                                  "DeepSpeedZeroOptimizer_Stage3"))
    _check_function(optimizer_class, "_create_fp16_partitions_with_defragmentation", None)
    calls = _loads(getattr(optimizer_class, "_create_fp16_partitions_with_defragmentation"))
    wanted = "LOAD_GLOBAL" if in_module else "LOAD_ATTR"
    if wanted not in calls.get("defragment", ()):
        raise UnknownInternals("DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation does not "
                               f"call defragment as {'stage3.defragment' if in_module else '__class__.defragment'}")
    owner = stage3 if in_module else optimizer_class
    _check_function(owner, "defragment", ("tensors",))
    return owner, in_class


def _keep_in_fp32_variant(init_class) -> Callable[[Any, Any], None]:
    calls = "_keep_in_fp32" in _code(init_class._post_init_method).co_names
    if calls != hasattr(init_class, "_keep_in_fp32"):
        raise UnknownInternals("Init._post_init_method and Init._keep_in_fp32 are not a known pair")
    if calls:
        _check_function(init_class, "_keep_in_fp32", ("self", "module"))
    return keep_in_fp32 if calls else keep_nothing_in_fp32


def _partition_group_variant(init_class) -> Callable[[Any, Any], Any]:
    """Whether ``_convert_to_deepspeed_param`` reads the param's own partition group; the Init then sizes each
    param's partition by that group (``_partition_world_size``)."""
    reads = PARTITION_GROUP_ATTR in _code(init_class._convert_to_deepspeed_param).co_consts
    if reads != hasattr(init_class, "_partition_world_size"):
        raise UnknownInternals(f"Init._convert_to_deepspeed_param {'reads' if reads else 'ignores'} "
                               f"{PARTITION_GROUP_ATTR} but Init {'lacks' if reads else 'has'} _partition_world_size")
    return param_group if reads else init_group


# ------------------------------------------------------------------------------------------- helpers


def _code(function):
    return inspect.unwrap(function).__code__


def _check_function(owner, name: str, parameters: tuple[str, ...] | None, *, prefix: bool = False,
                    having: tuple[str, ...] = ()) -> inspect.Signature:
    """``owner.name`` is a function whose parameters are ``parameters`` (their first ones with ``prefix``), or
    include ``having``; returns its signature."""
    where = f"{getattr(owner, '__name__', owner)}.{name}"
    function = getattr(owner, name, None)
    if not callable(function):
        raise UnknownInternals(f"{where} is missing")
    signature = inspect.signature(function)
    names = tuple(signature.parameters)
    if parameters is not None and (names[:len(parameters)] if prefix else names) != parameters:
        raise UnknownInternals(f"{where}{signature} does not take {parameters}")
    missing = [p for p in having if p not in names]
    if missing:
        raise UnknownInternals(f"{where}{signature} has no parameter {missing}")
    return signature


def _check_members(owner, where: str, names: tuple[str, ...]) -> None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise UnknownInternals(f"{where} has no {missing}")


def _check_stores(owner, names: tuple[str, ...]) -> None:
    """Some function of ``owner`` or its bases sets each of ``names`` as an attribute (instances hold them)."""
    missing = sorted(set(names) - _stores(owner, names))
    if missing:
        raise UnknownInternals(f"{owner.__name__} never sets {missing}")


def _stores(owner, names: tuple[str, ...]) -> set[str]:
    """Those of ``names`` that a function defined by ``owner`` or its bases assigns as an attribute."""
    wanted, found = set(names), set()
    for klass in owner.__mro__[:-1]:
        for member in vars(klass).values():
            function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if inspect.isfunction(function):
                code = inspect.unwrap(function).__code__
                if wanted.intersection(code.co_names):
                    found.update(wanted.intersection(_assigned(code)))
    return found


_STORE_ATTR, _EXTENDED_ARG = dis.opmap["STORE_ATTR"], dis.EXTENDED_ARG


def _assigned(code) -> set[str]:
    """The attribute names ``code`` assigns: its ``STORE_ATTR`` instructions read straight from the bytecode
    (two bytes each; ``dis.get_instructions`` costs ~100x more over the hundreds of methods of a class)."""
    raw, names, extended = code.co_code, set(), 0
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | extended
        extended = arg << 8 if op == _EXTENDED_ARG else 0
        if op == _STORE_ATTR:
            names.add(code.co_names[arg])
    return names


def _loads(function) -> dict[str, set[str]]:
    """name -> how ``function`` loads it: ``LOAD_GLOBAL``, or ``LOAD_ATTR`` (a method load counts as one)."""
    loads: dict[str, set[str]] = {}
    for instruction in dis.get_instructions(inspect.unwrap(function)):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD"):
            how = "LOAD_GLOBAL" if instruction.opname == "LOAD_GLOBAL" else "LOAD_ATTR"
            loads.setdefault(instruction.argval, set()).add(how)
    return loads
