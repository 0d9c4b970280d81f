"""DeepSpeed's communication on an existing torch.distributed world, set up and torn down cleanly.

:mod:`ztriton.testing` builds its simulated and gloo worlds on :func:`deepspeed_world`; it lives here
because it touches DeepSpeed's internals (its comm backend cache, its shared-memory op build).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import sys
from typing import Iterator

import torch

__all__ = ["deepspeed_world", "environment", "rank_environment", "simulated_world", "teardown_world"]


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration, then restore the previous values (or absence)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


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
