"""Loading a compiled kernel's binary and launching it through the CUDA driver (``libcuda``, by ctypes).

This is what a launch from the persistent cache (``compiled.py``) runs instead of Triton's own launcher, so that
a fresh process neither imports triton nor builds its launcher stub: ``cuModuleLoadData`` and
``cuModuleGetFunction`` once per variant and device, then ``cuLaunchKernel`` per launch, with the arguments
Triton's launcher passes (the kernel's non-constexpr arguments, then a null pointer per scratch buffer).
torch has already loaded ``libcuda`` and made the device's primary context current; where a thread has no
current context yet, the device's primary context is made current, as Triton's launcher does.
"""
from __future__ import annotations

import ctypes
import functools
import threading

__all__ = ["DriverError", "Function", "load"]

# Above this much shared memory a kernel must opt in to more (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), as
# Triton's own loader does.
_DEFAULT_SHARED = 48 * 1024
_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_CACHE_PREFER_SHARED = 2
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_ARG_TYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64}
_lock = threading.Lock()
# Context handle -> its device, as the driver answered once: every launch asks which context is current. The
# contexts torch makes current are primary contexts, whose handles live as long as the process.
_device_of: dict[int, int] = {}


class DriverError(RuntimeError):
    """A CUDA driver call failed (the caller falls back to Triton's JIT)."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
    signatures = {
        "cuCtxGetCurrent": [ctypes.POINTER(p)],
        "cuCtxSetCurrent": [p],
        "cuDeviceGet": [ctypes.POINTER(i), i],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(p), i],
        "cuCtxGetDevice": [ctypes.POINTER(i)],
        "cuModuleLoadData": [ctypes.POINTER(p), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(p), p, ctypes.c_char_p],
        "cuLaunchKernel": [p, u, u, u, u, u, u, u, p, ctypes.POINTER(p), ctypes.POINTER(p)],
        "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
        "cuDeviceGetAttribute": [ctypes.POINTER(i), i, i],
        "cuFuncGetAttribute": [ctypes.POINTER(i), i, p],
        "cuFuncSetAttribute": [p, i, i],
        "cuFuncSetCacheConfig": [p, i],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(text))
        raise DriverError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def _make_current(device_index: int) -> None:
    """Make ``device_index``'s primary context current on this thread unless that device's context already is
    (torch made it so: a launch runs under ``torch.cuda.device``)."""
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        if _device_of.get(ctx.value) == device_index:
            return
        current = ctypes.c_int()
        _check(lib.cuCtxGetDevice(ctypes.byref(current)), "cuCtxGetDevice")
        _device_of[ctx.value] = current.value
        if current.value == device_index:
            return
    device = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Function:
    """A loaded kernel: launch it with :meth:`launch` (grid, stream handle, argument values)."""

    def __init__(self, device_index: int, handle: ctypes.c_void_p, module: ctypes.c_void_p, arg_types: list[str],
                 scratch_args: int, num_warps: int, shared: int):
        self._device_index = device_index
        self._handle = handle
        self._module = module  # kept: the function lives as long as its module (never unloaded)
        self._ctypes = [ctypes.c_uint64 if t.startswith("*") else _ARG_TYPES[t] for t in arg_types]
        self._ctypes += [ctypes.c_uint64] * scratch_args  # null scratch pointers, as Triton's launcher passes
        self._scratch = [0] * scratch_args
        self._threads = 32 * num_warps
        self._shared = shared

    def launch(self, grid: tuple[int, ...], stream: int, values: list[int]) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))
        if grid[0] * grid[1] * grid[2] == 0:
            return  # nothing to run (Triton's launcher skips it too)
        boxed = [kind(value) for kind, value in zip(self._ctypes, [*values, *self._scratch])]
        params = (ctypes.c_void_p * len(boxed))(*[ctypes.addressof(b) for b in boxed])
        _make_current(self._device_index)  # a thread that has not touched the device yet has no context
        _check(_libcuda().cuLaunchKernel(self._handle, grid[0], grid[1], grid[2], self._threads, 1, 1,
                                         self._shared, stream, params, None), "cuLaunchKernel")


def _allow_shared(lib, device_index: int, function: ctypes.c_void_p, shared: int) -> None:
    """Let ``function`` use ``shared`` bytes of shared memory (more than the default 48 KiB): prefer shared memory
    over L1 and raise its dynamic limit to what the device allows beside its static share, as Triton does."""
    device, optin, static = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(optin), _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                    device), "cuDeviceGetAttribute")
    if optin.value < shared:
        raise DriverError(f"the kernel needs {shared} bytes of shared memory, the device allows {optin.value}")
    _check(lib.cuFuncSetCacheConfig(function, _CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig")
    _check(lib.cuFuncGetAttribute(ctypes.byref(static), _CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function),
           "cuFuncGetAttribute")
    _check(lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                  optin.value - static.value), "cuFuncSetAttribute")


def load(device_index: int, cubin: bytes, kernel_name: str, arg_types: list[str], scratch_args: int,
         num_warps: int, shared: int) -> Function:
    """Load ``cubin`` into ``device_index``'s primary context and look up ``kernel_name`` in it."""
    lib = _libcuda()
    with _lock:
        _make_current(device_index)
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        _check(lib.cuModuleGetFunction(ctypes.byref(function), module, kernel_name.encode()), "cuModuleGetFunction")
        if shared > _DEFAULT_SHARED:
            _allow_shared(lib, device_index, function, shared)
    return Function(device_index, function, module, arg_types, scratch_args, num_warps, shared)
