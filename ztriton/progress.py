"""Progress bars for long work, under one rule for the whole package.

A bar is shown when its caller wants one (its own switch, e.g. ``load_checkpoint(progress=...)``, and
rank 0 only) and someone can watch it: stderr is a terminal, or the process runs in a notebook.
``ZTRITON_PROGRESS=1`` shows wanted bars anyway (a log file), ``ZTRITON_PROGRESS=0`` never shows one;
so does a caller's ``force``. A bar that is not shown is a no-op with the same methods, so callers never
branch. Bars count bytes (tqdm, a DeepSpeed and transformers dependency; none if it is missing).
"""
from __future__ import annotations

import os
import sys

__all__ = ["Bar", "bar", "visible"]

ENV = "ZTRITON_PROGRESS"


class Bar:
    """``update(nbytes)`` and ``close()``, also as a context manager; a no-op where nothing is shown."""

    def __init__(self, tqdm_bar=None):
        self._bar = tqdm_bar

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def visible(wanted: bool = True, force: bool | None = None) -> bool:
    """Whether a bar the caller ``wanted`` is shown (see the module's rule)."""
    if not wanted:
        return False
    if force is None and os.environ.get(ENV) in ("0", "1"):
        force = os.environ[ENV] == "1"
    if force is not None:
        return force
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def bar(total_bytes: int, desc: str, *, wanted: bool = True, force: bool | None = None) -> Bar:
    """A bar over ``total_bytes`` named ``desc``, or a no-op :class:`Bar` (see :func:`visible`)."""
    if not visible(wanted, force):
        return Bar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return Bar()
    return Bar(tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                    leave=False, dynamic_ncols=True))
