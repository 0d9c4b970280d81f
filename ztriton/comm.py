"""The process group an entry point runs on (:class:`World`) and the few collectives they share.

Every collective here is called by all ranks of the world together; in a world of one they are
local. On torch's fake process group (the tests' simulated ranks) they return without moving data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Agreed", "World", "agree", "agreed", "all_gather_bytes", "all_ranks", "min_over_ranks", "same_on_all_ranks",
           "world_of"]

# Fault injection for the tests (``tests/test_faults.py``): when set, called with the collective's name
# before every collective of this module; raising makes that collective fail on this rank.
fault_hook: Callable[[str], None] | None = None


def _before_collective(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


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
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns on the ranks outside it
        raise ValueError("this process is not a member of the given group (dist.new_group returned NON_GROUP_MEMBER "
                         "here); pass the data-parallel group it belongs to")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (e.g. from dist.new_group) or None for the "
                        f"default group, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group; pass the data-parallel group it belongs to")
    return World(rank, dist.get_world_size(group), group, dist.get_backend(group))


def min_over_ranks(values: list[int], world: World) -> list[int]:
    """Each of ``values``' smallest value over the ranks: how ranks that measured different figures
    (free memory, a chunk size) agree on one decision and so take the same branch."""
    if world.size == 1:
        return list(values)
    _before_collective("all_reduce")
    t = torch.tensor(values, dtype=torch.int64, device=world.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.group)
    return [int(v) for v in t.tolist()]


def all_ranks(ok: bool, world: World) -> bool:
    """Whether ``ok`` holds on every rank (a collective; trivially ``ok`` in a world of one)."""
    return bool(min_over_ranks([int(ok)], world)[0])


def same_on_all_ranks(values: list[int], world: World) -> bool:
    """Whether every rank holds the same ``values`` (a collective: one all-reduce of the values and
    their negations; ints within int64)."""
    low = min_over_ranks(list(values) + [-v for v in values], world)
    return low[:len(values)] == [-v for v in low[len(values):]]


@dataclass(frozen=True)
class Agreed:
    """The outcome of one step all ranks took together (:func:`agree`).

    ``ok``: the step succeeded on every rank. ``value``: this rank's result (None if it raised).
    ``error``: this rank's exception (None if it succeeded here, even when another rank failed).
    """

    ok: bool
    value: Any = None
    error: Exception | None = None

    def describe(self) -> str:
        """For an error message: this rank's failure, or that another rank failed."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return "it failed on another rank" if not self.ok else "ok"


def agree(world: World, step: Callable[[], Any]) -> Agreed:
    """Run ``step`` here, then agree with every rank on whether it succeeded everywhere.

    Whatever ``step`` raises (any ``Exception``: an out-of-memory error, the CPU allocator's
    RuntimeError, a collective's failure) is caught, so this rank still takes part in the agreement
    and no other rank waits for it forever; all ranks then take the same branch. The caller decides
    what a failure means. If the agreement itself fails it counts as a failure here (``ok`` False).
    """
    try:
        value, error = step(), None
    except Exception as exc:  # noqa: BLE001 -- every failure must reach the agreement below
        value, error = None, exc
    try:
        ok = all_ranks(error is None, world)
    except Exception as exc:  # noqa: BLE001 -- a broken collective: nothing else can be agreed
        return Agreed(False, None, error or exc)
    return Agreed(ok, value if ok else None, error)


def agreed(world: World, step: Callable[[], Any], what: str, state: str = "nothing was changed") -> Any:
    """``step()``'s value once every rank's ``step`` succeeded; otherwise every rank raises, a failing rank its
    own exception and the others a RuntimeError saying that ``what`` failed on another rank and ``state`` (what
    the failure left as it was). Steps whose failure may differ between ranks (checks, allocations) run through
    this before the next collective."""
    outcome = agree(world, step)
    if outcome.error is not None:
        raise outcome.error
    if not outcome.ok:
        raise RuntimeError(f"{what} failed on another rank (its error says why); {state}: fix the cause there and "
                           "call again on every rank")
    return outcome.value


def all_gather_bytes(out: torch.Tensor, part: torch.Tensor, world: World) -> None:
    """Every rank's ``part`` end to end into ``out``, as bytes (any dtype, any backend that moves uint8)."""
    _before_collective("all_gather")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(torch.uint8), part.view(torch.uint8), group=world.group)
