"""transformers' ``from_pretrained`` under ZeRO-3, through ztriton's shard-on-read loader when the key is on.

transformers (5.12.1, 5.17, 5.24.0 and 5.25.0, read from their sources) builds the model under ``zero.Init`` +
``no_init_weights``, then in the ZeRO-3 branch of ``PreTrainedModel._load_pretrained_model`` loads every checkpoint
file (on every rank in 5.12.1 and 5.17; 5.24 and 5.25 read values on rank 0 only, meta tensors elsewhere) and hands
the state dict to ``integrations.deepspeed._load_state_dict_into_zero3_model``, which gathers each module's params
whole on every rank (``GatheredParameters``, modifier rank 0), lets rank 0 copy, and re-partitions by broadcast.
``_finalize_model_loading`` then initialises the missing keys in ``_initialize_missing_keys`` by gathering all of
them at once.

With ``"partition_backend": "triton"`` in the ZeRO-3 config transformers holds, two methods are replaced:

* ``PreTrainedModel._load_pretrained_model``: no state dict is built. Each param's source over checkpoint
  tensors is derived from transformers' own conversion mapping (:mod:`.conversion`) and every rank reads the
  bytes of its own partitions (plus the whole of each unpartitioned tensor: buffers) with
  :func:`ztriton.loading.load_into`. Nothing is gathered or broadcast. Params whose conversion is not a pure
  stack/concatenation go through transformers' own ``_load_state_dict_into_zero3_model``, with a state dict
  holding only their checkpoint tensors. Flags (``_is_hf_initialized``) and the loading report
  (``LoadStateDictInfo``: missing, unexpected and mismatched keys as transformers' non-ZeRO path reports
  them) are what transformers' own ``_finalize_model_loading`` expects; it runs unchanged (tied weights,
  ``_keys_to_ignore_on_load_*``, the report and its errors).
* ``PreTrainedModel._initialize_missing_keys``: one param gathered at a time (see :func:`_initialize_missing`),
  with transformers' own ``_init_weights``, so that the values are those the key-off path gives.

Where those versions differ in what this module uses (the custom-code flag, the report's fields), it goes through
the adapters :mod:`.internals` picked for the installed transformers (:data:`INTERNALS`, set by ``install()``).

Anything else (key off, quantized models, a state dict or ``.bin`` files given, hpZ secondary partitions or NVMe
offload of a partition) is transformers' own code, with one log line where the key asked for ztriton.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch

from ztriton import loading
from ztriton.integrations.deepspeed import report as ds_report
from ztriton.integrations.zero3_loading import tensor_target
from ztriton.loading import Checkpoint, Target

from .conversion import derive_sources
from .internals import Internals

logger = logging.getLogger("ztriton")

FLAG = "_is_hf_initialized"  # transformers' mark of a tensor (or module) that holds its final values

# The adapters for the installed transformers; install() sets them before it replaces a method.
INTERNALS: Internals | None = None


# ---------------------------------------------------------------------------------------------- the key


def key_on() -> bool:
    """Whether transformers sees ZeRO-3 with ``"partition_backend": "triton"`` in its DeepSpeed config.

    transformers keeps the config of the live ``HfDeepSpeedConfig`` (a dict, parsed by accelerate) and hands it
    to ``zero.Init``; the key is read (and validated) as DeepSpeed's own config reading does.
    """
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    from ztriton.integrations.deepspeed.config import settings_from

    if not is_deepspeed_zero3_enabled():
        return False
    config = deepspeed_config()
    return isinstance(config, dict) and settings_from(config).triton


# ---------------------------------------------------------------------------------------------- loading


def load_pretrained_model(original, model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """``PreTrainedModel._load_pretrained_model`` (a staticmethod): transformers' own unless the key is on and
    the load is one ztriton handles."""
    if not key_on():
        return original(model, state_dict, checkpoint_files, load_config, expected_keys)
    reason = _unsupported_reason(model, state_dict, checkpoint_files, load_config, expected_keys)
    if reason is not None:
        logger.info("ztriton: from_pretrained under ZeRO-3 uses transformers' own loading (%s)", reason)
        return original(model, state_dict, checkpoint_files, load_config, expected_keys)
    return _load_shard_on_read(model, checkpoint_files, load_config), None


def _unsupported_reason(model, state_dict, checkpoint_files, load_config, expected_keys) -> str | None:
    if load_config.is_quantized:
        return "a quantized model"
    if state_dict is not None:
        return "a state dict was given"
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return "the checkpoint is not in safetensors files"
    if expected_keys is not None:
        return "expected_keys was given"
    if load_config.device_map is not None and "disk" in load_config.device_map.values():
        return "a device_map with disk offload"
    for name, param in model.named_parameters():
        if getattr(param, "ds_secondary_tensor", None) is not None:
            return f"hpZ secondary partitions ({name})"
        final_location = getattr(getattr(param, "ds_tensor", None), "final_location", None)
        if final_location is not None and getattr(final_location, "name", str(final_location)).lower() == "nvme":
            return f"NVMe offload of partitions ({name})"
    return None


def _load_shard_on_read(model, checkpoint_files: list[str], load_config):
    checkpoint = open_checkpoint(checkpoint_files)
    tensors = model.state_dict(keep_vars=True)  # the params and persistent buffers themselves (flags live on them)
    derived = derive_sources(tensors.keys(), checkpoint.keys(), load_config.weight_mapping, model.base_model_prefix)
    loadable, mismatched = _check_shapes(tensors, derived.sources, checkpoint, load_config.ignore_mismatched_sizes)

    targets, done = [], set()
    for name in loadable:
        tensor = tensors[name]
        if id(tensor) not in done:  # a tensor under two names (tied) is read once
            done.add(id(tensor))
            targets.append(_target(name, tensor, derived.sources[name]))
    # Every target is checked (keys, shapes, dtypes, bounds) before the first byte is written.
    ds_report.banner("partition_backend='triton': from_pretrained under ZeRO-3 reads each rank's own slices of "
                     "the checkpoint into its partitions (ztriton.loading; nothing gathered)")
    report, seconds, peak = ds_report.timed(
        lambda: loading.load_into([t for t, _ in targets], checkpoint, progress=_rank() == 0))
    for _, finish in targets:
        finish()
    loaded = set(loadable)
    ds_report.step_summary("from_pretrained (shard-on-read)", tier="read", nbytes=report.bytes_read,
                           seconds=seconds, peak_bytes=peak, tensors=len(targets), rank=_rank())

    error_msgs = []
    if derived.fallback:
        fallback_errors, fallback_loaded = _load_through_transformers(model, checkpoint, derived.fallback,
                                                                      load_config)
        error_msgs.extend(fallback_errors)
        loaded |= fallback_loaded
    for name in loaded:
        setattr(tensors[name], FLAG, True)
    if load_config.weight_mapping:  # as transformers' ZeRO-3 path: kept for save_pretrained's reverse conversion
        model._weight_conversions = load_config.weight_mapping
    return INTERNALS.loading_info(missing_keys=set(tensors) - loaded, unexpected_keys=set(derived.unexpected),
                                  mismatched_keys=mismatched, error_msgs=error_msgs, conversion_errors={})


def open_checkpoint(checkpoint_files: list[str]) -> Checkpoint:
    """The checkpoint of transformers' resolved files: one file, or the shards of the index next to them."""
    files = [Path(f) for f in checkpoint_files]
    if len(files) == 1:
        return Checkpoint(files[0])
    wanted = {f.resolve() for f in files}
    directory = files[0].parent
    for index in sorted(directory.glob("*.safetensors.index.json")):
        checkpoint = Checkpoint(index)
        if {f.resolve() for f in checkpoint.files()} == wanted:
            return checkpoint
    raise FileNotFoundError(f"the {len(files)} checkpoint shards in {directory} come with no *.safetensors.index.json "
                            "naming exactly them; ztriton reads a sharded checkpoint through its index (set "
                            "\"partition_backend\": \"torch\" to load it with transformers' own code)")


def _check_shapes(tensors: dict[str, torch.Tensor], sources: dict, checkpoint: Checkpoint,
                  ignore_mismatched_sizes: bool) -> tuple[list[str], set]:
    """The model keys to load, and the mismatched ones (transformers' ``(key, checkpoint shape, model shape)``).

    A shape mismatch is an error before anything is read, unless ``ignore_mismatched_sizes`` (then the param is
    initialised, as transformers does)."""
    shapes = {key: checkpoint.info(key).shape for key in checkpoint.keys()}
    loadable, mismatched = [], set()
    for name, tensor in tensors.items():
        source = sources.get(name)
        if source is None:
            continue
        built = tuple(loading.built_shape(source, shapes))
        wanted = _full_shape(tensor)
        if built == wanted:
            loadable.append(name)
        elif ignore_mismatched_sizes:
            mismatched.add((name, built, wanted))
        else:
            keys = loading.leaf_keys(source)
            files = sorted({str(checkpoint.info(key).file) for key in keys})
            raise ValueError(f"from_pretrained: the checkpoint builds {name} with shape {list(built)} from "
                             f"{len(keys)} tensor(s) ({keys[0]!r}{', ...' if len(keys) > 1 else ''} in "
                             f"{', '.join(files)}), but the model's {name} has shape {list(wanted)}; nothing was "
                             "loaded. Fix the config or the checkpoint, or pass ignore_mismatched_sizes=True to "
                             "initialise it instead")
    return loadable, mismatched


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.ds_shape) if hasattr(tensor, "ds_shape") else tuple(tensor.shape)


def _target(name: str, tensor: torch.Tensor, source) -> tuple[Target, Any]:
    """The Target filling ``tensor`` on this rank (a ZeRO-3 param's partition, anything else whole), and what
    to run once it is filled."""
    target, stand_in = tensor_target(name, tensor, source)
    if stand_in is None:
        return target, _nothing
    return target, lambda: tensor.data.copy_(stand_in.view(tensor.shape))


def _nothing() -> None:
    pass


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _load_through_transformers(model, checkpoint: Checkpoint, fallback: dict[str, list[str]], load_config):
    """transformers' own ZeRO-3 loading for the params ztriton cannot map: rank 0 reads only their checkpoint
    tensors, the other ranks get meta tensors (as transformers 5.24 and 5.25 give them; 5.12.1's
    ``_load_state_dict_into_zero3_model`` copies param values on rank 0 only as well), converted and gathered by
    ``_load_state_dict_into_zero3_model``. Returns its error messages and the model keys it loaded.

    A buffer's checkpoint tensors are read on every rank: transformers 5.12.1 and 5.17 copy buffers on every rank
    (from a meta tensor it would fail), 5.24 and 5.25 broadcast rank 0's (the other ranks' values are not used)."""
    from safetensors import safe_open
    from transformers.integrations.deepspeed import _load_state_dict_into_zero3_model

    tensors = model.state_dict(keep_vars=True)
    keys = sorted({key for keys in fallback.values() for key in keys})
    read_everywhere = {key for name, keys in fallback.items() if not hasattr(tensors[name], "ds_tensor")
                       for key in keys}
    state_dict = {}
    for key in keys:
        info = checkpoint.info(key)
        if _rank() == 0 or key in read_everywhere:
            with safe_open(str(info.file), framework="pt", device="cpu") as handle:
                state_dict[key] = handle.get_tensor(key)
        else:
            state_dict[key] = torch.empty(info.shape, dtype=info.dtype, device="meta")
    error_msgs, missing = _load_state_dict_into_zero3_model(model, state_dict, load_config)
    return error_msgs, set(fallback) - set(missing)


# ---------------------------------------------------------------------------------------------- missing keys


def initialize_missing_keys(original, self, is_quantized: bool) -> None:
    """``PreTrainedModel._initialize_missing_keys``: with the key on (ZeRO-3, not quantized), one param gathered
    at a time instead of all missing params at once."""
    if is_quantized or not key_on():
        return original(self, is_quantized)
    return _initialize_missing(self)


class _Probe:
    """A truthy ``_is_hf_initialized`` value that records who asked.

    transformers' init functions (``transformers.initialization``) skip a tensor whose flag is truthy, so a dry
    run of ``_init_weights`` with probes on the pending params writes nothing and draws no random numbers, and
    the order in which the probes are asked is the order in which ``_init_weights`` initialises those params.
    """

    def __init__(self, log: list, tensor: torch.Tensor):
        self.log, self.tensor = log, tensor

    def __bool__(self) -> bool:
        self.log.append(self.tensor)
        return True


@contextlib.contextmanager
def _flags(values: dict[int, tuple[torch.Tensor, Any]]) -> Iterator[None]:
    """Set ``_is_hf_initialized`` on each tensor to the given value for the duration, then put back what was."""
    saved = [(tensor, tensor.__dict__.get(FLAG, _ABSENT)) for tensor, _ in values.values()]
    try:
        for tensor, value in values.values():
            setattr(tensor, FLAG, value)
        yield
    finally:
        for tensor, old in saved:
            if old is _ABSENT:
                tensor.__dict__.pop(FLAG, None)
            else:
                setattr(tensor, FLAG, old)


_ABSENT = object()


@torch.no_grad()
def _initialize_missing(model) -> None:
    """transformers' ``initialize_weights`` (``smart_apply`` of each sub-model's ``_initialize_weights``, children
    first) where a module with pending ZeRO-3 params gathers them one at a time.

    For a module not yet initialised: its pending params are its own and its direct (non-model) children's
    ZeRO-3 params without the flag (key off gathers all of them, and ``_init_weights`` may touch a child's).
    A dry run with probes (:class:`_Probe`) initialises the module's other tensors (buffers) and tells which
    pending params ``_init_weights`` initialises, in order; then each is gathered alone (modifier rank 0, its
    values broadcast on exit) while ``_init_weights`` runs with every other tensor flagged, so each call writes
    that one param and draws the random numbers key off draws for it, in the same order. Own params the dry run
    did not see (an ``_init_weights`` writing without transformers' init functions) get the same treatment
    after, in registration order.
    """
    import deepspeed
    from transformers import initialization
    from transformers.modeling_utils import PreTrainedModel

    is_custom_code = INTERNALS.custom_code(model)  # the flag initialize_weights hands to _initialize_weights

    def visit(module: torch.nn.Module, owner) -> None:
        for child in module.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        if getattr(module, FLAG, False):
            return
        own = [p for p in module.parameters(recurse=False)]
        if is_custom_code and all(getattr(t, FLAG, False) for t in own + [b for b in module.buffers(recurse=False)
                                                                            if b is not None]):
            module._is_hf_initialized = True  # transformers' rule for remote code, as _initialize_weights has it
            return
        children = [p for child in module.children() if not isinstance(child, PreTrainedModel)
                    for p in child.parameters(recurse=False)]
        pending = {id(p): p for p in own + children if hasattr(p, "ds_tensor") and not getattr(p, FLAG, False)}
        if not pending:
            owner._initialize_weights(module, is_custom_code)
            return
        asked: list[torch.Tensor] = []
        with _flags({key: (p, _Probe(asked, p)) for key, p in pending.items()}):
            owner._init_weights(module)  # writes the unflagged non-ZeRO tensors (buffers) only
        order = list({id(p): p for p in asked if id(p) in pending}.values())
        seen = {id(p) for p in order}
        order += [p for p in own if id(p) in pending and id(p) not in seen]
        # everything the dry run initialised stays as it is now
        others = {id(t): t for t in list(module.buffers()) + list(module.parameters())
                  if not getattr(t, FLAG, False) and id(t) not in pending}
        for param in order:
            hold = {key: (t, True) for key, t in {**pending, **others}.items() if key != id(param)}
            with _flags(hold), deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                owner._init_weights(module)
        module._is_hf_initialized = True

    with initialization.guard_torch_init_functions():
        visit(model, model)
