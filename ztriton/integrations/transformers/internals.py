"""What the ``from_pretrained`` patch relies on in transformers, found by looking at it, never by its version.

Read from the released sources of transformers 5.12.1, 5.24.0 and 5.25.0 (the patch was first written from 5.17 and
5.24): ``modeling_utils`` (``_load_pretrained_model``, ``_finalize_model_loading``, ``_initialize_missing_keys``,
``initialize_weights``, ``_initialize_weights``, ``_init_weights``, ``LoadStateDictConfig``),
``integrations/deepspeed.py``, ``core_model_loading.py``, ``conversion_mapping.py``, ``utils/loading_report.py`` and
``initialization.py``. 5.24.0 and 5.25.0 are the same in all of these but ``conversion_mapping.py`` (5.25 adds models
and the transforms of fused modules; the patch reads the list it builds, ``load_config.weight_mapping``, so it
follows). 5.12.1 differs in three places, each met by an adapter picked from what the installed transformers has:

* the custom-code flag that ``initialize_weights`` hands to ``_initialize_weights``: ``model.is_custom_code()``
  where ``PreTrainedModel`` has ``is_custom_code`` and ``_initialize_weights``'s parameter is named
  ``is_custom_code`` (5.24, 5.25), ``model.is_remote_code()`` where it has no ``is_custom_code`` and the parameter
  is named ``is_remote_code`` (5.12.1) -- :func:`_custom_code_flag`;
* the loading report ``LoadStateDictInfo``: a ``skipped_pp_keys`` field in 5.24 and 5.25, none in 5.12.1 --
  :func:`_report_extras` (the patch fills every field the class has);
* ``core_model_loading.rename_source_key``: 5.24 and 5.25 add ``reverse`` (default False) after the five
  parameters the patch passes -- accepted when every parameter after those five has a default.

Differences that need no adapter: the ZeRO-3 branch of ``_load_pretrained_model`` reads the checkpoint on every
rank in 5.12.1 and on rank 0 only in 5.24 (the patch replaces that branch), and
``integrations.deepspeed._load_state_dict_into_zero3_model`` copies buffers from the state dict on every rank in
5.12.1 but broadcasts rank 0's in 5.24 (the patch's fallback reads buffers on every rank, which serves both).

Anything else the patch uses is checked here too (signatures, attributes, and the behaviour of the key matching,
the two conversion ops and the init flag, run on tiny inputs); one that is not as read makes :func:`detect` give a
reason, and ztriton stands aside.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Internals", "detect"]

# LoadStateDictInfo's fields the patch fills in every transformers read; the extras (a field of some versions
# only) map to the empty value the patch gives them.
REPORT_FIELDS = frozenset({"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors"})
REPORT_EXTRAS: dict[str, Callable[[], Any]] = {"skipped_pp_keys": set}

# (owner's import path, attribute) -> its parameter names, exactly.
SIGNATURES = {
    ("transformers.modeling_utils:PreTrainedModel", "_load_pretrained_model"):
        ["model", "state_dict", "checkpoint_files", "load_config", "expected_keys"],
    ("transformers.modeling_utils:PreTrainedModel", "_initialize_missing_keys"): ["self", "is_quantized"],
    ("transformers.modeling_utils:PreTrainedModel", "_init_weights"): ["self", "module"],
    ("transformers.integrations.deepspeed", "_load_state_dict_into_zero3_model"):
        ["model_to_load", "state_dict", "load_config"],
}
RENAME_PARAMETERS = ["source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"]
CONFIG_FIELDS = ("device_map", "weight_mapping", "ignore_mismatched_sizes", "hf_quantizer")


@dataclass(frozen=True)
class Internals:
    """The adapters the patch goes through, picked for the installed transformers."""

    custom_code: Callable[[Any], bool]  # model -> the flag initialize_weights hands to _initialize_weights
    report_extras: tuple[str, ...]  # LoadStateDictInfo's fields beyond REPORT_FIELDS

    def loading_info(self, **fields):
        """A ``LoadStateDictInfo`` of ``fields`` (REPORT_FIELDS), its other fields empty."""
        from transformers.utils.loading_report import LoadStateDictInfo

        return LoadStateDictInfo(**fields, **{name: REPORT_EXTRAS[name]() for name in self.report_extras})


class Unknown(Exception):
    """An internal the patch relies on is not the one read (the message says which)."""


def detect() -> Internals | str:
    """The adapters for the installed transformers, or why it cannot be patched."""
    try:
        for (owner, name), parameters in SIGNATURES.items():
            _check_signature(_resolve(owner), name, parameters)
        _check_rename_source_key()
        _check_attributes()
        _check_config()
        _check_key_matching()
        _check_conversion_ops()
        _check_init_flag()
        return Internals(custom_code=_custom_code_flag(), report_extras=_report_extras())
    except ImportError as exc:
        return f"{_version()} lacks a module ztriton uses ({exc})"
    except Unknown as exc:
        return f"{_version()}: {exc}"


def _version() -> str:
    import transformers

    return f"transformers {getattr(transformers, '__version__', '(unknown version)')}"


def _resolve(path: str):
    import importlib

    module, _, attribute = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, attribute) if attribute else owner


def _parameters(function) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError) as exc:
        raise Unknown(f"{getattr(function, '__qualname__', function)} has no signature ({exc})") from exc


def _check_signature(owner, name: str, parameters: list[str]) -> None:
    function = getattr(owner, name, None)
    if not callable(function) or [p.name for p in _parameters(function)] != parameters:
        raise Unknown(f"{getattr(owner, '__name__', owner)}.{name} is not the one known (parameters {parameters})")


def _check_rename_source_key() -> None:
    from transformers import core_model_loading

    function = getattr(core_model_loading, "rename_source_key", None)
    parameters = _parameters(function) if callable(function) else []
    if [p.name for p in parameters[:len(RENAME_PARAMETERS)]] != RENAME_PARAMETERS or any(
            p.default is inspect.Parameter.empty for p in parameters[len(RENAME_PARAMETERS):]):
        raise Unknown(f"core_model_loading.rename_source_key is not the one known (parameters {RENAME_PARAMETERS})")


def _check_attributes() -> None:
    from transformers import core_model_loading, initialization
    from transformers.integrations import deepspeed as hf_deepspeed
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils.loading_report import LoadStateDictInfo

    wanted = {core_model_loading: ("WeightConverter", "WeightRenaming", "MergeModulelist", "Concatenate",
                                   "dot_natural_key"),
              hf_deepspeed: ("deepspeed_config", "is_deepspeed_zero3_enabled"),
              initialization: ("guard_torch_init_functions",),
              PreTrainedModel: ("_initialize_weights",),
              LoadStateDictInfo: ("missing_and_mismatched",)}
    for owner, names in wanted.items():
        absent = [name for name in names if not hasattr(owner, name)]
        if absent:
            raise Unknown(f"{getattr(owner, '__name__', owner)} lacks {absent}")


def _check_config() -> None:
    from transformers.modeling_utils import LoadStateDictConfig

    if not dataclasses.is_dataclass(LoadStateDictConfig) or not isinstance(
            inspect.getattr_static(LoadStateDictConfig, "is_quantized", None), property):
        raise Unknown("LoadStateDictConfig is not the dataclass known (with the property is_quantized)")
    absent = sorted(set(CONFIG_FIELDS) - {f.name for f in dataclasses.fields(LoadStateDictConfig)})
    if absent:
        raise Unknown(f"LoadStateDictConfig lacks the fields {absent}")


def _report_extras() -> tuple[str, ...]:
    """LoadStateDictInfo's fields beyond REPORT_FIELDS: each must be one of REPORT_EXTRAS (whose meaning is known)."""
    from transformers.utils.loading_report import LoadStateDictInfo

    if not dataclasses.is_dataclass(LoadStateDictInfo):
        raise Unknown("utils.loading_report.LoadStateDictInfo is not a dataclass")
    fields = {f.name for f in dataclasses.fields(LoadStateDictInfo)}
    unknown, absent = sorted(fields - REPORT_FIELDS - set(REPORT_EXTRAS)), sorted(REPORT_FIELDS - fields)
    if unknown or absent:
        raise Unknown(f"LoadStateDictInfo's fields are not the ones known (unknown {unknown}, absent {absent})")
    return tuple(sorted(fields & set(REPORT_EXTRAS)))


def _is_custom_code(model) -> bool:
    return model.is_custom_code()


def _is_remote_code(model) -> bool:
    return model.is_remote_code()


def _custom_code_flag() -> Callable[[Any], bool]:
    """The predicate whose value ``initialize_weights`` hands to ``_initialize_weights``, named as its parameter."""
    from transformers.modeling_utils import PreTrainedModel

    names = [p.name for p in _parameters(PreTrainedModel._initialize_weights)]
    has_custom = callable(getattr(PreTrainedModel, "is_custom_code", None))
    if names == ["self", "module", "is_custom_code"] and has_custom:
        return _is_custom_code
    if names == ["self", "module", "is_remote_code"] and not has_custom and callable(
            getattr(PreTrainedModel, "is_remote_code", None)):
        return _is_remote_code
    raise Unknown(f"PreTrainedModel._initialize_weights{tuple(names)} with is_custom_code "
                  f"{'present' if has_custom else 'absent'} is not a combination known")


def _check_key_matching() -> None:
    """``rename_source_key`` names a per-expert checkpoint key by its converter's target and source pattern, and
    ``dot_natural_key`` orders expert indices numerically, as :mod:`.conversion` expects."""
    from transformers.core_model_loading import (Concatenate, MergeModulelist, WeightConverter, dot_natural_key,
                                                 rename_source_key)

    converter = WeightConverter(source_patterns=["experts.*.w1.weight", "experts.*.w3.weight"],
                                target_patterns="experts.gate_up_proj",
                                operations=[MergeModulelist(dim=0), Concatenate(dim=1)])
    if list(converter.source_patterns) != ["experts.*.w1.weight", "experts.*.w3.weight"] or \
            list(converter.target_patterns) != ["experts.gate_up_proj"]:
        raise Unknown(f"WeightConverter keeps its patterns otherwise ({converter.source_patterns} -> "
                      f"{converter.target_patterns})")
    model_keys = {"model.layers.0.mlp.experts.gate_up_proj": True}
    got = rename_source_key("model.layers.0.mlp.experts.10.w3.weight", [], [converter], "model", model_keys)
    if tuple(got) != ("model.layers.0.mlp.experts.gate_up_proj", "experts.*.w3.weight"):
        raise Unknown(f"rename_source_key renames a per-expert key otherwise ({got})")
    keys = ["e.10.w", "e.2.w", "e.1.w"]
    if sorted(keys, key=dot_natural_key) != ["e.1.w", "e.2.w", "e.10.w"]:
        raise Unknown("dot_natural_key does not order indices numerically")


def _check_conversion_ops() -> None:
    """``MergeModulelist`` then ``Concatenate``, chained as ``WeightConverter.convert`` chains them, build
    ``cat(stack(gate), stack(up), dim=1)`` -- the reading :mod:`.conversion` maps them to."""
    import torch
    from transformers.core_model_loading import Concatenate, MergeModulelist

    sources, targets = ["a.*.gate", "a.*.up"], ["a.gate_up"]
    gate = [torch.arange(6.0).view(2, 3) + 10 * e for e in range(2)]
    up = [torch.arange(6.0).view(2, 3) - 10 * e for e in range(2)]
    values: dict = {"a.*.gate": list(gate), "a.*.up": list(up)}
    try:
        for op in (MergeModulelist(dim=0), Concatenate(dim=1)):
            values = op.convert(values, source_patterns=sources, target_patterns=targets)
    except Exception as exc:  # noqa: BLE001 -- any failure means ops that are not the ones read
        raise Unknown(f"MergeModulelist/Concatenate.convert fail on a tiny MoE ({type(exc).__name__}: {exc})") from exc
    want = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
    got = values.get("a.gate_up") if isinstance(values, dict) else None
    got = got[0] if isinstance(got, list) and len(got) == 1 else got
    if not isinstance(got, torch.Tensor) or len(values) != 1 or not torch.equal(got, want):
        raise Unknown("MergeModulelist(0) then Concatenate(1) do not build cat(stack(gate), stack(up), dim=1)")


class _Asked:
    """A truthy ``_is_hf_initialized`` flag that counts the times it was asked."""

    def __init__(self):
        self.times = 0

    def __bool__(self) -> bool:
        self.times += 1
        return True


def _check_init_flag() -> None:
    """Under ``guard_torch_init_functions`` an init function asks a tensor's ``_is_hf_initialized`` and, when it is
    truthy, writes nothing and draws no random number; an unflagged tensor is written (the patch's dry run of
    ``_init_weights`` relies on both)."""
    import torch
    from transformers import initialization

    flagged, unflagged, flag = torch.zeros(4), torch.zeros(4), _Asked()
    flagged._is_hf_initialized = flag
    state = torch.random.get_rng_state()
    with initialization.guard_torch_init_functions():
        torch.nn.init.normal_(flagged)
        torch.nn.init.ones_(unflagged)
    if not flag.times or flagged.any() or not torch.equal(state, torch.random.get_rng_state()):
        raise Unknown("an init function under guard_torch_init_functions does not skip a flagged tensor")
    if not bool((unflagged == 1).all()):
        raise Unknown("an init function under guard_torch_init_functions does not write an unflagged tensor")
