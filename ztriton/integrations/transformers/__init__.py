"""transformers' ``from_pretrained`` under DeepSpeed ZeRO-3 with ``"partition_backend": "triton"``: shard-on-read.

:func:`install` replaces two methods of ``transformers.PreTrainedModel`` (see :mod:`.patch`):
``_load_pretrained_model`` and ``_initialize_missing_keys``. Each calls transformers' own method unless the
ZeRO-3 config transformers holds has the key, so without it nothing changes. It is done only for a transformers
whose internals are known (read from the sources of 5.17 and 5.24); any other version is left alone with one
log line.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

logger = logging.getLogger("ztriton")

__all__ = ["install", "uninstall", "installed", "unsupported_reason"]

# Versions whose loading path was read: 5.17 (the GPU machine) to 5.24 (CI). Outside this range the internals
# differ or are unknown.
KNOWN_VERSIONS = ((5, 17), (5, 24))

# (owner, name) -> transformers' attribute as found in the class __dict__ (a staticmethod object stays one).
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _version(text: str) -> tuple[int, int] | None:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def unsupported_reason() -> str | None:
    """Why the installed transformers cannot be patched, or None when it can."""
    import transformers

    version = _version(transformers.__version__)
    if version is None or not KNOWN_VERSIONS[0] <= version <= KNOWN_VERSIONS[1]:
        low, high = (".".join(map(str, v)) for v in KNOWN_VERSIONS)
        return f"transformers {transformers.__version__} is outside the versions whose loading path is known ({low} to {high})"
    try:
        from transformers import core_model_loading
        from transformers.integrations import deepspeed as hf_deepspeed
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.loading_report import LoadStateDictInfo
    except ImportError as exc:
        return f"transformers {transformers.__version__} lacks a module ztriton uses ({exc})"
    expected = {
        (PreTrainedModel, "_load_pretrained_model"): ["model", "state_dict", "checkpoint_files", "load_config",
                                                      "expected_keys"],
        (PreTrainedModel, "_initialize_missing_keys"): ["self", "is_quantized"],
        (PreTrainedModel, "_init_weights"): ["self", "module"],
        (PreTrainedModel, "_initialize_weights"): ["self", "module", "is_custom_code"],
        (core_model_loading, "rename_source_key"): ["source_key", "weight_renamings", "weight_converters",
                                                    "base_model_prefix", "meta_state_dict", "reverse"],
        (hf_deepspeed, "_load_state_dict_into_zero3_model"): ["model_to_load", "state_dict", "load_config"],
    }
    for (owner, name), params in expected.items():
        function = getattr(owner, name, None)
        if function is None or list(inspect.signature(function).parameters) != params:
            return f"transformers {transformers.__version__}: {getattr(owner, '__name__', owner)}.{name} is not the one known"
    names = ("WeightConverter", "WeightRenaming", "MergeModulelist", "Concatenate", "dot_natural_key")
    if not all(hasattr(core_model_loading, n) for n in names) or not hasattr(LoadStateDictInfo, "missing_and_mismatched"):
        return f"transformers {transformers.__version__}: core_model_loading lacks one of {list(names)}"
    if not hasattr(hf_deepspeed, "deepspeed_config") or not hasattr(hf_deepspeed, "is_deepspeed_zero3_enabled"):
        return f"transformers {transformers.__version__}: integrations.deepspeed lacks deepspeed_config"
    return None


def install() -> bool:
    """Route ``from_pretrained`` under ZeRO-3 with the key through ztriton. Idempotent. Returns whether it is
    installed (False, with one log line, for a transformers whose internals are not known)."""
    if _ORIGINALS:
        return True
    reason = unsupported_reason()
    if reason is not None:
        from ztriton.integrations.standaside import stand_aside

        stand_aside("transformers", f"{reason}; from_pretrained under ZeRO-3 uses its own loading")
        return False
    from transformers.modeling_utils import PreTrainedModel

    from . import patch

    _wrap(PreTrainedModel, "_load_pretrained_model", patch.load_pretrained_model, static=True)
    _wrap(PreTrainedModel, "_initialize_missing_keys", patch.initialize_missing_keys)
    return True


def uninstall() -> None:
    """Put transformers' methods back."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()


def installed() -> bool:
    return bool(_ORIGINALS)


def _wrap(owner: type, name: str, wrapper: Callable, static: bool = False) -> None:
    raw = owner.__dict__[name]
    _ORIGINALS[(owner, name)] = raw
    original = raw.__func__ if static else raw

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    setattr(owner, name, staticmethod(patched) if static else patched)
