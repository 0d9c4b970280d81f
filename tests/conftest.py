"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under the interpreter on CPU tensors, and DeepSpeed uses
its CPU accelerator. Both variables must be set before triton / deepspeed is first imported (each
reads it once per process), so they are set here, at collection time.

Distributed fixtures (helpers in ``worlds.py``, DeepSpeed drivers in ``ds_reference.py``):

* ``fake_world``: ``with fake_world(world_size, rank): ...`` makes this process any rank of a
  simulated world on torch's fake process group (no data moves); enter it as often as needed.
* ``gloo_world``: ``gloo_world(fn, world_size, *args, timeout=180.0, **kwargs)`` runs
  ``fn(rank, world_size, *args, **kwargs)`` on every rank of a real multi-process gloo world and
  returns the ranks' results in rank order (``fn`` must be a module-level function).

Both are session-scoped factories, so Hypothesis tests can use them (each example opens its own world).
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch.distributed  # noqa: E402

import worlds  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _kernels_loaded():
    """On a GPU, load the kernels once before any test, so that no test's timing or log line depends on being the
    first to launch one. Without one, import the kernels under the interpreter before any test can unset
    TRITON_INTERPRET."""
    if HAS_CUDA:
        from ztriton.kernels.warmup import warm_up

        warm_up(torch.device("cuda", torch.cuda.current_device()))
    else:  # triton decides at the kernels' import whether it interprets: now, with TRITON_INTERPRET=1 (above)
        from ztriton.kernels import plan

        assert plan.interpreted()
    yield


@pytest.fixture(scope="session")
def fake_world():
    """Factory of simulated ranks: ``with fake_world(world_size, rank):`` (see ``worlds.fake_world``)."""
    return worlds.fake_world


@pytest.fixture(scope="session")
def gloo_world():
    """Runner of real gloo worlds: ``gloo_world(fn, world_size, *args, timeout=..., **kwargs)``."""
    return worlds.run_world


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """Fail a test that leaves torch.distributed initialised, and clean up so the next one can start."""
    yield
    if torch.distributed.is_initialized():
        worlds.teardown()
        pytest.fail("the test left torch.distributed initialised")
