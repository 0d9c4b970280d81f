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
__all__ = ["layout", "__version__"]
