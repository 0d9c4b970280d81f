"""ztriton: Triton kernels for DeepSpeed ZeRO's load-time data movement."""
from pathlib import Path as _Path

# The kernels' sources live in the top-level folder kernels/, installed as ztriton.kernels. In a
# source checkout that is imported without being installed (PYTHONPATH=. on a GPU box), let
# `import ztriton.kernels` find that folder too.
_checkout_kernels = _Path(__file__).resolve().parent.parent / "kernels"
if (_checkout_kernels / "__init__.py").is_file() and not (_Path(__file__).parent / "kernels").exists():
    __path__.append(str(_checkout_kernels.parent))

from ztriton import layout  # noqa: E402

__version__ = "0.1.0"
__all__ = ["layout", "partition", "Partitioned", "flatten_groups", "FlatGroup", "__version__"]

# Entry points that import triton load on first use: triton decides at import time whether its
# kernels run under the interpreter (TRITON_INTERPRET=1), so `import ztriton` must not import it.
# (The ZeRO-3 module is ztriton.partitioning, not ztriton.partition: a submodule named like the
# function would rebind `ztriton.partition` to the module whenever it is imported directly.)
_LAZY = {"partition": "ztriton.partitioning", "Partitioned": "ztriton.partitioning",
         "flatten_groups": "ztriton.flatten", "FlatGroup": "ztriton.flatten"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ztriton' has no attribute {name!r}")
