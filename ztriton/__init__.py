"""ztriton: Triton kernels for DeepSpeed ZeRO's load-time data movement.

Importing this package is cheap (standard library only): the installed distribution's start-up hook
(``ztriton-autoload.pth``) imports it in every interpreter so that the DeepSpeed config key works
without ``import ztriton``; ``ZTRITON_AUTOLOAD=0`` turns that off.
"""
import os as _os
import sys as _sys

# The kernels' sources live in the top-level folder kernels/, installed as ztriton.kernels. In a
# source checkout that is imported without being installed (PYTHONPATH=. on a GPU box), let
# `import ztriton.kernels` find that folder too. Not when an editable install's finder maps it: the
# start-up hook imports ztriton in every interpreter, and tools that walk ztriton.__path__ (import-linter)
# would then see the whole checkout as ztriton.*.
_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout_root = _os.path.dirname(_here)
if _os.path.isfile(_os.path.join(_checkout_root, "kernels", "__init__.py")) and \
        not _os.path.exists(_os.path.join(_here, "kernels")) and \
        not any(name.startswith("__editable___ztriton") for name in _sys.modules):
    __path__.append(_checkout_root)

__version__ = "0.1.0"
__all__ = ["layout", "partition", "Partitioned", "flatten_groups", "FlatGroup", "defragment", "load_checkpoint",
           "__version__"]

# Every public entry point, loaded on first use: triton decides at import time whether its kernels run
# under the interpreter (TRITON_INTERPRET=1), so `import ztriton` must not import it. (The ZeRO-3
# module is ztriton.partitioning, not ztriton.partition: a submodule named like the function would
# rebind `ztriton.partition` to the module whenever it is imported directly; likewise defragmenting.)
_LAZY = {
    "layout": None,  # a submodule
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

        module = importlib.import_module(f"ztriton.{name}" if _LAZY[name] is None else _LAZY[name])
        value = module if _LAZY[name] is None else getattr(module, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ztriton' has no attribute {name!r}")


# The DeepSpeed config key "partition_backend": DeepSpeed's hooks (ztriton.integrations.deepspeed.install)
# go in as soon as DeepSpeed is imported, transformers' (ztriton.integrations.transformers, from_pretrained
# under ZeRO-3) as soon as its modeling_utils is, without importing either here (both are slow to import, and
# DeepSpeed picks its accelerator on import).
_INSTALLERS = {"deepspeed": ("ztriton.integrations.deepspeed.install", "DeepSpeed"),
               "transformers.modeling_utils": ("ztriton.integrations.transformers", "transformers")}


class _InstallOnImport:
    """Installs ztriton's hooks into module ``name`` when it finishes loading, whatever probed for it first.

    It stays on ``sys.meta_path`` until the module has really been executed: ``importlib.util.find_spec(name)``
    (transformers' and accelerate's availability probes) gets a spec it may throw away, and the import that
    follows gets another. It asks only the finders after itself, so it never calls back into itself. (A meta
    path finder needs only ``find_spec``: importlib.abc would cost the start-up hook 7 ms of imports.)"""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self not in _sys.meta_path:
            return None
        later = _sys.meta_path[_sys.meta_path.index(self) + 1:]
        spec = next((s for s in (_ask(f, name, path, target) for f in later) if s is not None), None)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)  # a failed import raises here and leaves this finder for the next try
                if self in _sys.meta_path:
                    _sys.meta_path.remove(self)
                _install_hooks(name)

            spec.loader.exec_module = exec_module
        return spec


def _ask(finder, name, path, target):
    find_spec = getattr(finder, "find_spec", None)
    return None if find_spec is None else find_spec(name, path, target)


def _install_hooks(name: str) -> None:
    import importlib

    module, library = _INSTALLERS[name]
    try:
        importlib.import_module(module).install()
    except Exception as exc:  # noqa: BLE001 -- never break the user's import of DeepSpeed or transformers
        importlib.import_module("ztriton.integrations.standaside").stand_aside(
            library, f"its hooks failed to install ({type(exc).__name__}: {exc})")


for _name in _INSTALLERS:
    if _name in _sys.modules:
        _install_hooks(_name)
    elif not any(isinstance(f, _InstallOnImport) and f.name == _name for f in _sys.meta_path):
        _sys.meta_path.insert(0, _InstallOnImport(_name))
