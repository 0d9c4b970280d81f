"""Environment variables set (or removed) for the duration of a block, then put back as they were."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

__all__ = ["environment"]


@contextlib.contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set each variable of ``values`` (remove it where the value is None) for the duration, then restore the
    previous values (or absence)."""
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            _put(key, value)
        yield
    finally:
        for key, old in saved.items():
            _put(key, old)


def _put(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
