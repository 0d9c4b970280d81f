"""ztriton: Triton kernels for DeepSpeed ZeRO's load-time data movement."""
import importlib.abc as _abc
import importlib.util as _util
import logging as _logging
import sys as _sys
from pathlib import Path as _Path

# The kernels' sources live in the top-level folder kernels/, installed as ztriton.kernels. In a
# source checkout that is imported without being installed (PYTHONPATH=. on a GPU box), let
# `import ztriton.kernels` find that folder too.
_checkout_kernels = _Path(__file__).resolve().parent.parent / "kernels"
if (_checkout_kernels / "__init__.py").is_file() and not (_Path(__file__).parent / "kernels").exists():
    __path__.append(str(_checkout_kernels.parent))

from ztriton import layout  # noqa: E402

__version__ = "0.1.0"
__all__ = ["layout", "partition", "Partitioned", "flatten_groups", "FlatGroup", "defragment", "load_checkpoint",
           "__version__"]

# Every public entry point, loaded on first use: triton decides at import time whether its kernels run
# under the interpreter (TRITON_INTERPRET=1), so `import ztriton` must not import it. (The ZeRO-3
# module is ztriton.partitioning, not ztriton.partition: a submodule named like the function would
# rebind `ztriton.partition` to the module whenever it is imported directly; likewise defragmenting.)
_LAZY = {
    "partition": "ztriton.integrations.deepspeed.zero3_param",  # makes DeepSpeed ZeRO-3 params
    "Partitioned": "ztriton.partitioning",
    "flatten_groups": "ztriton.flatten",
    "FlatGroup": "ztriton.flatten",
    "defragment": "ztriton.defragmenting",
    "load_checkpoint": "ztriton.integrations.zero3_loading",  # ZeRO-3: each rank reads its own slices
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ztriton' has no attribute {name!r}")


# The DeepSpeed config key "partition_backend": DeepSpeed's hooks (ztriton.integrations.deepspeed.install)
# go in as soon as DeepSpeed is imported, transformers' (ztriton.integrations.transformers, from_pretrained
# under ZeRO-3) as soon as its modeling_utils is, without importing either here (both are slow to import, and
# DeepSpeed picks its accelerator on import).
_INSTALLERS = {"deepspeed": ("ztriton.integrations.deepspeed.install", "DeepSpeed", "deepspeed==0.19.8"),
               "transformers.modeling_utils": ("ztriton.integrations.transformers", "transformers",
                                               "transformers 5.17 to 5.24")}


class _InstallOnImport(_abc.MetaPathFinder):
    """One shot per module: when ``name`` finishes loading, install ztriton's hooks into it."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        _sys.meta_path.remove(self)  # one shot: the lookup below must not come back here
        spec = _util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                _install_hooks(name)

            spec.loader.exec_module = exec_module
        return spec


def _install_hooks(name: str) -> None:
    import importlib

    module, library, supported = _INSTALLERS[name]
    try:
        importlib.import_module(module).install()
    except Exception as exc:  # internals that moved: say so, do not break the user's import
        _logging.getLogger("ztriton").error(
            "ztriton could not hook %s (%s: %s); \"partition_backend\": \"triton\" will have no effect there. "
            "ztriton supports %s", library, type(exc).__name__, exc, supported)


for _name in _INSTALLERS:
    if _name in _sys.modules:
        _install_hooks(_name)
    elif not any(isinstance(f, _InstallOnImport) and f.name == _name for f in _sys.meta_path):
        _sys.meta_path.insert(0, _InstallOnImport(_name))
