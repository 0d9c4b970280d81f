"""The compiled kernels' persistent cache: each variant's binary and the metadata its launch needs, on disk.

A *variant* is one kernel compiled for one set of constexprs and launch options (``meta``: what ``tables.py``
passes, plain values only). Entries live under ``$ZTRITON_CACHE_DIR`` (default ``~/.cache/ztriton/kernels``) in
one folder per :func:`key`: triton's version, the GPU's architecture and a hash of the kernels' source, all
learnt without importing triton. A variant is two files: ``<variant>.json``, its metadata, and the binary it
names, ``<variant>-<hash of the binary>.cubin``. Each file is written to a temporary name and renamed into place,
the JSON last, so several ranks may fill one folder at once and a reader sees whole entries or none (the JSON
that wins names its own binary); an entry that does not read back whole (missing, truncated, another format) is
a miss, never an error.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "Entry", "cache_root", "key", "key_dir", "read_entry", "source_hash", "triton_version",
           "variant_name", "write_entry"]

logger = logging.getLogger("ztriton")

# Bumped whenever an entry's files or fields change meaning: older folders are then simply not found.
FORMAT = 1
# The metadata a launch reads; an entry lacking any of them is a miss.
_FIELDS = ("name", "kernel", "num_warps", "shared", "arg_types", "scratch_args", "cubin", "cubin_bytes",
           "cubin_sha256")


class Entry(dict):
    """One variant's metadata (the JSON) and its binary (:attr:`binary`)."""

    @property
    def binary(self) -> bytes:
        return self["_binary"]


def cache_root() -> Path:
    """The cache's top folder: ``$ZTRITON_CACHE_DIR`` or ``~/.cache/ztriton/kernels``."""
    configured = os.environ.get("ZTRITON_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ztriton" / "kernels"


@functools.cache
def triton_version() -> str | None:
    """The installed triton's version, read from its distribution's metadata (triton is not imported); None if
    triton is not installed."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def source_hash() -> str:
    """A hash of the jit kernels' source (``copy.py``) and of the kernels' row layout (``descriptor.py``): any
    edit to either makes every entry a miss."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in ("copy.py", "descriptor.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def key(arch: int, version: str | None = None) -> str | None:
    """The folder name of one triton version, GPU architecture (compute capability as ``major * 10 + minor``,
    90 for Hopper) and kernel source; None without triton."""
    version = version or triton_version()
    if version is None:
        return None
    return f"v{FORMAT}-triton{version}-sm{arch}-{source_hash()}"


def key_dir(arch: int, root: Path | None = None) -> Path | None:
    """The folder of :func:`key` under ``root`` (default :func:`cache_root`); None without triton."""
    name = key(arch)
    return None if name is None else (root or cache_root()) / name


def variant_name(kernel: str, meta: dict[str, Any]) -> str:
    """The file stem of one variant: the kernel's name and a hash of its constexprs and launch options."""
    text = json.dumps({k: meta[k] for k in sorted(meta)}, sort_keys=True, separators=(",", ":"))
    return f"{kernel}-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


def write_entry(folder: Path, variant: str, metadata: dict[str, Any], cubin: bytes) -> Path:
    """Store one variant in ``folder`` (created if missing): the binary, then its metadata (with the binary's
    length and hash), each written whole under a temporary name and renamed into place. Returns the JSON's path."""
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(cubin).hexdigest()
    binary = f"{variant}-{digest[:16]}.cubin"
    record = dict(metadata, cubin=binary, cubin_bytes=len(cubin), cubin_sha256=digest, format=FORMAT)
    _write_atomic(folder / binary, cubin)
    path = folder / f"{variant}.json"
    _write_atomic(path, json.dumps(record, sort_keys=True, indent=1).encode())
    return path


def read_entry(folder: Path, variant: str) -> Entry | None:
    """The variant's entry in ``folder``, or None where there is no whole, readable one (a miss)."""
    try:
        record = json.loads((folder / f"{variant}.json").read_bytes())
        if not isinstance(record, dict) or record.get("format") != FORMAT or any(f not in record for f in _FIELDS):
            raise ValueError("not an entry of this format")
        if not isinstance(record["cubin"], str) or "/" in record["cubin"]:
            raise ValueError("the binary's name is not a file name")
        cubin = (folder / record["cubin"]).read_bytes()
        if len(cubin) != record["cubin_bytes"] or hashlib.sha256(cubin).hexdigest() != record["cubin_sha256"]:
            raise ValueError("the binary does not match its metadata")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        logger.debug("ztriton: compiled kernel %s in %s unreadable (%s): compiling it instead", variant, folder, exc)
        return None
    entry = Entry(record)
    entry["_binary"] = cubin
    return entry


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``, never seen half written: a temporary file beside it, flushed, then renamed over."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
