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
  flatten), the stage-3 optimizer's ``defragment`` (ZeRO-3: ``lp_param_buffer``), the accelerator's
  ``available_memory``                                                   -- :mod:`.optimizers`.

Where DeepSpeed releases differ in one of these internals, :mod:`.variants` tells which variant is installed.
"""
from __future__ import annotations

from typing import Any, Callable

from ztriton.integrations.deepspeed import init_constructors, optimizers, variants, zero_init
from ztriton.integrations.deepspeed.config import CONFIG_KEY, config_init
from ztriton.integrations.deepspeed.state import STATE
from ztriton.integrations.hooks import unwrap_all, wrap
from ztriton.integrations.standaside import announce, stand_aside

__all__ = ["install", "installed", "uninstall"]


def install() -> bool:
    """Make DeepSpeed honour ``"partition_backend"``. Idempotent; ``import ztriton`` calls it (at once if
    DeepSpeed is imported, else when it is). Without the key DeepSpeed behaves exactly as before.

    All hooks or none: where one of DeepSpeed's internals is not the one known, every hook already put in is
    taken out again, ztriton stands aside (:mod:`ztriton.integrations.standaside`) and only a hook that reads
    the key stays, to say so once when a config asks for ztriton. Returns whether the hooks are in."""
    if STATE.originals:
        return True
    try:
        _install_all()
    except Exception as exc:  # noqa: BLE001 -- any failure here means internals ztriton does not know
        uninstall()
        import deepspeed

        stand_aside("DeepSpeed", f"DeepSpeed {deepspeed.__version__}'s internals are not the ones ztriton knows "
                                 f"({type(exc).__name__}: {exc})")
        _install_key_reader()
        return False
    return True


def _install_all() -> None:
    """Check every internal the hooks rely on and pick the installed DeepSpeed's variants (:mod:`.variants`;
    raises before anything is wrapped if one is unknown), then wrap."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime import config as config_module
    from deepspeed.runtime import engine as engine_module
    from deepspeed.runtime.zero import partition_parameters, stage_1_and_2

    STATE.variants = variants.detect()
    init = partition_parameters.Init
    _wrap(config_module.DeepSpeedConfig, "__init__", config_init)
    _wrap(init, "__init__", zero_init.init_init)
    _wrap(init, "_post_init_method", zero_init.init_post_init_method)
    _wrap(init, "_convert_to_zero_parameters", zero_init.init_convert_to_zero_parameters)
    _wrap(init, "_add_tensor_creation_wrappers", init_constructors.init_add_tensor_creation_wrappers)
    _wrap(engine_module.DeepSpeedEngine, "_configure_zero_optimizer", optimizers.engine_configure_zero_optimizer)
    _wrap(engine_module.DeepSpeedEngine, "_do_sanity_check", optimizers.engine_do_sanity_check)
    _wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "__init__", optimizers.zero12_init)
    _wrap(stage_1_and_2.DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", optimizers.zero12_flatten)
    _wrap(STATE.variants.defragment_owner, "defragment", optimizers.stage3_defragment)
    _wrap(type(get_accelerator()), "available_memory", optimizers.accelerator_available_memory)


def _install_key_reader() -> None:
    """Where ztriton stands aside: ``DeepSpeedConfig.__init__`` runs as DeepSpeed's and then, if the config
    asks for ztriton, says once why it has no effect."""
    from deepspeed.runtime.config import DeepSpeedConfig

    def read_key(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        values = getattr(self, "_param_dict", None)
        if isinstance(values, dict) and values.get(CONFIG_KEY) == "triton":
            announce()

    _wrap(DeepSpeedConfig, "__init__", read_key, into=STATE.key_reader)


def uninstall() -> None:
    """Put DeepSpeed's functions back (tests use it to compare against an untouched DeepSpeed)."""
    unwrap_all(STATE.originals)
    unwrap_all(STATE.key_reader)


def installed() -> bool:
    return bool(STATE.originals)


def _wrap(owner: Any, name: str, wrapper: Callable, into: dict | None = None) -> None:
    wrap(owner, name, wrapper, STATE.originals if into is None else into)
