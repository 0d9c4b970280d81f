"""safetensors checkpoints: every header parsed and checked up front, then byte ranges read on demand.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the first
byte after the header) plus an optional ``"__metadata__"`` of strings, then the data, row-major.
A checkpoint is one such file, a directory of them, or a ``*.safetensors.index.json`` whose
``"weight_map"`` names the file of each tensor (the layout ``save_pretrained`` writes).

We parse the format ourselves (the ``safetensors`` package maps whole files): the loader only needs
each tensor's absolute byte offset, and every check a corrupted or truncated file could fail is made
here, when the checkpoint is opened, so that a load never starts on a file it cannot finish.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, NamedTuple

import torch

from ztriton.layout import is_int

__all__ = ["Checkpoint", "CheckpointError", "TensorInfo", "SAFETENSORS_DTYPES", "read_into"]

INDEX_SUFFIX = ".safetensors.index.json"
HEADER_LENGTH_BYTES = 8
# The safetensors reference implementation refuses headers above 100 MB; a larger length is far more
# likely a corrupted first word than a real header, and would make us read a huge "JSON" blob.
MAX_HEADER_BYTES = 100 * 1000 * 1000


class CheckpointError(ValueError):
    """A checkpoint (or what a load asks of it) is unusable; the message names the file and tensor."""


def _dtype_table() -> dict[str, torch.dtype]:
    """safetensors dtype names -> torch dtypes, for those this torch has (fp8/uint names are recent)."""
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
             "U8": "uint8", "BOOL": "bool", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
             "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
             "F8_E8M0": "float8_e8m0fnu"}
    return {st: getattr(torch, name) for st, name in names.items() if hasattr(torch, name)}


SAFETENSORS_DTYPES: dict[str, torch.dtype] = _dtype_table()


class TensorInfo(NamedTuple):
    """Where one checkpoint tensor lives: ``offset`` is the absolute byte offset of its data in ``file``."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int



def _parse_entry(path: Path, name: str, entry: object,
                 data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """Check one header entry; return (dtype, shape, begin, end) with offsets relative to the data."""
    where = f"tensor {name!r} in {path}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is {type(entry).__name__}, not an object; the file is corrupted")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: header entry lacks {missing}; the file is corrupted")
    st_dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if st_dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: unknown or unsupported dtype {st_dtype!r} (this torch knows "
                              f"{sorted(SAFETENSORS_DTYPES)}); convert the checkpoint or upgrade torch")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints; the file is corrupted")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end; "
                              "the file is corrupted")
    begin, end = offsets
    dtype = SAFETENSORS_DTYPES[st_dtype]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}) hold {end - begin} bytes but shape "
                              f"{tuple(shape)} of {st_dtype} needs {expected}; the file is corrupted")
    if end > data_bytes:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}) run past the end of the data "
                              f"({data_bytes} bytes after the header); the file is truncated")
    return dtype, tuple(shape), begin, end


def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check one safetensors file's header: its tensors and its ``__metadata__``."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_LENGTH_BYTES)
            if len(head) < HEADER_LENGTH_BYTES:
                raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (the 8-byte header "
                                      "length is missing); the file is truncated or not safetensors")
            length = int.from_bytes(head, "little")
            if length > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + length > size:
                raise CheckpointError(f"{path}: header length {length} runs past the end of the file ({size} "
                                      "bytes); the file is truncated or not safetensors")
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint file {path} is a directory") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the header is not valid JSON ({exc}); the file is corrupted or not "
                              "safetensors") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(header).__name__}, not an object; the file "
                              "is corrupted or not safetensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings; the file is corrupted")
    data_start = HEADER_LENGTH_BYTES + length
    parsed = {name: _parse_entry(path, name, entry, size - data_start) for name, entry in header.items()}
    _check_disjoint(path, parsed)
    tensors = {name: TensorInfo(path, dtype, shape, data_start + begin, end - begin)
               for name, (dtype, shape, begin, end) in parsed.items()}
    return tensors, metadata


def _check_disjoint(path: Path, parsed: dict) -> None:
    """No two tensors may share data bytes (empty tensors share none)."""
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in parsed.items() if end > begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} (bytes [{b0}, {e0})) and {n1!r} (bytes [{b1}, {e1})) "
                                  "overlap; the file is corrupted")


def _index_files(index: Path) -> dict[str, Path]:
    """The ``weight_map`` of an index json: tensor name -> file (relative to the index's folder)."""
    try:
        text = index.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint index {index} does not exist") from None
    try:
        weight_map = json.loads(text)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index (JSON with a \"weight_map\" object): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: \"weight_map\" must map tensor names to file names")
    return {name: index.parent / file for name, file in weight_map.items()}


class Checkpoint:
    """A safetensors checkpoint: a ``.safetensors`` file, a directory, or a ``*.safetensors.index.json``.

    A directory holding exactly one index json is read through it; otherwise every ``*.safetensors``
    in it is one part. Every header is parsed and checked here; a tensor named twice is an error.
    """

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"checkpoint must be the path (str or os.PathLike) of a .safetensors file, a directory of "
                            f"them or a *.safetensors.index.json, or a ztriton.loading.Checkpoint; got "
                            f"{type(path).__name__}")
        if not os.fspath(path):  # Path("") is the working directory: never what was meant
            raise ValueError("checkpoint is an empty path; give a .safetensors file, a directory of them, or a "
                             "*.safetensors.index.json")
        self.path = Path(path)
        files, expected = self._files()
        self._tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[Path, dict[str, str]] = {}
        owner: dict[str, Path] = {}
        for file in files:
            if expected is not None and not file.is_file():
                names = sorted(name for name, f in expected.items() if f == file)
                raise CheckpointError(f"{self.path}: the index puts {len(names)} tensors ({names[0]!r}, ...) in "
                                      f"{file}, which does not exist; the checkpoint is incomplete")
            tensors, self.metadata[file] = _read_header(file)
            for name, info in tensors.items():
                if expected is not None and expected.get(name) != file:
                    continue  # the index puts this name elsewhere (or nowhere): it is not this file's
                if name in owner:
                    raise CheckpointError(f"tensor {name!r} is stored twice, in {owner[name]} and {file}; "
                                          "remove one copy")
                owner[name] = file
                self._tensors[name] = info
        if expected is not None:
            lost = sorted(set(expected) - set(self._tensors))
            if lost:
                raise CheckpointError(f"{self.path}: the index puts tensor {lost[0]!r} in {expected[lost[0]]}, "
                                      f"whose header does not hold it ({len(lost)} such tensors); the index and "
                                      "the files disagree")

    def _files(self) -> tuple[list[Path], dict[str, Path] | None]:
        """The files to read and, for an index, the file of each tensor."""
        path = self.path
        if path.is_dir():
            indexes = sorted(path.glob("*" + INDEX_SUFFIX))
            if len(indexes) == 1:
                path = indexes[0]
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise CheckpointError(f"checkpoint directory {path} holds no *.safetensors file")
                return files, None
        if path.name.endswith(INDEX_SUFFIX):
            expected = _index_files(path)
            return sorted(set(expected.values())), expected
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist (give a .safetensors file, a directory of "
                                  "them, or a *.safetensors.index.json)")
        return [path], None

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def info(self, key: str) -> TensorInfo:
        """(file, torch dtype, shape, absolute byte offset, nbytes) of tensor ``key``."""
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(f"tensor {key!r} is not in checkpoint {self.path}") from None

    def files(self) -> list[Path]:
        return sorted({info.file for info in self._tensors.values()})

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._tensors)} tensors)"


def read_into(fd: int, view: memoryview, offset: int, path: Path | str) -> None:
    """Fill ``view`` with the file's bytes from ``offset`` (``os.preadv`` straight into the buffer).

    The header was checked against the file's size when it was opened, so a short read means the
    file changed since: an error naming it.
    """
    done, total = 0, len(view)
    while done < total:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CheckpointError(f"{path}: reading bytes [{offset}, {offset + total}) hit the end of the file "
                                  f"after {done} bytes; the file was truncated after it was opened")
        done += got


def open_files(files: Iterable[Path]) -> dict[Path, int]:
    """Read-only descriptors of ``files``; on failure the ones already opened are closed."""
    fds: dict[Path, int] = {}
    try:
        for file in files:
            fds[file] = os.open(file, os.O_RDONLY)
    except OSError as exc:
        close_files(fds)
        raise CheckpointError(f"cannot open checkpoint file {exc.filename}: {exc.strerror}") from None
    return fds


def close_files(fds: dict[Path, int]) -> None:
    for fd in fds.values():
        os.close(fd)
