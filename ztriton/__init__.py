"""ztriton: Triton kernels for DeepSpeed ZeRO's load-time data movement."""
from ztriton import layout

__version__ = "0.1.0"
__all__ = ["layout", "__version__"]
