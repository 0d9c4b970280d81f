"""DeepSpeed ZeRO layouts as pure arithmetic: which flat elements go where. No tensors are moved here.

Two layouts, both reproduced exactly from DeepSpeed 0.19.8 (``docs/architecture.md``; the docstrings name the code they mirror):

* ZeRO-3 (``partition_parameters.Init._partition_param``): a parameter of ``numel`` elements is padded
  to a multiple of the partition world size ``W`` and cut into ``W`` equal slices; rank ``r`` owns
  flat elements ``[r * psize, (r + 1) * psize)`` of the row-major flattening.
* ZeRO-1/2 (``stage_1_and_2.DeepSpeedZeroOptimizer.__init__``): the trainable, non-empty params of
  an optimizer group, optionally reordered round robin, are laid end to end with optional 16-byte
  alignment pads between them and a zero tail up to a multiple of ``2 * W`` elements; each rank owns
  ``total // W`` elements of that flat buffer.

Every size is a Python int, so numels above 2**31 are exact.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "NCCL_START_ALIGNMENT_FACTOR",
    "Zero3Slice",
    "zero3_slice",
    "FlatGroupLayout",
    "zero12_group_layout",
    "round_robin_order",
    "param_alignment",
]

# More params than any group holds (round_robin_order lists them): a bound on a count, not a size.
MAX_PARAMS = 2**31

# DeepSpeedZeroOptimizer.nccl_start_alignment_factor: "4-byte alignment / sizeof(fp16) = 2".
NCCL_START_ALIGNMENT_FACTOR = 2


def is_int(value: object) -> bool:
    """A Python int that is not a bool (``True`` would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_world(world_size: int) -> None:
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _check_rank(rank: int, world_size: int) -> None:
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def _check_numel(name: str, numel: int) -> None:
    if not is_int(numel) or numel < 0:
        raise ValueError(f"{name} must be an int >= 0, got {numel!r}")


def _check_flag(name: str, value: object) -> None:
    """A bool (or 0 / 1, as configs write them); anything else would be read as truthy or not."""
    if not isinstance(value, int) or value not in (0, 1):
        raise ValueError(f"{name} must be a bool, got {value!r:.60}")


def _check_list(name: str, value: object) -> None:
    """A list or tuple (a lone value, a string or None would be iterated or fail unnamed)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list or tuple, got {type(value).__name__} {value!r:.60}")


@dataclass(frozen=True)
class Zero3Slice:
    """How one ZeRO-3 parameter of ``numel`` elements is split over ``world_size`` ranks."""

    numel: int
    world_size: int

    # Cached: a partition's planning asks each of these many times per param (cached_property writes the
    # instance's __dict__ directly, which a frozen dataclass allows).
    @functools.cached_property
    def padding(self) -> int:
        """Elements appended so that every rank gets the same count (``(W - numel % W) % W``)."""
        return (self.world_size - self.numel % self.world_size) % self.world_size

    @functools.cached_property
    def aligned_numel(self) -> int:
        """DeepSpeed's ``param.ds_numel_aligned``."""
        return self.numel + self.padding

    @functools.cached_property
    def partition_numel(self) -> int:
        """DeepSpeed's ``param.ds_tensor.ds_numel``: elements each rank stores."""
        return self.aligned_numel // self.world_size

    def rank_start(self, rank: int) -> int:
        """First flat element of the parameter that ``rank`` owns (may lie past ``numel``)."""
        _check_rank(rank, self.world_size)
        return rank * self.partition_numel

    def valid_numel(self, rank: int) -> int:
        """Length of the prefix of ``rank``'s partition that holds real values; the rest is padding."""
        start = self.rank_start(rank)
        return max(0, min(self.partition_numel, self.numel - start))


def zero3_slice(numel: int, world_size: int) -> Zero3Slice:
    """The ZeRO-3 slice of a parameter of ``numel`` elements over ``world_size`` ranks."""
    _check_numel("numel", numel)
    _check_world(world_size)
    return Zero3Slice(numel, world_size)


def param_alignment(element_size: int, enabled: bool) -> int:
    """Elements each param is padded to with ``parameter_alignment``: 16 bytes' worth, else 1."""
    if not is_int(element_size) or element_size < 1:
        raise ValueError(f"element_size must be an int >= 1 (bytes), got {element_size!r}")
    _check_flag("enabled", enabled)
    return 16 // math.gcd(16, element_size) if enabled else 1


def round_robin_order(count: int, world_size: int) -> list[int]:
    """``p[0::W] + p[1::W] + ... + p[W-1::W]`` as indices, DeepSpeed's ``_round_robin_reorder``."""
    _check_numel("count", count)
    if count > MAX_PARAMS:  # a list of that many indices could not be built
        raise ValueError(f"count={count} is more params than a group can hold (at most {MAX_PARAMS})")
    _check_world(world_size)
    # Starts at or past `count` contribute nothing: a huge world costs no loop.
    return [i for start in range(min(world_size, count)) for i in range(start, count, world_size)]


@dataclass(frozen=True)
class FlatGroupLayout:
    """Where each param of one ZeRO-1/2 optimizer group sits in the group's flat buffer.

    ``order[k]`` is the index, into the numels handed to :func:`zero12_group_layout`, of the k-th
    param in the flat buffer; ``offsets[k]`` its first element; ``numels[k]`` its size;
    ``paddings[k]`` the zeros that follow it (DeepSpeed's ``round_robin_bit16_padding``). After the
    last param come ``tail_padding`` zeros, so that ``total_numel`` is a multiple of ``2 * W``.
    """

    order: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    paddings: tuple[int, ...]
    tail_padding: int
    world_size: int

    @property
    def packed_numel(self) -> int:
        """Elements up to the end of the last param and its padding (DeepSpeed's ``padded_group_numel``)."""
        if not self.order:
            return 0
        return self.offsets[-1] + self.numels[-1] + self.paddings[-1]

    @property
    def total_numel(self) -> int:
        """Elements of the flat buffer, tail padding included."""
        return self.packed_numel + self.tail_padding

    @property
    def partition_numel(self) -> int:
        """Elements of each rank's partition of the flat buffer."""
        return self.total_numel // self.world_size

    def rank_window(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the flat buffer that ``rank`` owns."""
        _check_rank(rank, self.world_size)
        return rank * self.partition_numel, (rank + 1) * self.partition_numel


def zero12_group_layout(
    numels: Sequence[int],
    world_size: int,
    *,
    element_size: int,
    trainable: Sequence[bool] | None = None,
    round_robin: bool = False,
    parameter_alignment: bool = False,
) -> FlatGroupLayout:
    """The flat layout DeepSpeed gives one optimizer group of params with these ``numels``.

    Params that are frozen (``trainable[i]`` false) or empty are left out, as DeepSpeed's
    ``is_optimized_parameter`` does. ``round_robin`` is ``round_robin_gradients``;
    ``parameter_alignment`` pads every param but the last to 16 bytes.
    """
    _check_list("numels", numels)
    # One pass for the common case (thousands of params); the loops below only name the culprit.
    if not (set(map(type, numels)) <= {int} and min(numels, default=0) >= 0):
        for i, numel in enumerate(numels):
            _check_numel(f"numels[{i}]", numel)
    _check_world(world_size)
    if trainable is not None:
        _check_list("trainable", trainable)
        if len(trainable) != len(numels):
            raise ValueError(f"trainable has {len(trainable)} entries but numels has {len(numels)}")
        if not set(map(type, trainable)) <= {bool}:
            for i, flag in enumerate(trainable):
                _check_flag(f"trainable[{i}]", flag)
    _check_flag("round_robin", round_robin)
    _check_flag("parameter_alignment", parameter_alignment)
    palign = param_alignment(element_size, parameter_alignment)
    everyone = trainable is None or all(trainable)
    return _zero12_group_layout(tuple(numels), world_size, None if everyone else tuple(trainable), round_robin, palign)


# The ZeRO-1/2 hook checks a group's layout against DeepSpeed's and then flattens it: one computation.
@functools.lru_cache(maxsize=16)
def _zero12_group_layout(numels: tuple[int, ...], world_size: int, trainable: tuple[bool, ...] | None,
                         round_robin: bool, palign: int) -> FlatGroupLayout:
    members = [i for i, n in enumerate(numels) if n > 0 and (trainable is None or trainable[i])]
    if round_robin:
        members = [members[k] for k in round_robin_order(len(members), world_size)]

    sizes = [numels[i] for i in members]
    if palign == 1:  # no pads between params: the offsets are a running sum (thousands of params, one C loop)
        offsets = [0, *itertools.accumulate(sizes)]
        offset = offsets.pop()
        paddings = [0] * len(sizes)
    else:
        offsets, paddings = [], []
        offset = 0
        for k, size in enumerate(sizes):
            offsets.append(offset)
            offset += size
            pad = 0 if k == len(sizes) - 1 else (-offset) % palign
            paddings.append(pad)
            offset += pad
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    return FlatGroupLayout(
        order=tuple(members),
        offsets=tuple(offsets),
        numels=tuple(sizes),
        paddings=tuple(paddings),
        tail_padding=(-offset) % alignment,
        world_size=world_size,
    )
