"""Replacing a library's functions and putting them back: the one way both integrations do it."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

__all__ = ["Originals", "wrap", "unwrap_all"]

# (owner, name) -> (the attribute to put back, whether the owner itself defined it rather than a base class).
Originals = dict[tuple[Any, str], tuple[Any, bool]]


def wrap(owner: Any, name: str, wrapper: Callable, originals: Originals) -> None:
    """Replace ``owner.name`` by a function that calls ``wrapper(original, *args, **kwargs)``, remembering in
    ``originals`` what :func:`unwrap_all` puts back. A staticmethod stays one."""
    own = not isinstance(owner, type) or name in vars(owner)
    found = inspect.getattr_static(owner, name)
    static = isinstance(found, staticmethod)
    original = getattr(owner, name)

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    originals[(owner, name)] = (found if static else original, own)
    setattr(owner, name, staticmethod(patched) if static else patched)


def unwrap_all(originals: Originals) -> None:
    """Put back every attribute :func:`wrap` replaced, latest first; an inherited one by removing the wrapper."""
    for (owner, name), (original, own) in reversed(list(originals.items())):
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    originals.clear()
