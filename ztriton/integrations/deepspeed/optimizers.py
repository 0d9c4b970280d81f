"""The ZeRO optimizers under ``"partition_backend": "triton"``: the ZeRO-1/2 init-time flatten goes
through :func:`ztriton.flatten_groups`, the stage-3 ``lp_param_buffer`` through :func:`ztriton.defragment`.

Only the optimizer's construction is affected (the engine marks it): the flattens in ``step()`` and
checkpoint loading stay DeepSpeed's.
"""
from __future__ import annotations

import logging
from operator import attrgetter

import torch

from ztriton.integrations.deepspeed import report
from ztriton.integrations.deepspeed.config import param_element_size, preload_on, settings_from, warn_if_no_effect
from ztriton.integrations.deepspeed.state import STATE
from ztriton.kernels.checks import each
from ztriton.layout import NCCL_START_ALIGNMENT_FACTOR, zero12_group_layout

logger = logging.getLogger("ztriton")
_REQUIRES_GRAD = attrgetter("requires_grad")


def engine_configure_zero_optimizer(original, self, *args, **kwargs):
    """``DeepSpeedEngine._configure_zero_optimizer``: marks the optimizer's construction with the settings, and
    under the key starts loading, on the engine's device meanwhile, what the flatten's or the defragment's first
    copy would otherwise load in the caller's thread (:func:`_preload`)."""
    settings = settings_from(self._config)
    if settings.triton:
        _preload(self.device, param_element_size(self._config))
    token = STATE.building_optimizer.set(settings)
    try:
        return original(self, *args, **kwargs)
    finally:
        STATE.building_optimizer.reset(token)


def _preload(device, element_size: int | None = None) -> None:
    """:func:`~ztriton.integrations.deepspeed.config.preload_on` the engine's device while DeepSpeed builds the
    optimizer, where it is an indexed CUDA device (the config's parse started it already where it knew the GPU)."""
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
        preload_on(device, element_size)


def accelerator_available_memory(original, self, *args, **kwargs):
    """While a ZeRO-1/2 optimizer is built under the key, the accelerator reports unbounded free memory:
    DeepSpeed's own check would otherwise move every param to pageable host memory (its CPU fallback);
    ztriton's tiers decide instead, from their own measurements. A context variable, not a patch set and
    unset on the shared accelerator object, so other threads and later engines see the real figure."""
    return 1 << 62 if STATE.spoof_free_memory.get() else original(self, *args, **kwargs)


def zero12_init(original, self, *args, **kwargs):
    """``DeepSpeedZeroOptimizer.__init__``."""
    settings = STATE.building_optimizer.get()
    if settings is None or not settings.triton:
        return original(self, *args, **kwargs)
    report.banner("partition_backend='triton': the ZeRO-1/2 optimizer's init-time flatten goes through "
                  "ztriton.flatten_groups")
    spoof = STATE.spoof_free_memory.set(True)
    summaries: list = []  # each group's line, said once the optimizer is built: its copies are done by then
    flattening = STATE.flattening.set((self, settings, summaries))
    try:
        original(self, *args, **kwargs)
    finally:
        STATE.flattening.reset(flattening)
        STATE.spoof_free_memory.reset(spoof)
        for say in summaries:
            say()


def zero12_flatten(original, self, *args, **kwargs):
    """``DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned``: the init-time call (told apart by the installed
    DeepSpeed's variant, :mod:`.variants`) goes through ztriton; every other call is DeepSpeed's, as it came."""
    owner, settings, summaries = STATE.flattening.get() or (None, None, None)
    call = STATE.variants.flatten_call(self, args, kwargs) if owner is self else None
    if call is None:
        return original(self, *args, **kwargs)
    group = self.real_dp_process_group[call.index]
    mismatch = _zero12_layout_mismatch(call, group)
    if mismatch:
        logger.warning("ztriton: group %d's layout differs from DeepSpeed's (%s); DeepSpeed flattens it", call.index,
                       mismatch)
        return original(self, *args, **kwargs)
    from ztriton.flatten import flatten_groups  # on first use (triton only for a launch)

    options = settings.options
    tensors = call.tensors
    # DeepSpeed re-points every param into the buffer right after (_update_model_bit16_weights), and goes on
    # with host work while the copies run: no re-pointing here, and nothing waits for the device.
    (flat,), clock, peak = report.timed_on_stream(lambda: flatten_groups(
        [tensors], group, parameter_alignment=call.parameter_alignment, headroom_bytes=options.headroom_bytes,
        chunk_bytes=options.chunk_bytes, repoint=False), tensors[0].device)
    summaries.append(report.summary_later(f"ZeRO-1/2 flatten, group {call.index}", clock, tier=flat.tier,
                                          nbytes=flat.flat.numel() * flat.flat.element_size(), peak_bytes=peak,
                                          params=len(tensors)))
    return flat.flat


def _zero12_layout_mismatch(call, group) -> str | None:
    """Why ztriton's layout of this group would differ from DeepSpeed's, or None. Where DeepSpeed recorded the
    offsets and pads it computed, they must be ztriton's."""
    world = torch.distributed.get_world_size(group)
    if call.alignment != NCCL_START_ALIGNMENT_FACTOR * world:
        return f"alignment {call.alignment} is not {NCCL_START_ALIGNMENT_FACTOR} x world size {world}"
    tensors = call.tensors
    numels = each("numel", tensors) if tensors else []  # one read per attribute over thousands of params
    if not tensors or not all(map(_REQUIRES_GRAD, tensors)) or min(numels) <= 0:
        return "a frozen or empty tensor in the group"
    if call.offsets is None:
        return None
    layout = zero12_group_layout(numels, world, element_size=tensors[0].element_size(),
                                 parameter_alignment=call.parameter_alignment)
    if list(layout.offsets) != list(call.offsets) or list(layout.paddings) != list(call.paddings):
        return "offsets or paddings"
    return None


def stage3_defragment(original, *args, **kwargs):
    """The stage-3 optimizer's ``defragment(tensors)`` (where it lives: :mod:`.variants`): its ``lp_param_buffer``."""
    settings = STATE.building_optimizer.get()
    if settings is None or not settings.triton:
        return original(*args, **kwargs)
    tensors = args[0] if args else kwargs["tensors"]
    from ztriton.defragmenting import defragment  # on first use (triton only for a launch)

    report.banner("partition_backend='triton': the ZeRO-3 optimizer's flat partition buffer is built by "
                  "ztriton.defragment")
    first = tensors[0].untyped_storage().data_ptr() if tensors else None
    flat, seconds, peak = report.timed(lambda: defragment(tensors, headroom_bytes=settings.options.headroom_bytes))
    # defragment returns only the buffer (its tier is in the ztriton log): say whether anything moved
    moved = "in place" if flat.numel() == 0 or flat.untyped_storage().data_ptr() == first else "packed"
    report.step_summary("ZeRO-3 lp_param_buffer (defragment)", tier=moved,
                        nbytes=flat.numel() * flat.element_size(), seconds=seconds, peak_bytes=peak,
                        tensors=len(tensors))
    return flat


def engine_do_sanity_check(original, self, *args, **kwargs):
    """``DeepSpeedEngine._do_sanity_check``: every engine passes here once its config is read."""
    out = original(self, *args, **kwargs)
    warn_if_no_effect(settings_from(self._config), self.zero_optimization_stage())
    return out
