"""Hooks: :func:`install` wraps a few DeepSpeed functions so that the config key takes effect.

Each wrapper runs DeepSpeed's original unless the config in force says ``"triton"``, so without the
key DeepSpeed behaves exactly as before:

* ``DeepSpeedConfig.__init__``      reads and checks the key (an unknown backend fails there, i.e. at
                                    ``deepspeed.initialize`` / ``zero.Init``; a misspelt key warns)
                                    -- :mod:`.config`.
* ``DeepSpeedEngine._do_sanity_check`` warns when the key does nothing (ZeRO stage 0) -- :mod:`.config`.
* ``zero.Init`` (``__init__``, ``_post_init_method``, ``_convert_to_zero_parameters``, the
  tensor-creation wrappers)         partitions through ztriton -- :mod:`.zero_init`.
* ``DeepSpeedEngine._configure_zero_optimizer``, ``DeepSpeedZeroOptimizer`` (ZeRO-1/2: its init-time
  flatten), ``stage3.defragment`` (ZeRO-3: ``lp_param_buffer``), the accelerator's
  ``available_memory``                                                   -- :mod:`.optimizers`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from ztriton.integrations.deepspeed import optimizers, zero_init
from ztriton.integrations.deepspeed.config import config_init
from ztriton.integrations.deepspeed.state import STATE

__all__ = ["install", "installed", "uninstall"]


def install() -> None:
    """Make DeepSpeed honour ``"partition_backend"``. Idempotent; ``import ztriton`` calls it (at once if
    DeepSpeed is imported, else when it is). Without the key DeepSpeed behaves exactly as before."""
    if STATE.originals:
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime import config as config_module
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2

    init = partition_parameters.Init
    _wrap(config_module.DeepSpeedConfig, "__init__", config_init)
    _wrap(init, "__init__", zero_init.init_init)
    _wrap(init, "_post_init_method", zero_init.init_post_init_method)
    _wrap(init, "_convert_to_zero_parameters", zero_init.init_convert_to_zero_parameters)
    _wrap(init, "_add_tensor_creation_wrappers", zero_init.init_add_tensor_creation_wrappers)
    _wrap(engine_module.DeepSpeedEngine, "_configure_zero_optimizer", optimizers.engine_configure_zero_optimizer)
    _wrap(engine_module.DeepSpeedEngine, "_do_sanity_check", optimizers.engine_do_sanity_check)
    _wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "__init__", optimizers.zero12_init)
    _wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", optimizers.zero12_flatten)
    _wrap(stage3, "defragment", optimizers.stage3_defragment)
    _wrap(type(get_accelerator()), "available_memory", optimizers.accelerator_available_memory)


def uninstall() -> None:
    """Put DeepSpeed's functions back (tests use it to compare against an untouched DeepSpeed)."""
    for (owner, name), (original, own) in STATE.originals.items():
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # it was inherited: let the base class's show through again
    STATE.originals.clear()


def installed() -> bool:
    return bool(STATE.originals)


def _wrap(owner: Any, name: str, wrapper: Callable) -> None:
    original = getattr(owner, name)
    STATE.originals[(owner, name)] = (original, not isinstance(owner, type) or name in owner.__dict__)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    setattr(owner, name, patched)
