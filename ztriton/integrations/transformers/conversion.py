"""How each model tensor is built from checkpoint tensors, derived from transformers' own conversion mapping.

transformers 5 renames checkpoint keys (``WeightRenaming``) and fuses some of them (``WeightConverter`` with a
chain of ``ConversionOps``): Mixtral's per-expert ``block_sparse_moe.experts.E.w1/w3.weight`` become
``mlp.experts.gate_up_proj = stack_E(cat(w1_E, w3_E, dim=0))`` through ``MergeModulelist(0), Concatenate(1)``.
``from_pretrained`` hands the list it built (``get_model_conversion_mapping``) to the loader as
``load_config.weight_mapping``; this module reads that same list and turns it into ztriton's declarative
sources (``Key`` / ``Stack`` / ``Concat``) so that a rank's partition window can be resolved to byte ranges of
the checkpoint without materialising the fused tensor.

Keys are matched exactly as ``core_model_loading.convert_and_load_state_dict_in_model`` matches them (its
``rename_source_key``, the same fallback to the unrenamed key, checkpoint keys in ``dot_natural_key`` order, which
is the order ``MergeModulelist`` stacks them in); that function is the same in this respect in transformers 5.12.1,
5.24.0 and 5.25.0 (read from their sources), and :mod:`.internals` checks that the installed one still behaves so.
Only ops that rearrange bytes are mapped:
``MergeModulelist`` -> ``Stack`` and ``Concatenate`` -> ``Concat``, interpreted as their ``convert`` does (see
``_apply``). Any other op (``Chunk``, ``Transpose``, ``PermuteForRope``, a quantizer's, a model's own) leaves the
param to transformers' own path: its source is reported in ``DerivedSources.fallback`` and one line is logged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ztriton.loading import Concat, Key, Stack

logger = logging.getLogger("ztriton")

__all__ = ["DerivedSources", "derive_sources"]


@dataclass
class DerivedSources:
    """What a checkpoint holds for a model, in model names (state-dict keys after transformers' renames).

    ``sources``: model key -> how the full tensor is built from checkpoint tensors (ztriton loads these).
    ``fallback``: model key -> the checkpoint keys feeding it, for params whose conversion ztriton cannot map
    (transformers' own path loads them). ``unexpected``: checkpoint keys (renamed) that match no model key,
    named as transformers names them in its loading report.
    """

    sources: dict = field(default_factory=dict)
    fallback: dict[str, list[str]] = field(default_factory=dict)
    unexpected: set[str] = field(default_factory=set)


class _Unmappable(Exception):
    """A conversion op that is not a pure rearrangement of checkpoint bytes (the message names it)."""


def derive_sources(model_keys: Iterable[str], checkpoint_keys: Iterable[str], weight_mapping: Sequence | None,
                   base_model_prefix: str | None) -> DerivedSources:
    """Sources of every model key the checkpoint provides, following ``weight_mapping`` (transformers' list of
    ``WeightRenaming`` / ``WeightConverter``). Model keys the checkpoint does not provide are absent (missing)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    weight_mapping = list(weight_mapping or [])
    renamings = [entry for entry in weight_mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in weight_mapping if isinstance(entry, WeightConverter)]
    pattern_to_converter = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    # rename_source_key only asks ``.get(key) is not None`` of the model's state dict
    model_index = {key: True for key in model_keys}

    derived = DerivedSources()
    identity: dict[str, str] = {}  # model key -> checkpoint key
    fused: dict[str, tuple] = {}  # model key -> (converter, {source pattern: [checkpoint keys in order]})
    for original in sorted(checkpoint_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(original, renamings, converters, base_model_prefix, model_index)
        if renamed not in model_index and original in model_index:
            # as transformers does: the key should not have been renamed, only given the model prefix
            renamed, pattern = rename_source_key(original, [], [], base_model_prefix, model_index)
        if renamed not in model_index:
            if pattern is not None:  # transformers names every target of the converter unexpected
                targets = pattern_to_converter[pattern].target_patterns
                derived.unexpected.update(renamed.replace(targets[0], target) for target in targets)
            else:
                derived.unexpected.add(renamed)
        elif pattern is None:
            identity.setdefault(renamed, original)  # a duplicate: transformers keeps the first one as well
        else:
            converter, collected = fused.setdefault(renamed, (pattern_to_converter[pattern], {}))
            collected.setdefault(pattern, []).append(original)

    for name, original in identity.items():
        derived.sources[name] = Key(original)
    for name, (converter, collected) in fused.items():
        try:
            derived.sources[name] = _apply(converter, collected)
        except _Unmappable as exc:
            derived.fallback[name] = [key for keys in collected.values() for key in keys]
            logger.info("ztriton: %s is loaded by transformers' own ZeRO-3 path (gathered): its conversion %s is "
                        "not a pure stack/concatenation of checkpoint tensors", name, exc)
    return derived


def _apply(converter, collected: dict[str, list[str]]):
    """The Source that ``converter.convert`` would build from ``collected`` (source pattern -> checkpoint keys).

    Mirrors the ops' ``convert``: ``MergeModulelist(dim)`` stacks each pattern's list (keyed by the single target
    when it is the only pattern, else by its pattern); ``Concatenate(dim)`` concatenates in the order of the
    converter's source patterns, skipping absent ones, under the single target. The result must be one tensor.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist

    targets = list(converter.target_patterns)
    values: dict[str, object] = {pattern: [Key(key) for key in keys] for pattern, keys in collected.items()}
    for op in converter.operations:
        if len(targets) != 1:
            raise _Unmappable(f"{type(op).__name__} (splits into {len(targets)} targets)")
        # exact types: a subclass may convert differently
        if type(op) is MergeModulelist:
            values = {targets[0] if len(values) == 1 else pattern: Stack(tuple(value), op.dim) if isinstance(value, list)
                      else value for pattern, value in values.items()}
        elif type(op) is Concatenate:
            parts: list = []
            for pattern in converter.source_patterns:
                if pattern in values:
                    value = values.pop(pattern)
                    parts.extend(value if isinstance(value, list) else [value])
            values = {targets[0]: Concat(tuple(parts), op.dim)}
        else:
            raise _Unmappable(repr(op))
    if len(values) != 1:
        raise _Unmappable(f"{converter!r} (its ops leave {len(values)} tensors)")
    value = next(iter(values.values()))
    if isinstance(value, list):
        if len(value) != 1:
            raise _Unmappable(f"{converter!r} (its ops leave a list of {len(value)} tensors)")
        value = value[0]
    return value
