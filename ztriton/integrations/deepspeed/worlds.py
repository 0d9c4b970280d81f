"""DeepSpeed's communication on an existing torch.distributed world, set up and torn down cleanly.

:mod:`ztriton.testing` builds its simulated and gloo worlds on :func:`deepspeed_world`; it lives here
because it touches DeepSpeed's internals (its comm backend cache, its shared-memory op build).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import sys
from typing import Iterator

import torch

from ztriton.environment import environment

__all__ = ["deepspeed_world", "environment", "rank_environment", "simulated_world", "teardown_world"]


@contextlib.contextmanager
def _no_shm_comm() -> Iterator[None]:
    """Keep DeepSpeed from JIT-building its shared-memory comm op when it wraps torch.distributed.

    ``deepspeed.comm.torch.TorchBackend.__init__`` builds ``deepspeed_shm_comm`` on the CPU accelerator
    (about 45 s with a cold cache); the op only serves ``inference_all_reduce``. ``import
    deepspeed.comm.torch as m`` would bind the *torch* package (``deepspeed.comm`` re-exports it),
    hence ``sys.modules``.
    """
    importlib.import_module("deepspeed.comm.torch")
    module = sys.modules["deepspeed.comm.torch"]
    saved = module.build_shm_op
    module.build_shm_op = lambda: None
    try:
        yield
    finally:
        module.build_shm_op = saved


def _reset_deepspeed_comm() -> None:
    """Forget DeepSpeed's wrapper of torch.distributed, so the next world gets a fresh one.

    ``deepspeed.comm.destroy_process_group`` destroys torch's groups and releases DeepSpeed's group
    caches, but keeps ``cdb``, a ``TorchBackend`` bound to the old world.
    """
    importlib.import_module("deepspeed.comm.comm").cdb = None


# deepspeed.utils.groups' caches of process groups: dicts emptied, the others set back to what they hold before
# any world.
_GROUP_MAPS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
               "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")
_GROUP_VALUES = {"_WORLD_GROUP": None, "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None, "_TENSOR_MODEL_PARALLEL_GROUP": None,
                 "_MODEL_PARALLEL_GROUP": None, "_DATA_PARALLEL_GROUP": None,
                 "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None, "_MPU_TENSOR_MODEL_PARALLEL_RANK": None,
                 "mesh_device": None, "mpu": None, "expert_tensor_parallel_world_size": 1}


def _release_group_caches() -> None:
    """Forget the process groups DeepSpeed cached in ``deepspeed.utils.groups`` (the world's clone, data and
    expert parallel groups), so that the next world's engine does not use a group of this one. A DeepSpeed whose
    ``destroy_process_group`` releases them itself (``groups._release_process_group_references``) needs nothing."""
    groups = importlib.import_module("deepspeed.utils.groups")
    if hasattr(groups, "_release_process_group_references"):
        return
    for name in _GROUP_MAPS:
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
    for name, value in _GROUP_VALUES.items():
        if hasattr(groups, name):
            setattr(groups, name, value)


def teardown_world() -> None:
    """Destroy whatever world is initialised (torch.distributed and DeepSpeed's wrapper of it)."""
    comm = importlib.import_module("deepspeed.comm.comm")
    try:
        if torch.distributed.is_initialized():
            if comm.cdb is not None:
                comm.destroy_process_group()
            else:
                torch.distributed.destroy_process_group()
    finally:
        _reset_deepspeed_comm()
        _release_group_caches()


def rank_environment(world_size: int, rank: int, local_rank: int, port: int, master: str = "127.0.0.1") -> dict[str, str]:
    """What DeepSpeed's launcher would set for one rank (``zero.Init`` reads LOCAL_RANK unconditionally)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master, "MASTER_PORT": str(port)}


@contextlib.contextmanager
def deepspeed_world(backend: str, store: torch.distributed.Store, world_size: int, rank: int,
                    env: dict[str, str]) -> Iterator[None]:
    """Initialise torch.distributed on ``store``, hand it to DeepSpeed, tear both down afterwards.

    ``env`` (see :func:`rank_environment`) is set for the duration.
    """
    if torch.distributed.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; worlds do not nest")
    with environment(env), _no_shm_comm():
        import deepspeed.comm

        _reset_deepspeed_comm()
        try:
            torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                                 timeout=datetime.timedelta(seconds=120))
            # DeepSpeed sees an initialised torch.distributed and only wraps it.
            deepspeed.comm.init_distributed(dist_backend=backend, verbose=False)
            yield
        finally:
            teardown_world()


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int, extra_env: dict[str, str] | None = None) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` on torch's fake process group, DeepSpeed included.

    Collectives return at once without moving data (a broadcast leaves the local tensor as it is):
    enough for everything whose layout depends on the rank, not for values that travel. This process
    drives one device whatever rank it plays (LOCAL_RANK 0).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {**rank_environment(world_size, rank, local_rank=0, port=29500), **(extra_env or {})}
    with deepspeed_world("fake", FakeStore(), world_size, rank, env):
        yield
