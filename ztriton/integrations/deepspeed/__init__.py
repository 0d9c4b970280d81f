"""DeepSpeed integration: the ``"partition_backend": "triton"`` config key and ``ztriton.partition``.

* :mod:`.install` -- wraps DeepSpeed's functions (run by ``import ztriton`` once DeepSpeed is imported).
* :mod:`.config` -- the key and its ``"ztriton"`` section, read into :class:`~.config.Settings`.
* :mod:`.zero3_param` -- partitions from :mod:`ztriton.partitioning` made into ZeRO-3 parameters.
* :mod:`.zero_init` -- ``zero.Init`` under the key. :mod:`.optimizers` -- the ZeRO-1/2 flatten and
  the stage-3 ``defragment`` under the key. :mod:`.state` -- what the hooks remember, in one place.
* :mod:`.worlds` -- DeepSpeed's communication on an existing torch.distributed world (for
  :mod:`ztriton.testing`). :mod:`.reference` -- DeepSpeed's own code paths, for comparisons.
  :mod:`.demo` -- ``python -m ztriton demo``.

Importing this package imports neither DeepSpeed nor triton (triton decides at import time whether
its kernels run under the interpreter); its functions do, when called.
"""
import importlib

_LAZY = {"Settings": "config", "settings_from": "config", "install": "install", "installed": "install",
         "uninstall": "install", "partition": "zero3_param"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
