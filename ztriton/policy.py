"""The tiered memory policy: which path a copy takes, in what chunk sizes, with which options.

Decisions are pure functions of numbers (:func:`choose_flatten_tier`, :func:`choose_chunk_bytes`, ...),
so they are tested without a GPU; :func:`ztriton.memory.probe_memory` reads the numbers. Every
decision carries the figures it was made from and is logged with them, so a user can see which tier
ran and why. :class:`Options` holds every default and check of the user's options, once.
"""
from __future__ import annotations

import bisect
import enum
import operator
from operator import attrgetter
import logging
import warnings
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch

from ztriton import memory
from ztriton.kernels.checks import each
from ztriton.layout import is_int
from ztriton.memory import GiB, MemoryInfo, MiB, format_bytes

_LAYOUT, _IS_META = attrgetter("layout"), attrgetter("is_meta")
logger = logging.getLogger("ztriton")

# Memory kept free on the device for everything else (the caching allocator's fragmentation,
# NCCL buffers, kernels' workspaces), unless the caller says otherwise.
DEFAULT_HEADROOM_BYTES = 1 * GiB
# A partition of at most this many params, all contiguous beside the per-rank buffer, is filled by one
# narrow copy per param (DeepSpeed's own way): a kernel plan's validation and tables cost ~0.3 ms of
# host time, several times the copies of a Linear's or a LayerNorm's few params (zero.Init partitions
# every module on its own).
PER_PARAM_COPIES = 8
MIN_CHUNK_BYTES = 1 * MiB
MAX_CHUNK_BYTES = 256 * MiB
# A parameter created inside ``zero.Init`` at least this large is a sharded-init placeholder (under
# ``"partition_backend": "triton"``): the whole tensor is never allocated, each rank generates its slice
# (a placeholder that meets an op it cannot replay is materialised, on the device it stands for).
MAX_SHARDED_INIT_BYTES = 1 * GiB


def check_bytes(name: str, value: object) -> int:
    """``value`` as an int if it is one (numpy integers too; not a bool, not a float) >= 0 (a size in
    bytes), else a ValueError naming ``name``."""
    if not isinstance(value, bool) and not isinstance(value, float):
        try:
            value = operator.index(value)
        except TypeError:
            pass
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    return value


def check_chunk_bytes(value: object) -> int:
    """A staging chunk size the caller asked for: an int of at least 1 MiB. (A huge one is fine here:
    :func:`staging_numels` caps it at the data it stages.)"""
    value = check_bytes("chunk_bytes", value)
    if value < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes={value} is below the minimum of {MIN_CHUNK_BYTES} (1 MiB)")
    return value


def staging_numels(chunk_bytes: int, data_numel: int, itemsize: int) -> list[int]:
    """Element counts of a staging chunk to try, largest first: ``chunk_bytes`` worth, never more than the
    ``data_numel`` elements it stages, then halves of it down to one element. A smaller chunk only costs more
    copies, so an allocation that fails at one size is tried at the next before anything fails."""
    numel = max(1, min(chunk_bytes // itemsize, data_numel))
    sizes = [numel]
    while sizes[-1] > 1:
        sizes.append(sizes[-1] // 2)
    return sizes


# --------------------------------------------------------------------------------------------
# The checks of the tensors an entry point copies: every entry point asks these, before anything moves.


def check_tensor(tensor: object, name: str, hint: str = "") -> None:
    """Raise a TypeError or ValueError naming ``name`` unless ``tensor`` is one whose values an entry point can
    copy: a dense tensor holding values (not on the meta device), read as its memory holds them (no lazy
    conjugate or negation), with strides the copy kernels take. ``hint`` ends a refusal with what the caller
    can do instead (e.g. freeze the param)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} is a {type(tensor).__name__}, not a tensor")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name} has layout {tensor.layout}; only dense (strided) tensors can be copied: make it "
                        f"dense (p.data = p.data.to_dense()){hint}")
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and holds no values; materialise it first (e.g. "
                         f"module.to_empty(device=...), then initialise or load its values){hint}")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{name} is a lazy conjugate or negated view whose memory holds other values than it reads "
                         "as; resolve it first (p.data = p.data.resolve_conj().resolve_neg())")
    memory.check_kernels_take(tensor, name)


def check_tensors(tensors: Sequence[object], name_of: Callable[[int], str], hint: str = "") -> None:
    """:func:`check_tensor` for each of ``tensors`` (``name_of(i)`` names the i-th): one pass over thousands
    of plain contiguous tensors in the common case, the full check only for the others."""
    kinds = set(map(type, tensors))
    # The common case in one pass per attribute (each a C call mapped over the list), no per-tensor Python.
    if all(issubclass(kind, torch.Tensor) for kind in kinds) and set(map(_LAYOUT, tensors)) <= {torch.strided} and \
            not any(map(_IS_META, tensors)) and all(each("is_contiguous", tensors, kinds)) and \
            not any(each("is_conj", tensors, kinds)) and not any(each("is_neg", tensors, kinds)):
        return
    plain, tensor = torch.strided, torch.Tensor
    for i, t in enumerate(tensors):
        if not (isinstance(t, tensor) and t.layout is plain and not t.is_meta and t.is_contiguous() and not t.is_conj()
                and not t.is_neg()):
            check_tensor(t, name_of(i), hint)


@dataclass(frozen=True)
class Options:
    """What the caller may tune, checked when made; ``None`` fields are the policy's to pick.

    ``headroom_bytes``: device memory every decision leaves free (default 1 GiB). ``chunk_bytes``:
    staging chunk size (default: picked from free memory). ``sharded_init_bytes``: parameters created
    inside ``zero.Init`` at least this large are never allocated whole: each rank generates only its slice
    (exact sharded init; default: :func:`choose_sharded_init_bytes`). ``warm_up_kernels``: load the copy
    kernels in a background thread from the moment a DeepSpeed config asks for the key (default off: with the
    compiled cache filled, ``python -m ztriton compile``, a first launch costs milliseconds; without it, Triton's
    JIT costs the first kernel job about half a second in the caller's thread, which the warm-up moves off it).
    The same names make the ``"ztriton"`` section of a DeepSpeed config; ``host_init_bytes`` is read as
    ``sharded_init_bytes`` for one more release (:data:`RENAMED_OPTIONS`).
    """

    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    chunk_bytes: int | None = None
    sharded_init_bytes: int | None = None
    warm_up_kernels: bool = False

    def __post_init__(self):
        # Checked and stored as plain ints (a numpy integer from a config becomes an int).
        object.__setattr__(self, "headroom_bytes", check_bytes("headroom_bytes", self.headroom_bytes))
        if self.chunk_bytes is not None:
            object.__setattr__(self, "chunk_bytes", check_chunk_bytes(self.chunk_bytes))
        if self.sharded_init_bytes is not None:
            object.__setattr__(self, "sharded_init_bytes", check_bytes("sharded_init_bytes", self.sharded_init_bytes))
        if not isinstance(self.warm_up_kernels, (bool, int)) or self.warm_up_kernels not in (0, 1):
            raise ValueError(f"warm_up_kernels must be true or false, got {self.warm_up_kernels!r:.60}")
        object.__setattr__(self, "warm_up_kernels", bool(self.warm_up_kernels))

    @classmethod
    def of(cls, *, headroom_bytes: int | None = None, chunk_bytes: int | None = None,
           sharded_init_bytes: int | None = None, warm_up_kernels: bool | None = None, **renamed) -> Options:
        """Options from keyword arguments where ``None`` means the default; an option's old name
        (:data:`RENAMED_OPTIONS`) is read as its new one, with a FutureWarning (shown to users by default)."""
        sharded_init_bytes = _renamed(renamed, sharded_init_bytes)
        return cls(DEFAULT_HEADROOM_BYTES if headroom_bytes is None else headroom_bytes, chunk_bytes, sharded_init_bytes,
                   False if warm_up_kernels is None else warm_up_kernels)


# Options' old names, read as the new ones for one release: {old: new}.
RENAMED_OPTIONS = {"host_init_bytes": "sharded_init_bytes"}
OPTION_NAMES = tuple(f.name for f in fields(Options))


def _renamed(renamed: dict, sharded_init_bytes: int | None) -> int | None:
    """``sharded_init_bytes`` from its old name in ``renamed`` (the only renamed option); a TypeError for any
    other unknown keyword, a ValueError for both names with different values."""
    unknown = sorted(set(renamed) - set(RENAMED_OPTIONS))
    if unknown:
        raise TypeError(f"Options.of() got unknown option(s) {unknown}; known: {list(OPTION_NAMES)}")
    if "host_init_bytes" not in renamed:
        return sharded_init_bytes
    old = renamed["host_init_bytes"]
    warnings.warn("the option 'host_init_bytes' is now 'sharded_init_bytes' (the size from which zero.Init "
                  "draws a tensor shard by shard); the old name is read until the next release",
                  FutureWarning, stacklevel=3)
    if sharded_init_bytes is not None and old is not None and sharded_init_bytes != old:
        raise ValueError(f"sharded_init_bytes={sharded_init_bytes} and its old name host_init_bytes={old} differ: "
                         "give only sharded_init_bytes")
    return old if sharded_init_bytes is None else sharded_init_bytes


class Tier(str, enum.Enum):
    """How a buffer is built when memory is short (``docs/architecture.md``, "Vocabulary")."""

    DEVICE = "device"
    DISTRIBUTED = "distributed"
    EVICT = "evict"
    HOST = "host"


def parse_tier(tier: Tier | str | None, allowed: Sequence[Tier] = tuple(Tier)) -> Tier | None:
    """The tier a caller forces (``None``: the policy picks), one of ``allowed``."""
    if tier is None:
        return None
    if not isinstance(tier, str) or tier not in allowed and tier not in [t.value for t in allowed]:
        raise ValueError(f"tier must be one of {[t.value for t in allowed]} or None, got {tier!r}")
    return Tier(tier)


def check_tier_fits_world(tier: Tier | None, world_size: int) -> None:
    if tier is Tier.DISTRIBUTED and world_size == 1:
        raise ValueError("tier='distributed' needs a world of more than one rank (world_size=1); initialise "
                         "torch.distributed and pass the data-parallel group=, or use tier='device'")


@dataclass(frozen=True)
class FlattenDecision:
    tier: Tier
    reason: str
    group_bytes: int
    world_size: int
    free_bytes: int
    headroom_bytes: int
    evict_bytes: int = 0  # bytes of params the evict tier moves to pinned host memory


def choose_flatten_tier(group_bytes: int, world_size: int, free_bytes: int, host_bytes: int,
                        headroom_bytes: int = DEFAULT_HEADROOM_BYTES, forced: Tier | str | None = None) -> FlattenDecision:
    """The cheapest tier whose extra device memory fits in ``free_bytes - headroom_bytes``.

    The group's params (``group_bytes``, replicated on every rank) are already resident. Extra
    device memory each tier needs: device M (the flat buffer beside the params); distributed M/W
    (this rank's window, then the flat buffer once the params are freed); evict: none beyond what
    it frees by moving ``evict_bytes`` of params to pinned host memory; host: none on the device.
    """
    for name, value in (("group_bytes", group_bytes), ("free_bytes", free_bytes), ("host_bytes", host_bytes),
                        ("headroom_bytes", headroom_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    budget = free_bytes - headroom_bytes
    window = -(-group_bytes // world_size)
    facts = dict(group_bytes=group_bytes, world_size=world_size, free_bytes=free_bytes, headroom_bytes=headroom_bytes)
    evict = max(0, group_bytes - max(budget, 0))

    if forced is not None:
        tier = Tier(forced)
        check_tier_fits_world(tier, world_size)
        return FlattenDecision(tier, f"forced by the caller (tier={tier.value!r})", **facts,
                               evict_bytes=evict if tier is Tier.EVICT else 0)
    if budget >= group_bytes:
        return FlattenDecision(Tier.DEVICE, f"free {format_bytes(budget)} after headroom holds the flat buffer "
                               f"({format_bytes(group_bytes)})", **facts)
    if world_size > 1 and budget >= window:
        return FlattenDecision(Tier.DISTRIBUTED, f"free {format_bytes(budget)} after headroom is below the flat buffer "
                               f"({format_bytes(group_bytes)}) but holds this rank's 1/{world_size} window ({format_bytes(window)})",
                               **facts)
    if host_bytes >= evict:
        return FlattenDecision(Tier.EVICT, f"free {format_bytes(budget)} after headroom: moving {format_bytes(evict)} of params "
                               f"to pinned host memory makes room for the flat buffer ({format_bytes(group_bytes)})",
                               **facts, evict_bytes=evict)
    return FlattenDecision(Tier.HOST, f"neither the device ({format_bytes(budget)} free after headroom) nor pinned host "
                           f"memory ({format_bytes(host_bytes)}) holds what the other tiers need", **facts)


def choose_chunk_bytes(free_bytes: int, headroom_bytes: int = DEFAULT_HEADROOM_BYTES, requested: int | None = None,
                       buffers: int = 2) -> int:
    """Bytes of one staging chunk when ``buffers`` chunks are in flight at once.

    A requested size wins (it must be >= 1 MiB); otherwise a quarter of what is free after the
    headroom, shared between the buffers, rounded down to whole MiB and kept in [1 MiB, 256 MiB]:
    big enough to run at copy bandwidth, small enough to leave the device usable.
    """
    if requested is not None:
        return check_chunk_bytes(requested)
    share = max(0, free_bytes - headroom_bytes) // (4 * buffers)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, share // MiB * MiB))


def log_decision(what: str, decision, memory: MemoryInfo | None = None) -> None:
    """One INFO line: what was decided, why, and the figures it came from."""
    figures = f" [free {format_bytes(memory.device_free)} of {format_bytes(memory.device_total)} on {memory.device} " \
              f"({memory.source}), host {format_bytes(memory.host_available)}]" if memory else ""
    tier = getattr(decision, "tier", None)
    label = tier.value if isinstance(tier, Tier) else str(decision)
    logger.info("ztriton %s: %s -- %s%s", what, label, getattr(decision, "reason", ""), figures)


def flatten_fallbacks(tier: Tier | str) -> tuple[Tier, ...]:
    """The tiers a ZeRO-1/2 flatten tries, in order, starting from ``tier``: each next one after an
    allocation failure in the one before.

    ``distributed`` is never a fallback: it is collective, so every rank must enter it together, and
    only the choice made up front (from memory figures all ranks agreed on) is the same everywhere; a
    fallback follows one rank's own allocation failure.
    """
    chain = {Tier.DEVICE: (Tier.DEVICE, Tier.EVICT, Tier.HOST),
             Tier.DISTRIBUTED: (Tier.DISTRIBUTED, Tier.EVICT, Tier.HOST),
             Tier.EVICT: (Tier.EVICT, Tier.HOST),
             Tier.HOST: (Tier.HOST,)}
    return chain[Tier(tier)]


def choose_evictions(sizes: Sequence[int], evict_bytes: int) -> list[int]:
    """Indices (ascending) of the tensors of ``sizes`` bytes to move to host memory to free ``evict_bytes``.

    Few tensors and little overshoot: while bytes are still needed, take the smallest tensor that
    covers the rest if there is one, else the largest and go on. The result covers ``evict_bytes``
    (all tensors if together they are smaller), and leaving out its smallest tensor would not.
    """
    if evict_bytes < 0:
        raise ValueError(f"evict_bytes must be >= 0, got {evict_bytes}")
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sizes[{i}] must be >= 0, got {size}")
    remaining = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))  # ascending by size
    chosen, need = [], evict_bytes
    while need > 0 and remaining:
        k = bisect.bisect_left(remaining, need, key=lambda i: sizes[i])
        if k < len(remaining):  # one tensor covers the rest: the smallest such
            chosen.append(remaining.pop(k))
            break
        largest = remaining.pop()
        chosen.append(largest)
        need -= sizes[largest]
    return sorted(chosen)


def choose_sharded_init_bytes(device_free: int, configured: int | None = None) -> int:
    """Size from which a parameter created inside ``zero.Init`` is a sharded-init placeholder (only
    this rank's slice is ever allocated and generated).

    A configured size wins (``"ztriton": {"sharded_init_bytes": N}``; 0 makes every floating parameter a
    placeholder). Otherwise 1 GiB, or an eighth of the free device memory when that is smaller: below
    that, a whole tensor is a transient the device affords, and the ordinary partition path is as exact
    with less bookkeeping.
    """
    if configured is not None:
        return check_bytes("sharded_init_bytes", configured)
    if device_free < 0:
        raise ValueError(f"device_free must be >= 0, got {device_free}")
    return max(MIN_CHUNK_BYTES, min(MAX_SHARDED_INIT_BYTES, device_free // 8))


@dataclass(frozen=True)
class DefragmentDecision:
    """How the ZeRO-3 optimizer's flat partition buffer (``lp_param_buffer``) is built."""

    tier: Tier  # DEVICE (pack beside the partitions) or EVICT (move some partitions to pinned host first)
    reason: str
    buffer_bytes: int
    free_bytes: int
    headroom_bytes: int
    evict: tuple[int, ...] = ()  # indices of the storages to move to pinned host memory


def choose_defragment(storage_bytes: Sequence[int], buffer_bytes: int, free_bytes: int,
                      headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> DefragmentDecision:
    """Pack on the device if the new buffer fits beside the partitions; else evict whole storages.

    ``storage_bytes``: the device allocations the partitions now live in (a storage is freed only when
    every partition in it has moved, so eviction counts whole storages). The evicted ones travel
    device -> pinned host -> device once; the rest are packed device to device.
    """
    if buffer_bytes < 0 or free_bytes < 0 or headroom_bytes < 0:
        raise ValueError(f"sizes must be >= 0, got buffer_bytes={buffer_bytes}, free_bytes={free_bytes}, "
                         f"headroom_bytes={headroom_bytes}")
    budget = free_bytes - headroom_bytes
    facts = dict(buffer_bytes=buffer_bytes, free_bytes=free_bytes, headroom_bytes=headroom_bytes)
    if budget >= buffer_bytes:
        return DefragmentDecision(Tier.DEVICE, f"free {format_bytes(budget)} after headroom holds the flat buffer "
                                  f"({format_bytes(buffer_bytes)}) beside the partitions", **facts)
    evict = choose_evictions(storage_bytes, buffer_bytes - max(budget, 0))
    moved = sum(storage_bytes[i] for i in evict)
    return DefragmentDecision(Tier.EVICT, f"free {format_bytes(budget)} after headroom is below the flat buffer "
                              f"({format_bytes(buffer_bytes)}): {len(evict)} partition storage(s), {format_bytes(moved)}, go through "
                              "pinned host memory", **facts, evict=tuple(evict))
