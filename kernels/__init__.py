"""Triton kernels and their launch functions. Installed as ``ztriton.kernels``; knows nothing of ZeRO."""
