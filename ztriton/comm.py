"""The process group an entry point runs on (:class:`World`) and the few collectives they share.

Every collective here is called by all ranks of the world together; in a world of one they are
local. On torch's fake process group (the tests' simulated ranks) they return without moving data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["World", "all_gather_bytes", "all_ranks", "min_over_ranks", "world_of"]


@dataclass(frozen=True)
class World:
    """This process's rank in ``group`` (``None``: the default group), the group's size and backend."""

    rank: int
    size: int
    group: Any
    backend: str | None = None  # None: no torch.distributed world (a world of one)

    @property
    def simulated(self) -> bool:
        """torch's fake process group: collectives move nothing, so values cannot travel between ranks."""
        return self.backend == "fake"

    @property
    def comm_device(self) -> torch.device:
        """Where tensors handed to a collective live: NCCL moves only device tensors, the others host ones."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` of this group (what ``src=`` of a collective takes)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


def world_of(group: Any, *, required: bool = False) -> World:
    """The :class:`World` of ``group`` (default: the default group).

    Without torch.distributed and without ``group``, a world of one, unless ``required``. Raises
    before anything happens if ``group`` is given without torch.distributed, or this process is not
    a member of it.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if not initialised:
        if required:
            raise RuntimeError("torch.distributed is not initialised: call deepspeed.init_distributed() first "
                               "(a single process can use a world of one, or torch's fake process group)")
        if group is not None:
            raise ValueError("group= was given but torch.distributed is not initialised; "
                             "call torch.distributed.init_process_group first, or pass group=None")
        return World(0, 1, None)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group; pass the data-parallel group it belongs to")
    return World(rank, dist.get_world_size(group), group, dist.get_backend(group))


def min_over_ranks(values: list[int], world: World) -> list[int]:
    """Each of ``values``' smallest value over the ranks: how ranks that measured different figures
    (free memory, a chunk size) agree on one decision and so take the same branch."""
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=world.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.group)
    return [int(v) for v in t.tolist()]


def all_ranks(ok: bool, world: World) -> bool:
    """Whether ``ok`` holds on every rank (a collective; trivially ``ok`` in a world of one)."""
    return bool(min_over_ranks([int(ok)], world)[0])


def all_gather_bytes(out: torch.Tensor, part: torch.Tensor, world: World) -> None:
    """Every rank's ``part`` end to end into ``out``, as bytes (any dtype, any backend that moves uint8)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(torch.uint8), part.view(torch.uint8), group=world.group)
