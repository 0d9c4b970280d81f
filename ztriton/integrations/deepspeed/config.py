"""The config key ``"partition_backend"`` and its ``"ztriton"`` section, read from a DeepSpeed config.

A top-level key: DeepSpeed's ``zero_optimization`` section rejects unknown keys, top-level unknown
keys are accepted and readable from the config dict. The section's options are
:class:`ztriton.policy.Options`, checked there.
"""
from __future__ import annotations

import base64
import difflib
import importlib
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from ztriton.policy import OPTION_NAMES, RENAMED_OPTIONS, Options

__all__ = ["BACKENDS", "CONFIG_KEY", "OPTIONS_KEY", "Settings", "misspelt_keys", "settings_from", "warn_if_no_effect"]

CONFIG_KEY = "partition_backend"
OPTIONS_KEY = "ztriton"
BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Settings:
    """What a DeepSpeed config asks of ztriton: the backend ("torch": DeepSpeed's own code) and the
    options of the ``"ztriton"`` section (``sharded_init_bytes``, ``chunk_bytes``, ``headroom_bytes``,
    ``warm_up_kernels``)."""

    backend: str = "torch"
    options: Options = field(default_factory=Options)

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
    from deepspeed.runtime.config import DeepSpeedConfig

    if not isinstance(config, DeepSpeedConfig):
        return _parse(_config_dict(config))
    settings = _PARSED.get(config)  # a DeepSpeedConfig is parsed once: its engine asks again
    if settings is None:
        settings = _PARSED[config] = _parse(config._param_dict)
    return settings


# Each DeepSpeedConfig's Settings, parsed when it was read (weakly keyed: they go with the config).
_PARSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parse(values: dict) -> Settings:
    backend = values.get(CONFIG_KEY, "torch")
    if backend not in BACKENDS:
        raise ValueError(f"DeepSpeed config: {CONFIG_KEY!r} must be one of {list(BACKENDS)}, got {backend!r} "
                         f"(\"triton\" routes ZeRO's load-time data movement through ztriton, \"torch\" keeps "
                         "DeepSpeed's own code)")
    section = values.get(OPTIONS_KEY) or {}
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: {OPTIONS_KEY!r} must be a dict of {list(OPTION_NAMES)}, got "
                         f"{type(section).__name__}")
    unknown = sorted(set(section) - set(OPTION_NAMES) - set(RENAMED_OPTIONS))
    if unknown:
        raise ValueError(f"DeepSpeed config: unknown {OPTIONS_KEY!r} option(s) {unknown}; known: {list(OPTION_NAMES)}")
    try:
        options = Options.of(**section)
    except ValueError as exc:  # Options names the option; say where it came from
        raise ValueError(f"DeepSpeed config: {OPTIONS_KEY}.{exc}") from None
    return Settings(backend, options)


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


def _squash(key: str) -> str:
    return "".join(c for c in key.lower() if c.isalnum())


def misspelt_keys(values: dict) -> list[tuple[str, str]]:
    """Top-level keys of a config that look like a misspelling of ours: ``(found, meant)`` pairs.

    DeepSpeed accepts unknown top-level keys silently, so ``"partition_backed": "triton"`` would leave the
    key off without a word. A key is suspect when it equals one of ours up to case and separators
    (``"partition-backend"``, ``"PartitionBackend"``) or is a close match (difflib ratio >= 0.8)."""
    ours = {CONFIG_KEY: _squash(CONFIG_KEY), OPTIONS_KEY: _squash(OPTIONS_KEY)}
    found = []
    for key in values:
        if not isinstance(key, str) or key in ours:
            continue
        for meant, squashed in ours.items():
            if _squash(key) == squashed or difflib.get_close_matches(key.lower(), [meant], n=1, cutoff=0.8):
                found.append((key, meant))
                break
    return found


def warn_if_no_effect(settings: Settings, zero_stage: int) -> None:
    """``deepspeed.initialize`` under the key at ZeRO stage 0: nothing of ztriton's runs there."""
    if settings.triton and zero_stage == 0:
        from ztriton.integrations.deepspeed.report import warn_once

        warn_once(f"{CONFIG_KEY!r}: 'triton' has no effect at ZeRO stage 0 (zero_optimization.stage is 0 or "
                  "missing): ztriton moves data for the ZeRO-1/2/3 optimizers and zero.Init; set the stage, or "
                  "drop the key")


def start_kernel_warm_up() -> None:
    """Load the kernels in the background from the moment a config asks for them (``"ztriton":
    {"warm_up_kernels": true}``): DeepSpeed's own set-up (engine, process groups, the model build) then hides
    the first launch's fixed cost (``kernels.warmup``). Off by default: a process that never needs a kernel
    would pay for the thread inside ZeRO-3's initialize (bench/NOTES.md, "Kernels: why the tuning is what it is").
    Only on :func:`rank_device`'s GPU. Best effort: a failure to start it (no threads left) is logged and changes
    nothing else.
    """
    index = rank_device()
    if index is None:
        return
    from ztriton.kernels.warmup import warm_up_in_background

    try:
        warm_up_in_background(index)
    except RuntimeError as exc:  # threading's "can't start new thread"
        logging.getLogger("ztriton").debug("ztriton: kernel warm-up not started (%s)", exc)


def start_preload(element_size: int | None = None) -> None:
    """Under the key, from the moment a config is read: :func:`preload_on` :func:`rank_device`'s GPU, so that the
    preload is done before the step needs it (one started only when DeepSpeed configures the optimizer is still
    loading inside the flatten, holding the GIL there). Where no GPU is known yet, the engine's hook starts it on
    the engine's device."""
    index = rank_device()
    if index is not None:
        preload_on(index, element_size)


def preload_on(device, element_size: int | None = None) -> None:
    """Best effort: threads that load the compiled word copies (those that copies of ``element_size``-byte params
    can use, where it is known), fill torch's pinned-memory cache and load torch's cat kernel on ``device``
    (``kernels.warmup``; never Triton's JIT). A thread that cannot start changes nothing but the first copy's
    time."""
    from ztriton.kernels.warmup import load_torch_cat_in_background, preload_in_background

    for start, args in ((preload_in_background, (device, element_size)), (load_torch_cat_in_background, (device,))):
        try:
            start(*args)
        except RuntimeError as exc:  # threading's "can't start new thread"
            logging.getLogger("ztriton").debug("ztriton: %s not started (%s)", start.__name__, exc)


def param_element_size(config) -> int | None:
    """The bytes of each param the ZeRO optimizer will hold, as a DeepSpeed config says: 2 under bf16 or fp16 (the
    engine casts the model), else None (the model's own dtype, not known from the config)."""
    for section in ("bfloat16_config", "float16_config"):
        if getattr(getattr(config, section, None), "enabled", False) is True:
            return 2
    return None


def rank_device() -> int | None:
    """The CUDA device this rank will use, where known before DeepSpeed sets it: ``LOCAL_RANK`` (DeepSpeed's
    launcher, torchrun and accelerate set it, and DeepSpeed selects that device), else the only GPU; None with
    several GPUs and no LOCAL_RANK (a guess could put a CUDA context on another rank's GPU; an initialised CUDA does
    not say the device was chosen yet: zero.Init reads its config before DeepSpeed sets the device), without CUDA,
    or where DeepSpeed's accelerator is not CUDA."""
    import torch
    from deepspeed.accelerator import get_accelerator

    if not torch.cuda.is_available() or get_accelerator().device_name() != "cuda":
        return None
    count = torch.cuda.device_count()
    local_rank = os.environ.get("LOCAL_RANK", "")
    if local_rank.isdigit() and int(local_rank) < count:
        return int(local_rank)
    return 0 if count == 1 else None


# The module the key's step at each ZeRO stage imports on first use, and those prepared for already.
_STEP_MODULES = {1: "ztriton.flatten", 2: "ztriton.flatten", 3: "ztriton.defragmenting"}
_prepared: set[str] = set()


def prepare_step(stage: object, element_size: int | None = None) -> None:
    """From the moment a config with the key is read: import the module the key's step at ZeRO ``stage`` needs
    (the flatten's, the defragment's) on the caller's thread, then :func:`start_preload` (its threads), once per
    module and process. A fresh process's step would otherwise pay both. The import is not a thread's: it is
    Python throughout, and a thread's Python time is taken from DeepSpeed's set-up on the main thread (the GIL),
    with waits for it on both sides besides; the preload's threads spend theirs in calls that release it. A
    failure is logged at debug level (the step imports again and raises there if it must; the engine's hook
    starts the preload). ``element_size``: the params' bytes each, where the config says
    (:func:`param_element_size`)."""
    name = _STEP_MODULES.get(stage) if isinstance(stage, int) else None
    if name is None or name in _prepared:
        return
    _prepared.add(name)
    for what, work in (("import of " + name, lambda: importlib.import_module(name)),
                       ("preload", lambda: start_preload(element_size))):
        try:
            work()
        except Exception as exc:  # noqa: BLE001 -- best effort, as above
            logging.getLogger("ztriton").debug("ztriton: %s from the config failed (%s)", what, exc)


def _dict_of_config_object(config_class: type, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """DeepSpeed cannot read a ``DeepSpeedConfig`` given as a config (``zero.Init(config_dict_or_path=<one>)``
    fails in ``os.path.exists``): one whose key asks for ztriton is read as its dict; any other argument goes to
    DeepSpeed as it came."""
    in_kwargs = not args and "config" in kwargs
    config = kwargs["config"] if in_kwargs else (args[0] if args else None)
    if not isinstance(config, config_class) or not settings_from(config).triton:
        return args, kwargs
    if in_kwargs:
        return args, {**kwargs, "config": config._param_dict}
    return (config._param_dict, *args[1:]), kwargs


def config_init(original, self, *args, **kwargs):
    """``DeepSpeedConfig.__init__``: the key is read and checked wherever DeepSpeed reads a config."""
    args, kwargs = _dict_of_config_object(type(self), args, kwargs)
    original(self, *args, **kwargs)
    settings = settings_from(self)  # an unknown backend or a bad section fails here, before any work
    if settings.triton:
        from ztriton.integrations.standaside import announce

        announce()  # where ztriton stood aside from another library (transformers), the one line saying so
    if settings.triton:  # the import first, before any of ztriton's threads starts (prepare_step says why)
        prepare_step(getattr(self, "zero_optimization_stage", 0), param_element_size(self))
    if settings.triton and settings.options.warm_up_kernels:
        start_kernel_warm_up()
    if isinstance(self._param_dict, dict):
        from ztriton.integrations.deepspeed.report import warn_once

        for key, meant in misspelt_keys(self._param_dict):
            warn_once(f"DeepSpeed config key {key!r} is not one DeepSpeed or ztriton reads (DeepSpeed ignores unknown "
                      f"keys); did you mean {meant!r}?")
