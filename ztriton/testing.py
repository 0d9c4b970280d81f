"""What tests, benchmarks and the demo share: distributed worlds, byte comparisons, peak memory.

* :func:`simulated_world` / :func:`fake_world` make this process rank ``rank`` of a ``world_size``-rank
  world on torch's fake process group: every collective returns at once without moving data (a
  broadcast leaves the local tensor as it is). Enough for anything whose *layout* depends on the rank
  and world size, and cheap enough to enter hundreds of times in one process (Hypothesis examples).
* :func:`run_world` runs a function on every rank of a real multi-process gloo group, for anything
  whose *values* depend on collectives (e.g. ``zero.Init``'s broadcast from rank 0).
* :func:`bits` (compare bytes, never values), :func:`measure_peak` (time and peak device memory of
  one call) and :func:`deepspeed_flatten` (DeepSpeed's own ZeRO-1/2 flatten, the baseline).

Worlds leave torch.distributed and DeepSpeed's communication state (``deepspeed.comm.comm.cdb``) as
they found them: uninitialised.
"""
from __future__ import annotations

import datetime
import math
import multiprocessing
import pickle
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed

from ztriton.integrations.deepspeed.reference import deepspeed_flatten
from ztriton.integrations.deepspeed.worlds import deepspeed_world, environment, rank_environment, simulated_world
from ztriton.integrations.deepspeed.worlds import teardown_world as teardown
from ztriton.kernels.reference import bits
from ztriton.layout import is_int
from ztriton.memory import measure_peak

__all__ = ["DEEPSPEED_CPU_ENV", "WorldError", "bits", "deepspeed_flatten", "fake_world", "measure_peak", "run_world",
           "simulated_world", "teardown"]

# Environment every world sets: DS_ACCELERATOR picks DeepSpeed's CPU accelerator; MASTER_ADDR is where
# gloo ranks find the rendezvous store. Per rank, _rank_env adds RANK, WORLD_SIZE, MASTER_PORT (what
# DeepSpeed's launcher would set) and LOCAL_RANK, the local device index ``zero.Init`` reads
# unconditionally (``os.environ["LOCAL_RANK"]``).
DEEPSPEED_CPU_ENV = {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1"}

# After a first failure, how long to wait for the other ranks' reports (their own errors or results).
_FAILURE_GRACE_S = 3.0


class WorldError(RuntimeError):
    """A rank of a :func:`run_world` world failed, died or timed out; the message holds its traceback."""


def _check_world(world_size: int, rank: int) -> None:
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def _rank_env(world_size: int, rank: int, local_rank: int, port: int) -> dict[str, str]:
    return {**DEEPSPEED_CPU_ENV, **rank_environment(world_size, rank, local_rank, port)}


def _deepspeed_world(backend: str, store: torch.distributed.Store, world_size: int, rank: int,
                     local_rank: int, port: int):
    """torch.distributed plus DeepSpeed's wrapper on ``store``, with the CPU environment.

    DS_ACCELERATOR only counts if DeepSpeed has not picked its accelerator yet (it does so once per
    process); the test conftest sets it at start-up on hosts without CUDA.
    """
    return deepspeed_world(backend, store, world_size, rank, _rank_env(world_size, rank, local_rank, port))


def fake_world(world_size: int, rank: int):
    """:func:`simulated_world` with DeepSpeed set up for the CPU (the tests' simulated rank).

    Collectives complete without communicating: a broadcast from rank 0 leaves each rank's own
    values, an all-gather leaves the output as it was. Use it for layouts, not for values that
    travel. Re-entrant in sequence (not nested), any number of times per process.
    """
    _check_world(world_size, rank)
    return simulated_world(world_size, rank, extra_env=DEEPSPEED_CPU_ENV)


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, kwargs: dict,
           results: multiprocessing.Queue) -> None:
    """Body of one spawned rank: join the gloo group, run ``fn``, report its pickled result or traceback."""
    try:
        torch.set_num_threads(1)
        store = torch.distributed.TCPStore(DEEPSPEED_CPU_ENV["MASTER_ADDR"], port, is_master=False,
                                           timeout=datetime.timedelta(seconds=120))
        with _deepspeed_world("gloo", store, world_size, rank, local_rank=rank, port=port):
            result = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensors by value; torch's multiprocessing pickler would share them
        # through memory that dies with this process.
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything, including SystemExit, goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on each rank of a real gloo world; return the results.

    Each rank is a spawned process (so ``fn``, its arguments and its result must pickle, and ``fn`` must
    be importable by module name in a fresh interpreter, which inherits ``sys.path``) with
    torch.distributed and DeepSpeed set up as in :func:`fake_world`. The rendezvous store is served
    from this process on a port the OS picks, so there is no port to race for. A rank that raises, a
    rank that dies without reporting, or ``timeout`` seconds raise :class:`WorldError` with every
    failing rank's traceback; the ranks still running are then killed (they would hang in their next
    collective).
    """
    _check_world(world_size, 0)
    server = torch.distributed.TCPStore(DEEPSPEED_CPU_ENV["MASTER_ADDR"], 0, is_master=True,
                                        wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_child, args=(fn, rank, world_size, server.port, args, kwargs, results),
                        name=f"run_world-rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    with environment(DEEPSPEED_CPU_ENV):  # spawned children inherit os.environ at start
        for process in processes:
            process.start()
    try:
        return _collect(processes, results, time.monotonic() + timeout, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
        results.close()
        del server


def _collect(processes: list, results: multiprocessing.Queue, deadline: float, timeout: float) -> list[Any]:
    """Wait for one report per rank; raise with every failure seen (a rank's error often makes its peers
    fail too, in whichever order they report, so all tracebacks are kept for a grace period)."""
    world_size = len(processes)
    outcome: dict[int, Any] = {}
    failures: dict[int, str] = {}
    grace_end = math.inf
    while len(outcome) + len(failures) < world_size and time.monotonic() < grace_end:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            _note_silent_deaths(processes, results, outcome, failures)
            if time.monotonic() > deadline:
                for rank in set(range(world_size)) - set(outcome) - set(failures):
                    failures[rank] = f"did not finish within {timeout} s"
        else:
            if ok:
                outcome[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
        if failures and grace_end == math.inf:
            grace_end = time.monotonic() + _FAILURE_GRACE_S
    if failures or len(outcome) < world_size:
        report = "\n".join(f"--- rank {rank} of {world_size}: {failures[rank]}" for rank in sorted(failures))
        raise WorldError(f"rank(s) {sorted(failures)} of {world_size} failed\n{report}")
    return [outcome[rank] for rank in range(world_size)]


def _note_silent_deaths(processes: list, results: multiprocessing.Queue, outcome: dict, failures: dict) -> None:
    """Record ranks whose process exited without a report (a crash, ``os._exit``, the OOM killer)."""
    silent = [r for r, p in enumerate(processes) if p.exitcode is not None and r not in outcome and r not in failures]
    if not silent:
        return
    time.sleep(0.5)  # a report may still be in flight from a rank that just exited
    if results.empty():
        for rank in silent:
            failures[rank] = f"exited with code {processes[rank].exitcode} without a report"
