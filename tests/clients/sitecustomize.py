"""Test-only adjustments for running the real clients on CPU ranks (tests/test_clients.py puts this folder on
PYTHONPATH, so every process of a launched run imports it at start-up, after the ztriton start-up hook).

Two things differ on a CPU machine from the GPU machines the recipes are for, and only those are adjusted:

* accelerate's ``PartialState`` picks the distributed backend from the torch accelerator; with none (CPU) and
  DeepSpeed requested it picks no backend and sees one process on every rank, although DeepSpeed's CPU
  accelerator has joined them all through gloo. A state on CPU ranks under DeepSpeed is given what it would have
  on GPUs: gloo, one process per rank (DeepSpeed's CPU accelerator's backend).
* DeepSpeed JIT-builds its CPU shared-memory comm op in ``init_distributed`` (serves only inference all-reduce;
  about a minute the first time): it is skipped, as ztriton's test worlds skip it.
* Two flaws of older DeepSpeed releases (0.18) that only gloo's asynchronous collectives expose, fixed as later
  releases fix them, for key on and key off alike: ``Init._allgather_params_coalesced`` waits for its last
  handle only (gloo's other gathers may still be writing: params are gathered one by one instead, as the config's
  ``allgather_sequential`` does), and the ZeRO-1/2 init-time flat buffer keeps the params' autograd history
  (gloo's all-gather into its views then refuses the first step: it is detached, as 0.19 detaches it).

Each module is patched when it finishes loading, so this imports nothing itself. One thing is added for the
test to read: with ``ZTRITON_TEST_RANK_OUTPUT`` set, each rank's stdout and stderr go to ``rank<RANK>.out`` and
``rank<RANK>.err`` in that folder (every launcher interleaves its ranks' output otherwise).
"""
import importlib.abc
import importlib.util
import os
import sys


def _patch_accelerate_state(module) -> None:
    original = module.PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        picked, distributed_type = original(self, cpu, sagemaker_dp, backend)
        deepspeed_on_cpu = (picked is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1
                            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")
        if deepspeed_on_cpu:
            return "gloo", module.DistributedType.MULTI_CPU
        return picked, distributed_type

    module.PartialState._prepare_backend = _prepare_backend


def _patch_deepspeed_comm(module) -> None:
    module.build_shm_op = lambda: None


def _patch_deepspeed_gathers(module) -> None:
    import functools
    import inspect

    init = module.Init
    if "launch_handles[-1].wait()" not in inspect.getsource(init._allgather_params_coalesced):
        return

    @functools.wraps(init._allgather_params_coalesced)
    def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
        return self._allgather_params_sequential(param_list, hierarchy=hierarchy)

    init._allgather_params_coalesced = _allgather_params_coalesced


def _patch_deepspeed_zero12(module) -> None:
    import functools

    optimizer = module.DeepSpeedZeroOptimizer
    flatten = optimizer.flatten_dense_tensors_aligned

    @functools.wraps(flatten)  # ztriton's hooks read the signature through it
    def flatten_dense_tensors_aligned(self, *args, **kwargs):
        flat = flatten(self, *args, **kwargs)
        return flat.detach() if flat.grad_fn is not None else flat

    optimizer.flatten_dense_tensors_aligned = flatten_dense_tensors_aligned


_PATCHES = {"accelerate.state": _patch_accelerate_state, "deepspeed.comm.torch": _patch_deepspeed_comm,
            "deepspeed.runtime.zero.partition_parameters": _patch_deepspeed_gathers,
            "deepspeed.runtime.zero.stage_1_and_2": _patch_deepspeed_zero12}


class _PatchAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a module in ``_PATCHES`` to patch it once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _per_rank_output() -> None:
    """A rank (a process its launcher gave RANK and LOCAL_RANK) writes its fds 1 and 2 to its own files."""
    directory, rank = os.environ.get("ZTRITON_TEST_RANK_OUTPUT"), os.environ.get("RANK")
    if not directory or rank is None or "LOCAL_RANK" not in os.environ:
        return
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(directory, f"rank{rank}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


sys.meta_path.insert(0, _PatchAfterLoad())
_per_rank_output()
