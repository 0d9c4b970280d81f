"""transformers' ``from_pretrained`` under DeepSpeed ZeRO-3 with ``"partition_backend": "triton"``: shard-on-read.

:func:`install` replaces two methods of ``transformers.PreTrainedModel`` (see :mod:`.patch`):
``_load_pretrained_model`` and ``_initialize_missing_keys``. Each calls transformers' own method unless the
ZeRO-3 config transformers holds has the key, so without it nothing changes. It is done only where every internal
the patch relies on is the one read (:mod:`.internals`: the sources of transformers 5.12.1, 5.24.0 and 5.25.0,
found by looking, not by version number); elsewhere ztriton stands aside
(:func:`ztriton.integrations.standaside.stand_aside`) and says so once, on rank 0, when a DeepSpeed config with the
key is read.
"""
from __future__ import annotations

import logging

from ztriton.integrations.hooks import Originals, unwrap_all, wrap

from . import internals

logger = logging.getLogger("ztriton")

__all__ = ["install", "uninstall", "installed", "unsupported_reason"]

# What install() replaced, for uninstall() to put back.
_ORIGINALS: Originals = {}


def unsupported_reason() -> str | None:
    """Why the installed transformers cannot be patched, or None when it can."""
    found = internals.detect()
    return found if isinstance(found, str) else None


def install() -> bool:
    """Route ``from_pretrained`` under ZeRO-3 with the key through ztriton. Idempotent; all or none. Returns
    whether it is installed (False where transformers' internals are not the ones known, or a wrap failed: then
    nothing is replaced and ztriton stands aside)."""
    if _ORIGINALS:
        return True
    found = internals.detect()
    if isinstance(found, str):
        return _stand_aside(found)
    try:
        _install_all(found)
    except Exception as exc:  # noqa: BLE001 -- a wrap that fails means internals ztriton does not know
        uninstall()
        return _stand_aside(f"its methods could not be replaced ({type(exc).__name__}: {exc})")
    from ztriton.integrations.standaside import REASONS

    REASONS.pop("transformers", None)  # a reason from an earlier attempt no longer holds
    return True


def _install_all(found: internals.Internals) -> None:
    from transformers.modeling_utils import PreTrainedModel

    from . import patch

    patch.INTERNALS = found
    wrap(PreTrainedModel, "_load_pretrained_model", patch.load_pretrained_model, _ORIGINALS)
    wrap(PreTrainedModel, "_initialize_missing_keys", patch.initialize_missing_keys, _ORIGINALS)


def _stand_aside(reason: str) -> bool:
    from ztriton.integrations.standaside import stand_aside

    stand_aside("transformers", f"{reason}; from_pretrained under ZeRO-3 uses its own loading")
    return False


def uninstall() -> None:
    """Put transformers' methods back."""
    unwrap_all(_ORIGINALS)


def installed() -> bool:
    return bool(_ORIGINALS)
