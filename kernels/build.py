"""Filling the compiled cache (``cache.py``): compile kernel variants with Triton and store each one's binary
and launch metadata. Imports triton; a launch never imports this module unless it went through the JIT.

:func:`compile_into` compiles for a named GPU architecture without touching a GPU: Triton's JIT runs its usual
specialisation and compile (``JITFunction.warmup``) against a stand-in driver that names the target, with mock
tensors for the pointer arguments (address 0: 16-byte aligned, as every launch from the cache must be). The
variant is therefore the one a real launch of aligned arguments compiles, bit for bit. :func:`entry_of` turns a
compiled kernel (this one's, or one a real JIT launch returned) into the cache's metadata.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from . import cache

__all__ = ["compile_into", "entry_of"]

# Triton's launcher passes one pointer per scratch buffer the metadata names, after the kernel's arguments.
_SCRATCH_FIELDS = ("global_scratch_size", "profile_scratch_size")
# Above this, Triton's launcher adds a launch attribute (oversized shared memory): left to it.
_SHARED_LIMIT = 228 * 1024


def entry_of(compiled: Any) -> tuple[dict[str, Any], bytes] | None:
    """The cache metadata and binary of a Triton ``CompiledKernel``, or None where a plain ``cuLaunchKernel``
    could not launch it as Triton's launcher does (clusters, cooperative or PDL launches, scratch buffers,
    oversized shared memory): such a variant stays with the JIT."""
    md = compiled.metadata
    cubin = compiled.asm.get("cubin") if hasattr(compiled, "asm") else None
    if not isinstance(cubin, (bytes, bytearray)):
        return None
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False) or any(getattr(md, f, 0) for f in _SCRATCH_FIELDS)
            or getattr(md, "tmem_size", 0) or md.shared > _SHARED_LIMIT):
        return None
    signature = compiled.src.signature
    metadata = dict(name=md.name, kernel=compiled.src.fn.__name__, num_warps=md.num_warps, shared=md.shared,
                    arg_types=[t for t in signature.values() if t != "constexpr"],
                    scratch_args=sum(hasattr(md, f) for f in _SCRATCH_FIELDS),
                    triton_hash=getattr(md, "hash", None), target=str(getattr(md, "target", "")))
    return metadata, bytes(cubin)


class _Target:
    """Triton's active driver, as far as compiling needs it: the target it names, device 0, stream 0."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _compile_one(arch: int, folder: str, kernel: str, meta: dict[str, Any]) -> tuple[str, str]:
    """Compile one variant for ``arch`` into ``folder``; returns (variant name, "compiled" / "cached" /
    "unsupported"). Runs in a worker process: the stand-in driver replaces triton's for that process."""
    variant = cache.variant_name(kernel, meta)
    if cache.read_entry(Path(folder), variant) is not None:
        return variant, "cached"
    import torch
    from triton.runtime.driver import driver

    from .state import jit_kernels
    from .variants import jit_kwargs

    driver.set_active(_Target(arch))
    jit = jit_kernels()
    if jit.interpreted:
        raise RuntimeError("TRITON_INTERPRET is on: the interpreter compiles nothing")
    fn = jit.copy_words if kernel == "copy_words_kernel" else jit.gather_tile
    # The tables' arguments: two int64 table views, the part count (an int, never specialised), dst's bytes.
    compiled = fn.warmup(torch.int64, torch.int64, 3, torch.uint8, grid=(1,), **jit_kwargs(meta, jit.dtypes))
    entry = entry_of(compiled)
    if entry is None:
        return variant, "unsupported"
    cache.write_entry(Path(folder), variant, *entry)
    return variant, "compiled"


def compile_into(arch: int, variants: Iterable[tuple[str, dict[str, Any]]], folder: Path | None = None,
                 jobs: int | None = None, progress=None) -> dict[str, str]:
    """Compile every (kernel, meta) in ``variants`` for ``arch`` (compute capability as ``major * 10 + minor``)
    into ``folder`` (default: this triton's key folder under the cache root), in ``jobs`` worker processes (one
    per core by default, at most 16). Variants already there are kept. Returns each variant's outcome; a
    variant that failed to compile raises."""
    folder = folder or cache.key_dir(arch)
    if folder is None:
        raise RuntimeError("triton is not installed: there is nothing to compile with")
    outcomes: dict[str, str] = {}
    todo = []
    for kernel, meta in variants:  # what is cached already needs no worker
        variant = cache.variant_name(kernel, meta)
        if cache.read_entry(folder, variant) is None:
            todo.append((kernel, meta))
        else:
            outcomes[variant] = "cached"
    variants = todo
    if not variants:
        return outcomes
    jobs = max(1, min(jobs or os.cpu_count() or 1, 16, len(variants) or 1))
    env_interpret = os.environ.pop("TRITON_INTERPRET", None)  # the workers must compile, not interpret
    try:
        # Fresh interpreters: a forked one would inherit this process's triton (interpreted, or with its driver).
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_compile_one, arch, str(folder), kernel, meta) for kernel, meta in variants]
            for future in futures:
                variant, outcome = future.result()
                outcomes[variant] = outcome
                if progress is not None:
                    progress(variant, outcome)
    finally:
        if env_interpret is not None:
            os.environ["TRITON_INTERPRET"] = env_interpret
    return outcomes
