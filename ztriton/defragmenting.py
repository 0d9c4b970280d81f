"""The ZeRO-3 optimizer's flat partition buffer, built on the device.

DeepSpeed's ``deepspeed.runtime.zero.utils.defragment(tensors)`` (called by the stage-3 optimizer on
the ``ds_tensor`` partitions when they are not offloaded) returns one contiguous buffer holding the
tensors back to back and re-points every tensor's ``.data`` into it. It gets there through a pageable
host buffer: device -> host -> device for every byte, seconds per GiB. :func:`defragment` has the
same contract and result, bit for bit, but:

* moves nothing when the tensors already are consecutive views that fill one allocation (what
  ``ztriton.partition`` builds for a module whose params all go to one optimizer sub-group);
* otherwise packs them device to device into a new buffer (the **device** tier: one
  ``kernels.pack(..., fresh=True)``, the biggest first), when free memory holds that buffer beside the partitions;
* otherwise (**evict**) moves just enough whole allocations to host memory to make room, and
  packs the rest device to device: one pinned round trip (the staging spill: one DMA per tensor each
  way, no host copy) for only what must move.

Every input is checked before anything moves. A tensor's ``.data`` changes only once a complete copy
of it exists elsewhere; if the flat buffer cannot be had even so, the evicted tensors are moved back
to the device as far as memory allows (the error says where they are).

Nothing here knows DeepSpeed; ``ztriton.integrations.deepspeed.optimizers`` routes DeepSpeed's call here.
"""
from __future__ import annotations

import itertools
import logging
from typing import Collection, NamedTuple, Sequence

import torch

from ztriton import memory, policy, staging
from ztriton.kernels import Piece, pack, torch_run
from ztriton.memory import alias, format_bytes, kernels_run_on, synchronize, try_empty
from ztriton.policy import Options, Tier

logger = logging.getLogger("ztriton")

__all__ = ["defragment", "is_packed"]


def defragment(tensors: Sequence[torch.Tensor], *, headroom_bytes: int | None = None,
               tier: Tier | str | None = None) -> torch.Tensor:
    """One flat buffer holding ``tensors`` back to back; afterwards each tensor is a 1-D view of it.

    ``tier`` forces "device" or "evict" (default: the policy's pick from free memory minus
    ``headroom_bytes``, logged). Raises before anything moves on mixed dtypes or devices, and
    ``torch.OutOfMemoryError`` if even the evict tier cannot allocate the buffer; every tensor then
    still holds its values (in pinned host memory for the evicted ones, as the message says).
    """
    tensors = _check(tensors)
    forced = policy.parse_tier(tier, allowed=(Tier.DEVICE, Tier.EVICT))
    headroom = Options.of(headroom_bytes=headroom_bytes).headroom_bytes
    if not tensors:
        return torch.empty(0)
    dtype, device = tensors[0].dtype, tensors[0].device
    places = _places(tensors)
    total = places.total
    if is_packed(tensors):
        logger.info("ztriton defragment: %d partitions (%s) already fill one buffer in order; nothing moves",
                    len(tensors), format_bytes(total * tensors[0].element_size()))
        return alias(tensors[0].untyped_storage(), 0, total, dtype, device)

    itemsize = tensors[0].element_size()
    figures = memory.probe_memory(device)
    fits = figures.device_free - headroom >= total * itemsize and forced is not Tier.EVICT
    # The per-storage sizes matter only to eviction: skip walking the storages when the buffer fits.
    storages = [] if fits or forced is Tier.DEVICE else _storages(tensors)
    decision = policy.choose_defragment([nbytes for nbytes, _ in storages] or [0], total * itemsize,
                                        figures.device_free, headroom)
    if forced is not None and forced is not decision.tier:
        evict = tuple(range(len(storages))) if forced is Tier.EVICT else ()
        decision = policy.DefragmentDecision(forced, f"forced by the caller (tier={forced.value!r})",
                                             decision.buffer_bytes, decision.free_bytes, headroom, evict)
    policy.log_decision(f"defragment of {len(tensors)} partitions", decision, figures)

    if decision.tier is Tier.DEVICE:
        flat = try_empty(total, dtype, device, "flat buffer")
        if flat is not None:
            try:
                _copy_into(flat, tensors, places)
            except torch.OutOfMemoryError:  # the kernels' tables: nothing moved, evict as below
                flat = None
        if flat is not None:
            _repoint(flat, tensors, places)
            return flat
        logger.warning("ztriton defragment: the flat buffer (%s) did not fit on %s after all; evicting every "
                       "partition to pinned host memory", format_bytes(total * itemsize), device)
        storages = _storages(tensors)
        decision = policy.DefragmentDecision(Tier.EVICT, "device allocation failed", decision.buffer_bytes,
                                             decision.free_bytes, headroom, tuple(range(len(storages))))
    return _evict_and_pack(tensors, storages, decision.evict, places)


def is_packed(tensors: Sequence[torch.Tensor]) -> bool:
    """True if the tensors are contiguous views, in order and without gaps, of one storage they fill."""
    if not tensors:
        return False
    storage = tensors[0].untyped_storage()
    expected = 0
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr() or \
                t.storage_offset() != expected:
            return False
        expected += t.numel()
    return expected * tensors[0].element_size() == storage.nbytes()


def _check(tensors: object) -> list[torch.Tensor]:
    """Every check of the inputs, before anything moves; returns them as a list."""
    if isinstance(tensors, (torch.Tensor, str, bytes, dict, set, frozenset)) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"tensors must be a list of 1-D tensors (the ZeRO-3 partitions), got {type(tensors).__name__}; "
                        "for one tensor pass [tensor]")
    tensors = list(tensors)
    policy.check_tensors(tensors, lambda i: f"tensors[{i}]")
    for i, t in enumerate(tensors):
        if t.dim() != 1:
            raise ValueError(f"tensors[{i}] is {t.dim()}-D (shape {tuple(t.shape)}); defragment takes 1-D tensors "
                             "(the ZeRO-3 partitions), as DeepSpeed's defragment does: pass t.view(-1)")
    if len({t.dtype for t in tensors}) > 1 or len({t.device for t in tensors}) > 1:
        kinds = sorted({f"{t.dtype} on {t.device}" for t in tensors})
        raise ValueError(f"tensors: defragment needs one dtype and one device, got {kinds}; build one buffer per "
                         "dtype/device")
    return tensors


def _storages(tensors: list[torch.Tensor]) -> list[tuple[int, list[int]]]:
    """The distinct storages the tensors live in, as (bytes, indices of its tensors). No storage object
    is kept: a reference held here would keep an evicted storage allocated."""
    by_ptr: dict[int, tuple[int, list[int]]] = {}
    for i, t in enumerate(tensors):
        storage = t.untyped_storage()
        by_ptr.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1].append(i)
    return list(by_ptr.values())


class _Places(NamedTuple):
    """Each tensor's element count and its offset in the flat buffer, read once: hundreds of partitions, and
    every attribute read of a CUDA tensor costs ~0.2 us on an H200's host."""

    numels: list[int]
    offsets: list[int]

    @property
    def total(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.numels else 0


def _places(tensors: Sequence[torch.Tensor]) -> _Places:
    numels = [t.numel() for t in tensors]
    return _Places(numels, [0, *itertools.accumulate(numels)][:-1])


def _repoint(flat: torch.Tensor, tensors: Sequence[torch.Tensor], places: _Places, away: Collection[int] = ()) -> None:
    """Each tensor becomes its 1-D alias of ``flat``, as DeepSpeed's defragment leaves them. ``away``: the
    indices of tensors evicted to host memory (``set_`` cannot change a tensor's device, ``.data`` can).

    In place with ``set_`` (half the cost of ``t.data = view`` per tensor, and no autograd ``_base``, so
    a later re-point, e.g. DeepSpeed's offload_states, frees flat once every partition has moved)."""
    storage = flat.untyped_storage()
    with torch.no_grad():
        for i, (t, offset, numel) in enumerate(zip(tensors, places.offsets, places.numels)):
            if not away or i not in away:  # stride given: set_ without one keeps a strided tensor's strides
                t.set_(storage, offset, (numel,), (1,))
        for i in away:
            tensors[i].data = alias(storage, places.offsets[i], places.numels[i], flat.dtype, flat.device)


def _copy_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], places: _Places, away: Collection[int] = ()) -> None:
    """Copy ``tensors`` (1-D, :func:`_check`) to their places in ``flat``: the ones on flat's device in turns of
    kernel launches or torch copies (flat is new: :func:`ztriton.kernels.pack`'s ``fresh``), one ``copy_``
    each for the ones in ``away`` (evicted to the pinned spill: asynchronous, and finished when this returns)."""
    numels, offsets = places
    local, at, sizes = tensors, offsets, numels  # the partitions on flat's device: all but the evicted ones
    if away:
        keep = [i for i in range(len(tensors)) if i not in away]
        local, at, sizes = ([column[i] for i in keep] for column in (tensors, offsets, numels))
    if local and kernels_run_on(flat.device):
        # A pack: every partition whole at its offset, and zeros where none is (the evicted ones' places, written
        # below). Cheaper to plan than the same copy as slices: one int column, not a tuple per partition.
        pack(flat, local, at, fresh=True)
    else:
        torch_run(flat, [Piece(memory.unit_strided(t), 0, n, o) for t, n, o in zip(local, sizes, at) if n])
    if away:
        with staging.synchronized(flat.device):
            for i in sorted(away):  # contiguous views of the spill
                if numels[i]:
                    flat.narrow(0, offsets[i], numels[i]).copy_(tensors[i], non_blocking=True)


def _evict_and_pack(tensors: list[torch.Tensor], storages: list[tuple[int, list[int]]], evict: Sequence[int],
                    places: _Places) -> torch.Tensor:
    """Move the storages ``evict`` names to host memory, allocate the flat buffer in the room they leave,
    pack the rest device to device and the evicted ones host to device. If the buffer still does not
    fit (a storage that also holds partitions not in ``tensors`` is not freed by the move, or the
    allocator is fragmented), move every remaining partition out too and try once more. On any
    failure the evicted tensors go back to the device as far as memory allows, and the error says so."""
    dtype, device, total = tensors[0].dtype, tensors[0].device, places.total
    home = {i: t.device for i, t in enumerate(tensors)}
    moved: list[int] = []
    try:
        moved += _move_to_host(tensors, sorted(i for s in evict for i in storages[s][1]))
        flat = try_empty(total, dtype, device, "flat buffer")
        if flat is None:
            moved += _move_to_host(tensors, [i for i, t in enumerate(tensors) if t.device == device])
            flat = try_empty(total, dtype, device, "flat buffer")
        if flat is None:
            raise torch.OutOfMemoryError(
                f"ztriton defragment: cannot allocate the flat buffer ({format_bytes(total * tensors[0].element_size())}) "
                f"on {device} even after moving {len(moved)} partitions to host memory. Free device memory (or "
                "offload params) and retry.")
        away = set(moved)
        _copy_into(flat, tensors, places, away)
        synchronize(device)
    except BaseException as exc:
        where = _move_back(tensors, moved, home)
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"ztriton defragment: every tensor keeps its values; {where}")
        if isinstance(exc, torch.OutOfMemoryError):
            raise torch.OutOfMemoryError(f"{exc} Every tensor keeps its values; {where}") from None
        raise
    _repoint(flat, tensors, places, away)
    return flat


def _move_to_host(tensors: list[torch.Tensor], indices: Sequence[int]) -> list[int]:
    """Copy ``tensors[indices]`` into spill memory and re-point them there once every copy is complete,
    so that their device storages can be freed; returns the indices moved. A failure before the
    re-pointing leaves the tensors as they were.

    The spill (``staging.spill``) is pinned host memory kept by the process for the next call: each
    tensor goes out with one asynchronous DMA. Tensors pointing into it keep it lent, so memory that a
    tensor still lives in after a failure is never lent again; once they alias the flat buffer it is free.
    """
    indices = list(indices)
    if not indices:
        return []
    device = tensors[0].device
    # A strided 1-D partition (small; partitions are contiguous in practice): torch makes it contiguous.
    copies = staging.spill_copies([tensors[i].detach() for i in indices], device, "evicted partitions")
    for i, copy in zip(indices, copies):
        tensors[i].data = copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return indices


def _move_back(tensors: list[torch.Tensor], moved: Sequence[int], home: dict) -> str:
    """After a failure: the moved tensors back to their device, one by one, as far as memory allows."""
    left = []
    for i in moved:
        if tensors[i].device == home[i]:
            continue
        try:
            back = memory.empty(tensors[i].numel(), tensors[i].dtype, home[i], "partition moved back")
            back.copy_(tensors[i].detach())
        except Exception:  # noqa: BLE001 -- out of memory, any class: this one stays in host memory
            left.append(i)
            continue
        tensors[i].data = back
    if not left:
        return "all are on their device again (in new allocations)"
    return (f"{len(left)} of them (tensors {left[:8]}{'...' if len(left) > 8 else ''}) now live in host memory "
            "(their .data is a CPU tensor; move them back with t.data = t.data.to(device))")
