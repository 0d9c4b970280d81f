"""The only module that touches DeepSpeed internals.

* The ZeRO-3 parameter adapter that :mod:`ztriton.partitioning` uses: turn a torch Parameter into a
  DeepSpeed ZeRO-3 parameter (``ds_*`` attributes and the ``all_gather`` / ``partition`` methods,
  exactly as ``zero.Init`` installs them) and hand it a partition that ztriton filled, without
  DeepSpeed's own broadcast and slicing.
* The ``"partition_backend": "triton"`` config key (:func:`install`, run by ``import ztriton``):
  DeepSpeed's load-time data movement is routed through ztriton (see "The config key" below).
* DeepSpeed's communication on an existing torch.distributed world (:func:`deepspeed_world`,
  :func:`simulated_world`), which the demo and the tests use to play any rank of a world on torch's
  fake process group.
"""
from __future__ import annotations

import base64
import contextlib
import contextvars
import datetime
import functools
import importlib
import inspect
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger("ztriton")

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
    if getattr(context, "quantized_initialization", None):
        return "quantized initialization (weight_quantization.quantized_initialization)"
    return None


# --------------------------------------------------------------------------------------------
# The config key: "partition_backend": "triton" (default "torch": DeepSpeed's own code).
#
# install() wraps a few DeepSpeed functions; each wrapper runs DeepSpeed's original unless the config
# in force says "triton", so without the key DeepSpeed behaves exactly as before:
#
# * DeepSpeedConfig.__init__        reads and validates the key (an unknown backend fails there, i.e.
#                                   at deepspeed.initialize / zero.Init).
# * zero.Init (Init.__init__, _post_init_method, _convert_to_zero_parameters, the tensor-creation
#   wrappers)                       partitions through ztriton.partitioning; parameters of at least
#                                   host_init_bytes are created in host memory, so the full tensor
#                                   never lands on the device.
# * DeepSpeedEngine._configure_zero_optimizer
#                                   marks the optimizer's construction, and only it: the flattens in
#                                   step() and checkpoint loading stay DeepSpeed's.
# * DeepSpeedZeroOptimizer (ZeRO-1/2) its init-time flatten goes through ztriton.flatten's tiers.
# * stage3.defragment (ZeRO-3)      lp_param_buffer is built by ztriton.defragment on the device.
#
# Modes ztriton does not handle fall back to DeepSpeed's code with one log line naming the mode.

CONFIG_KEY = "partition_backend"
OPTIONS_KEY = "ztriton"
BACKENDS = ("torch", "triton")
_OPTION_NAMES = ("host_init_bytes", "chunk_bytes", "headroom_bytes")


@dataclass(frozen=True)
class Settings:
    """What a DeepSpeed config asks of ztriton: the backend, and the optional ``"ztriton"`` section.

    ``host_init_bytes``: parameters created inside ``zero.Init`` at least this large start in host
    memory (default: the policy's pick, 1 GiB or less on a tight device); ``chunk_bytes``: staging
    chunk size; ``headroom_bytes``: device memory the policy leaves free (default 1 GiB).
    """

    backend: str = "torch"
    host_init_bytes: int | None = None
    chunk_bytes: int | None = None
    headroom_bytes: int | None = None

    @property
    def triton(self) -> bool:
        return self.backend == "triton"


def settings_from(config: Any) -> Settings:
    """The :class:`Settings` of a DeepSpeed config: a dict, a JSON/HJSON path, a base64 string (as
    DeepSpeed accepts) or a ``DeepSpeedConfig``; ``None`` gives the defaults (backend "torch").

    Raises ``ValueError`` naming the key for an unknown backend or a malformed ``"ztriton"`` section.
    """
    if config is None:
        return Settings()
    values = _config_dict(config)
    backend = values.get(CONFIG_KEY, "torch")
    if backend not in BACKENDS:
        raise ValueError(f"DeepSpeed config: {CONFIG_KEY!r} must be one of {list(BACKENDS)}, got {backend!r} "
                         f"(\"triton\" routes ZeRO's load-time data movement through ztriton, \"torch\" keeps "
                         "DeepSpeed's own code)")
    options = values.get(OPTIONS_KEY) or {}
    if not isinstance(options, dict):
        raise ValueError(f"DeepSpeed config: {OPTIONS_KEY!r} must be a dict of {list(_OPTION_NAMES)}, got "
                         f"{type(options).__name__}")
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"DeepSpeed config: unknown {OPTIONS_KEY!r} option(s) {unknown}; known: {list(_OPTION_NAMES)}")
    for name, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"DeepSpeed config: {OPTIONS_KEY}.{name} must be an int >= 0 (bytes), got {value!r}")
    if options.get("chunk_bytes") is not None and options["chunk_bytes"] < 1 << 20:
        raise ValueError(f"DeepSpeed config: {OPTIONS_KEY}.chunk_bytes must be at least 1 MiB (1048576), "
                         f"got {options['chunk_bytes']}")
    return Settings(backend, **options)


def _config_dict(config: Any) -> dict:
    from deepspeed.runtime.config import DeepSpeedConfig

    if isinstance(config, DeepSpeedConfig):
        return config._param_dict
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        import hjson  # what DeepSpeedConfig reads files and base64 strings with

        if os.path.exists(config):
            with open(config) as handle:
                return hjson.load(handle)
        try:
            return hjson.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"DeepSpeed config {config!r} is neither an existing file nor base64") from exc
    if hasattr(config, "config") and isinstance(config.config, dict):  # transformers' HfDeepSpeedConfig
        return config.config
    raise TypeError(f"a DeepSpeed config is a dict, a path or a DeepSpeedConfig, got {type(config).__name__}")


# Settings of the engine whose ZeRO optimizer is being constructed (None outside that construction).
_BUILDING_OPTIMIZER: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("ztriton_optimizer", default=None)
# (owner, name) -> (DeepSpeed's function, whether owner itself defined it rather than a base class).
_ORIGINALS: dict[tuple[Any, str], tuple[Any, bool]] = {}


def install() -> None:
    """Make DeepSpeed honour ``"partition_backend"``. Idempotent; ``import ztriton`` calls it (at once if
    DeepSpeed is imported, else when it is). Without the key DeepSpeed behaves exactly as before."""
    if _ORIGINALS:
        return
    from deepspeed.runtime import config as config_module
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2

    init = partition_parameters.Init
    _wrap(config_module.DeepSpeedConfig, "__init__", _config_init)
    _wrap(init, "__init__", _init_init)
    _wrap(init, "_post_init_method", _init_post_init_method)
    _wrap(init, "_convert_to_zero_parameters", _init_convert_to_zero_parameters)
    _wrap(init, "_add_tensor_creation_wrappers", _init_add_tensor_creation_wrappers)
    _wrap(engine_module.DeepSpeedEngine, "_configure_zero_optimizer", _engine_configure_zero_optimizer)
    _wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "__init__", _zero12_init)
    _wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", _zero12_flatten)
    _wrap(stage3, "defragment", _stage3_defragment)
    from deepspeed.accelerator import get_accelerator

    _wrap(type(get_accelerator()), "available_memory", _accelerator_available_memory)


def uninstall() -> None:
    """Put DeepSpeed's functions back (tests use it to compare against an untouched DeepSpeed)."""
    for (owner, name), (original, own) in _ORIGINALS.items():
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # it was inherited: let the base class's show through again
    _ORIGINALS.clear()


def installed() -> bool:
    return bool(_ORIGINALS)


def _wrap(owner: Any, name: str, wrapper: Callable) -> None:
    original = getattr(owner, name)
    _ORIGINALS[(owner, name)] = (original, not isinstance(owner, type) or name in owner.__dict__)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    setattr(owner, name, patched)


# ---- DeepSpeedConfig: the key is read and validated wherever DeepSpeed reads a config.


def _config_init(original, self, config, *args, **kwargs):
    if isinstance(config, type(self)):  # zero.Init(config_dict_or_path=<DeepSpeedConfig>): read its dict
        config = config._param_dict
    original(self, config, *args, **kwargs)
    self.ztriton = settings_from(self._param_dict)


# ---- zero.Init


def _init_init(original, self, *args, **kwargs):
    bound = inspect.signature(original).bind(self, *args, **kwargs).arguments
    config = bound.get("config")  # DeepSpeed's precedence: the deprecated config= wins when given
    if config is None:
        config = bound.get("config_dict_or_path")
    self._ztriton = settings_from(config)  # an unknown backend fails before DeepSpeed does anything
    self._ztriton_checked = False
    original(self, *args, **kwargs)
    _uses_ztriton(self)  # the log line, once, even if the module creates no parameters


def _uses_ztriton(init) -> bool:
    """Whether this ``zero.Init`` partitions through ztriton; logs the decision once per Init."""
    settings = getattr(init, "_ztriton", None)
    if settings is None or not settings.triton or not hasattr(init, "remote_device"):
        return False  # not ours, or asked before DeepSpeed's __init__ set up the devices
    reason = unsupported_reason(init)
    if not getattr(init, "_ztriton_checked", False):
        init._ztriton_checked = True
        if reason is not None:
            logger.warning("ztriton: partition_backend='triton' falls back to DeepSpeed's zero.Init for %s, which "
                           "ztriton does not handle", reason)
        else:
            logger.info("ztriton: zero.Init partitions through ztriton (partitions on %s; parameters of %s or "
                        "more are created in host memory)", _offload_device(init) or init.local_device,
                        _bytes(_host_init_bytes(init)))
    return reason is None


def _offload_device(init) -> str | None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return "cpu" if init.remote_device == OffloadDeviceEnum.cpu else None


def _host_init_bytes(init) -> int:
    if not hasattr(init, "_ztriton_host_init_bytes"):
        from ztriton import policy

        configured = init._ztriton.host_init_bytes
        free = 0 if configured is not None else policy.probe_memory(init.local_device).device_free
        init._ztriton_host_init_bytes = policy.choose_host_init_bytes(free, configured)
    return init._ztriton_host_init_bytes


def _init_post_init_method(original, self, module):
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


def _init_convert_to_zero_parameters(original, self, param_list):
    if not _uses_ztriton(self):
        return original(self, param_list)
    params = [p for p in param_list if not is_zero3_param(p)]
    _partition_through_ztriton(self, [(f"param[{i}]", p) for i, p in enumerate(params)])


def _partition_through_ztriton(init, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Partition ``named`` as ``init`` would, one call per partition group (MoE experts have their own)."""
    from ztriton.partitioning import partition_params

    _cast_like_deepspeed(named)
    buckets: dict[int, tuple[Any, list]] = {}
    for name, param in named:
        group = getattr(param, "ds_zero_partition_process_group", init.ds_process_group)
        buckets.setdefault(id(group), (group, []))[1].append((name, param))
    settings = init._ztriton
    nbytes = sum(p.numel() * p.dtype.itemsize for _, p in named)
    for group, items in buckets.values():
        partition_params(init, items, group, offload=_offload_device(init) == "cpu", pin_memory=init.pin_memory,
                         chunk_bytes=_chunk_bytes(init), headroom_bytes=settings.headroom_bytes,
                         log_level=logging.DEBUG)
    _progress(init, len(named), nbytes)


PROGRESS_EVERY_BYTES = 16 << 30


def _progress(init, params: int, nbytes: int) -> None:
    """An INFO line each time another 16 GiB of parameters has been partitioned: long loads show life."""
    before = getattr(init, "_ztriton_done_bytes", 0)
    done = before + nbytes
    init._ztriton_done_bytes = done
    init._ztriton_done_params = getattr(init, "_ztriton_done_params", 0) + params
    if done // PROGRESS_EVERY_BYTES > before // PROGRESS_EVERY_BYTES:
        logger.info("ztriton zero.Init: %s of parameters partitioned so far (%d params)", _bytes(done),
                    init._ztriton_done_params)


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


def _chunk_bytes(init) -> int:
    """One staging chunk size per zero.Init (probing free memory per module would cost a query each)."""
    if not hasattr(init, "_ztriton_chunk_bytes"):
        from ztriton.partitioning import staging_chunk_bytes

        settings = init._ztriton
        world = torch.distributed.get_world_size(init.ds_process_group)
        init._ztriton_chunk_bytes, _ = staging_chunk_bytes(init.local_device, world, settings.headroom_bytes,
                                                           settings.chunk_bytes)
    return init._ztriton_chunk_bytes


# Tensor constructors zero.Init redirects to the device; under ztriton the large ones go to the host.
# empty/zeros/ones are created straight in the target dtype there (same values, no full-size
# fp32 transient); the others keep DeepSpeed's create-then-convert so their values do not change.
_HOST_CONSTRUCTORS = {"empty": True, "zeros": True, "ones": True, "full": False, "randn": False}


def _init_add_tensor_creation_wrappers(original, self):
    original(self)
    if not _uses_ztriton(self):
        return
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

    target = self.dtype if DeepSpeedTensorOverride.dtype in self.tensor_overrides else None
    for name, direct_dtype in _HOST_CONSTRUCTORS.items():
        setattr(torch, name, _large_to_host(getattr(torch, name), name, self, target if direct_dtype else None))


def _large_to_host(constructor: Callable, name: str, init, direct_dtype: torch.dtype | None) -> Callable:
    threshold = _host_init_bytes(init)
    pin = bool(init.pin_memory) and torch.cuda.is_available()

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
                init._ztriton_host_created = getattr(init, "_ztriton_host_created", 0) + 1
                logger.debug("ztriton: %s of %s created in host memory (>= %s)", name, _bytes(nbytes), _bytes(threshold))
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


# ---- the engine's optimizer construction, and the ZeRO-1/2 flatten inside it.


def _engine_configure_zero_optimizer(original, self, *args, **kwargs):
    settings = getattr(self._config, "ztriton", None) or settings_from(self._config)
    token = _BUILDING_OPTIMIZER.set(settings)
    try:
        return original(self, *args, **kwargs)
    finally:
        _BUILDING_OPTIMIZER.reset(token)


# While a ZeRO-1/2 optimizer is built under the key, the accelerator reports unbounded free memory:
# DeepSpeed's own check would otherwise move every param to pageable host memory (its CPU fallback);
# ztriton's tiers decide instead, from their own measurements. A context variable, not a patch set and
# unset on the shared accelerator object, so other threads and later engines see the real figure.
_SPOOF_FREE_MEMORY: contextvars.ContextVar[bool] = contextvars.ContextVar("ztriton_spoof_memory", default=False)


def _accelerator_available_memory(original, self, *args, **kwargs):
    return 1 << 62 if _SPOOF_FREE_MEMORY.get() else original(self, *args, **kwargs)


def _zero12_init(original, self, *args, **kwargs):
    settings = _BUILDING_OPTIMIZER.get()
    if settings is None or not settings.triton:
        return original(self, *args, **kwargs)
    logger.info("ztriton: the ZeRO-1/2 optimizer's init-time flatten goes through ztriton.flatten_groups")
    token = _SPOOF_FREE_MEMORY.set(True)
    self._ztriton_flatten = settings
    try:
        original(self, *args, **kwargs)
    finally:
        self._ztriton_flatten = None
        _SPOOF_FREE_MEMORY.reset(token)


def _zero12_flatten(original, self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
    settings = getattr(self, "_ztriton_flatten", None)
    # Only the init-time call passes param_padding; step() and checkpoint loading stay DeepSpeed's.
    if settings is None or use_cpu_data or param_padding is None:
        return original(self, tensor_list, alignment, use_cpu_data, param_padding)
    index = len(self.bit16_groups_flat)
    group = self.real_dp_process_group[index]
    mismatch = _zero12_layout_mismatch(self, index, tensor_list, alignment, group)
    if mismatch:
        logger.warning("ztriton: group %d's layout differs from DeepSpeed's (%s); DeepSpeed flattens it", index, mismatch)
        return original(self, tensor_list, alignment, use_cpu_data, param_padding)
    from ztriton.flatten import flatten_groups

    (flat,) = flatten_groups([tensor_list], group, parameter_alignment=self.parameter_alignment,
                             headroom_bytes=settings.headroom_bytes, chunk_bytes=settings.chunk_bytes)
    return flat.flat


def _zero12_layout_mismatch(optimizer, index: int, tensors: list, alignment: int, group) -> str | None:
    """Why ztriton's layout of this group would differ from the one DeepSpeed just computed, or None."""
    from ztriton.layout import NCCL_START_ALIGNMENT_FACTOR, zero12_group_layout

    world = torch.distributed.get_world_size(group)
    if alignment != NCCL_START_ALIGNMENT_FACTOR * world:
        return f"alignment {alignment} is not {NCCL_START_ALIGNMENT_FACTOR} x world size {world}"
    if not all(t.requires_grad and t.numel() > 0 for t in tensors):
        return "a frozen or empty tensor in the group"
    layout = zero12_group_layout([t.numel() for t in tensors], world, element_size=tensors[0].element_size(),
                                 parameter_alignment=optimizer.parameter_alignment)
    if list(layout.offsets) != list(optimizer.round_robin_bit16_offsets[index]) or \
            list(layout.paddings) != list(optimizer.round_robin_bit16_padding[index]):
        return "offsets or paddings"
    return None


# ---- ZeRO-3: the optimizer's lp_param_buffer.


def _stage3_defragment(original, tensors):
    settings = _BUILDING_OPTIMIZER.get()
    if settings is None or not settings.triton:
        return original(tensors)
    from ztriton.defragment import defragment

    return defragment(tensors, headroom_bytes=settings.headroom_bytes)


def _bytes(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes} B"


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
