"""The background kernel warm-up (``kernels/warmup.py``) and where the DeepSpeed key starts it.

On the CPU: which device the integration picks (never a guess among several GPUs), that nothing starts
without CUDA or without the key, and that one thread serves a device. On a GPU: the thread loads the
exact variant a real 16-byte-aligned pack uses, so that pack compiles nothing more.
"""
from __future__ import annotations

import threading
import types

import pytest
import numpy as np
import torch

from ztriton.integrations.deepspeed import config as ds_config
from ztriton.kernels import warmup


@pytest.fixture
def started(monkeypatch):
    """Record the devices the integration asks to warm up, with CUDA faked as available."""
    calls = []
    monkeypatch.setattr(warmup, "warm_up_in_background", lambda index: calls.append(index))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    class CudaAccelerator:
        def device_name(self):
            return "cuda"

    import deepspeed.accelerator

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: CudaAccelerator())
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return calls


@pytest.fixture
def fresh_warm_ups(monkeypatch):
    """CUDA faked as available and kernels that compile, with empty warm-up registries (shared by the
    launches and the warm-up, as in the library) and the exit wait recorded instead of registered: nothing a
    test starts leaks into the process. Returns the callbacks registered for the exit."""
    from ztriton.kernels import plan, state

    registered = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plan, "interpreted", lambda: False)  # what plan.interpreter_on asks
    monkeypatch.setattr(warmup, "_requested", set())
    monkeypatch.setattr(warmup, "_cat_started", {})
    monkeypatch.setattr(warmup, "_threads", [])
    monkeypatch.setattr(warmup.atexit, "register", registered.append)
    monkeypatch.setattr(state, "WARMING", {})
    monkeypatch.setattr(warmup, "WARMING", state.WARMING)
    return registered


@pytest.mark.parametrize("count, local_rank, initialised, expected", [
    (8, "3", False, [3]),      # DeepSpeed's launcher: the rank's own GPU
    (1, None, False, [0]),     # the only GPU
    (8, None, False, []),      # several GPUs, nothing says which: no guess
    (8, "9", False, []),       # LOCAL_RANK beyond the visible GPUs (CUDA_VISIBLE_DEVICES per rank) ...
    (8, None, True, []),       # CUDA initialised says nothing of the device chosen (zero.Init reads first)
])
def test_integration_picks_the_ranks_device_or_none(started, monkeypatch, count, local_rank, initialised, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    if initialised:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    ds_config.start_kernel_warm_up()
    assert started == expected


def test_integration_starts_nothing_on_a_cpu_accelerator(started, monkeypatch):
    import deepspeed.accelerator

    class CpuAccelerator:
        def device_name(self):
            return "cpu"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: CpuAccelerator())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ds_config.start_kernel_warm_up()
    assert started == []


@pytest.mark.parametrize("backend, section, expected", [
    ("triton", {"warm_up_kernels": True}, 1),
    ("triton", {}, 0),  # off by default: a process that never needs a kernel would pay for the thread
    ("triton", {"warm_up_kernels": False}, 0),
    ("torch", {"warm_up_kernels": True}, 0),  # key off: ztriton does nothing
])
def test_only_a_config_with_the_key_and_the_option_starts_it(monkeypatch, backend, section, expected):
    from deepspeed.runtime.config import DeepSpeedConfig

    from ztriton.integrations.deepspeed.install import install

    install()  # idempotent; importing ztriton installs it only once deepspeed is imported, which may come later
    calls = []
    monkeypatch.setattr(ds_config, "start_kernel_warm_up", lambda: calls.append(1))
    DeepSpeedConfig({"train_batch_size": 1, "partition_backend": backend, "zero_optimization": {"stage": 2},
                     "ztriton": section})
    assert len(calls) == expected


def test_warm_up_option_must_be_a_bool():
    with pytest.raises(ValueError, match="ztriton.warm_up_kernels must be true or false, got 'yes'"):
        ds_config.settings_from({"partition_backend": "triton", "ztriton": {"warm_up_kernels": "yes"}})


def test_nothing_to_warm_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert warmup.warm_up_in_background(0) is None
    assert warmup.warm_up_in_background("cpu") is None


def test_a_thread_that_cannot_start_registers_nothing(monkeypatch, fresh_warm_ups):
    """No threads left: the error reaches the caller (the integration logs it), nothing is registered, and
    later launches on the device do not wait for a thread that never ran."""
    from ztriton.kernels import state

    def no_threads(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    with pytest.raises(RuntimeError, match="can't start"):
        warmup.warm_up_in_background(3)
    assert state.WARMING == {}
    state.await_warm_up(torch.device("cuda", 3))  # returns at once


def test_a_launch_waits_for_the_warm_up_once(monkeypatch):
    """The first launch on the device joins the thread (bounded); later launches never wait again, even
    when that wait timed out; the thread's own launch does not wait for itself."""
    from ztriton.kernels import state

    gate, joined = threading.Event(), []
    thread = threading.Thread(target=lambda: gate.wait(5), daemon=True)
    thread.start()
    monkeypatch.setattr(state, "WARMING", {4: thread})
    monkeypatch.setattr(state, "_WARM_UP_WAIT_S", 0.05)
    original_join = threading.Thread.join
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: (joined.append(timeout),
                                                                              original_join(self, timeout)))
    state.await_warm_up(torch.device("cuda", 4))  # times out: the thread is still waiting on the gate
    state.await_warm_up(torch.device("cuda", 4))
    assert joined == [0.05] and state.WARMING == {}
    gate.set()
    original_join(thread, 5)
    monkeypatch.setattr(state, "WARMING", {4: threading.current_thread()})
    state.await_warm_up(torch.device("cuda", 4))  # itself: no join
    assert joined == [0.05]


def test_until_a_kernel_is_loaded_contiguous_pieces_take_torch_copies(monkeypatch):
    """Until a kernel launch has returned on a device (a warm-up in flight or none started), contiguous pieces on
    it (up to BEFORE_LOAD_PIECES) go through torch's copy_ rather than pay or wait for the load; strided ones, host
    ones and KERNELS_ONLY do not; once loaded there, the usual limit holds again, on that device only."""
    from ztriton.kernels import KERNELS_ONLY, Tuning, plan, state
    from ztriton.kernels.validation import Sources

    monkeypatch.setattr(state, "LOADED", {3})
    n = Tuning().torch_pieces + 1

    def sources(count, contiguous=True, local=True):
        """Facts of ``count`` pieces, built the way validate builds them, without a device."""
        zeros, ones = np.zeros(count, np.int64), np.ones(count, np.int64)
        return Sources(start=zeros, count=ones, offset=np.arange(count, dtype=np.int64), numel=ones, lo=zeros,
                       hi=ones, contiguous=np.full(count, contiguous), local=np.full(count, local))

    cuda2, cuda3 = torch.device("cuda", 2), torch.device("cuda", 3)
    assert not state.kernels_loaded(cuda2) and state.kernels_loaded(cuda3)
    assert state.kernels_loaded(torch.device("cpu"))  # the interpreter loads nothing
    assert plan._torch_copies_suffice(sources(n), Tuning(), cuda2)
    assert plan._torch_copies_suffice(sources(plan.BEFORE_LOAD_PIECES), Tuning(), cuda2)
    assert not plan._torch_copies_suffice(sources(plan.BEFORE_LOAD_PIECES + 1), Tuning(), cuda2)
    assert not plan._torch_copies_suffice(sources(n), Tuning(), cuda3)
    assert not plan._torch_copies_suffice(sources(n, contiguous=False), Tuning(), cuda2)
    assert not plan._torch_copies_suffice(sources(n, local=False), Tuning(), cuda2)  # host sources: blocking copies
    assert not plan._torch_copies_suffice(sources(2), KERNELS_ONLY, cuda2)
    assert plan._torch_copies_suffice(sources(n - 1), Tuning(), cuda3)
    assert not plan._torch_copies_suffice(sources(n), Tuning(), torch.device("cpu"))


def test_a_kernel_launch_marks_its_device_loaded(monkeypatch):
    """The launch that loaded the kernels marks the device; torch copies and the interpreter's launches mark nothing."""
    from ztriton.kernels import Plan, state

    monkeypatch.setattr(state, "LOADED", set())
    monkeypatch.setattr(state, "await_warm_up", lambda device: None)
    launched = []
    fake_stream = types.SimpleNamespace(device=torch.device("cuda", 5))
    copies_only = Plan([], [], [], fake_stream, copies=[], fills=[])
    copies_only._launch_all()
    assert state.LOADED == set()
    with_kernel = Plan([(_Launcher(launched), (1,), (), {})], [], [], fake_stream)
    with_kernel._launch_all()
    assert launched == [(1,)] and state.LOADED == {5}
    interpreted = Plan([(_Launcher(launched), (2,), (), {})], [], [], None)
    interpreted._launch_all()
    assert state.LOADED == {5}


class _Launcher:
    """Stands for a jit kernel: ``kernel[grid](*args)`` records the grid."""

    def __init__(self, launched):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(grid)


def test_the_warm_up_thread_is_not_its_own_warm_up(monkeypatch):
    from ztriton.kernels import state

    monkeypatch.setattr(state, "WARMING", {2: threading.current_thread()})  # the warm-up's own launch
    assert state._warm_up_elsewhere(torch.device("cuda", 2)) is None


def test_one_thread_per_device_and_failures_stay_in_it(monkeypatch, fresh_warm_ups):
    """A second request for the same device gets the first thread; an error in the thread is swallowed
    (the first real launch then loads the kernel itself)."""
    ran = []
    gate = threading.Event()

    def failing(device, work=None):
        ran.append(device)
        gate.wait(5)
        raise RuntimeError("no driver")

    monkeypatch.setattr(warmup, "warm_up", failing)
    first = warmup.warm_up_in_background(7)
    second = warmup.warm_up_in_background(torch.device("cuda", 7))
    assert first is second
    gate.set()
    first.join(5)
    assert not first.is_alive() and ran == [torch.device("cuda", 7)]
    with pytest.raises(ValueError, match="indexed CUDA device"):
        warmup.warm_up_in_background("cuda")


def test_torch_cat_is_loaded_once_per_device_in_a_thread_waited_for_at_exit(monkeypatch, fresh_warm_ups):
    """Torch's cat kernel (torch's route joins pieces side by side with it) loads in a daemon thread, once per
    device; the thread is waited for at exit like the kernels' warm-up; no CUDA device, nothing to load."""
    ran = []
    monkeypatch.setattr(warmup, "warm_up", lambda device, work=None: ran.append((device, work)))
    first = warmup.load_torch_cat_in_background(5)
    assert warmup.load_torch_cat_in_background(torch.device("cuda", 5)) is first
    first.join(5)
    assert ran == [(torch.device("cuda", 5), warmup._cat_once)]
    assert fresh_warm_ups == [warmup._finish_at_exit] and warmup._threads == [first]
    assert warmup.load_torch_cat_in_background("cpu") is None
    with pytest.raises(ValueError, match="indexed CUDA device"):
        warmup.load_torch_cat_in_background("cuda")


def test_the_key_loads_torch_cat_on_the_engines_device_only(monkeypatch):
    """Under the key a ZeRO optimizer's construction starts the load on the engine's device (indexed CUDA);
    a CPU or unindexed device starts nothing, and a thread that cannot start changes nothing else."""
    from ztriton.integrations.deepspeed import optimizers

    asked = []
    monkeypatch.setattr(warmup, "load_torch_cat_in_background", asked.append)
    for device in (torch.device("cpu"), torch.device("cuda"), "cuda:0", torch.device("cuda", 1)):
        optimizers._load_torch_cat(device)
    assert asked == [torch.device("cuda", 1)]

    def no_threads(device):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(warmup, "load_torch_cat_in_background", no_threads)
    optimizers._load_torch_cat(torch.device("cuda", 1))  # logged at debug level, not raised


@pytest.mark.gpu
def test_gpu_torch_cat_load_runs_on_the_device(caplog):
    index = torch.cuda.current_device()
    with caplog.at_level("DEBUG", logger="ztriton"):
        thread = warmup.load_torch_cat_in_background(index)
        thread.join(30)
    assert not thread.is_alive() and "failed" not in caplog.text, caplog.text


GPU_CHECK = """
import torch
from ztriton.kernels import Tuning, pack_plan, warmup
from ztriton.kernels.copy import copy_words_kernel
device = torch.device("cuda", 0)
assert len(copy_words_kernel.device_caches[0][0]) == 0, "a fresh process has loaded nothing yet"
warmup.warm_up_in_background(device).join(120)
loaded = len(copy_words_kernel.device_caches[0][0])  # triton keeps compiled kernels by specialisation
assert loaded == 1, loaded
sources = [torch.randn(4096, 64, device=device).to(torch.bfloat16) for _ in range(3)]
flat = torch.full((3 * 4096 * 64 + 64,), float("nan"), dtype=torch.bfloat16, device=device)
pack_plan(flat, sources, [0, 4096 * 64, 2 * 4096 * 64], tuning=Tuning(torch_pieces=0)).launch()
assert torch.equal(flat[:4096 * 64].view(4096, 64), sources[0])
assert len(copy_words_kernel.device_caches[0][0]) == loaded, "the real pack needed another variant"
print("OK")
"""


@pytest.mark.gpu
def test_gpu_warm_up_loads_the_variant_a_real_pack_uses():
    """In a fresh process (the suite's earlier GPU tests load the kernels themselves): the thread loads one
    variant, and a 16-byte-aligned bf16 pack then finds its kernel loaded (no new variant)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", GPU_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


GPU_UNLOADED = """
import sys
import torch
from ztriton.kernels import pack_plan, state
device = torch.device("cuda", 0)
sources = [torch.randn(1000 + i, device=device).to(torch.bfloat16) for i in range(600)]
offsets, at = [], 0
for s in sources:
    offsets.append(at)
    at += s.numel() + 8
flat = torch.full((at,), float("nan"), dtype=torch.bfloat16, device=device)
job = pack_plan(flat, sources, offsets)
assert job.torch_copies and not job.launches, "600 contiguous pieces before any load: torch copies"
job.launch()
for s, o in zip(sources, offsets):
    assert torch.equal(flat[o:o + s.numel()].view(torch.int16), s.view(torch.int16))
    assert torch.equal(flat[o + s.numel():o + s.numel() + 8].view(torch.int16), torch.zeros(8, dtype=torch.int16, device=device))
assert "triton" not in sys.modules and state.LOADED == set(), "nothing loaded, triton not even imported"
from ztriton.kernels.copy import copy_words_kernel, gather_tile_kernel
assert len(copy_words_kernel.device_caches[0][0]) == 0
square = torch.randn(64, 64, device=device).to(torch.bfloat16)
out = torch.empty(64 * 64, dtype=torch.bfloat16, device=device)
pack_plan(out, [square.t()], [0]).launch()  # a strided source needs the kernel: it loads now
assert torch.equal(out.view(64, 64), square.t().contiguous())
assert state.LOADED == {0} and len(gather_tile_kernel.device_caches[0][0]) == 1
print("OK")
"""


@pytest.mark.gpu
def test_gpu_fresh_process_takes_torch_copies_until_a_job_needs_the_kernel():
    """No warm-up and no kernel loaded: a 600-piece pack goes through torch's copy_ and loads nothing, not even
    triton (a dense model's flatten never pays for them); a strided source then loads the kernel and marks the
    device."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", GPU_UNLOADED], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
def test_gpu_pack_during_a_warm_up_writes_the_kernels_bytes(monkeypatch):
    """A 40-piece pack while a warm-up is (made to look) in flight: torch's copies, no launch, no wait,
    and the same bytes as the kernels write."""
    from ztriton.kernels import Tuning, bits, pack_plan, state

    gate = threading.Event()
    thread = threading.Thread(target=lambda: gate.wait(30), daemon=True)
    thread.start()
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(state, "WARMING", {device.index: thread})
    monkeypatch.setattr(state, "LOADED", set())  # the suite loaded the kernels first (conftest)
    sources = [torch.randn(37 + i, device=device).to(torch.bfloat16) for i in range(40)]
    offsets = np.cumsum([0] + [s.numel() + 3 for s in sources[:-1]]).tolist()
    end = offsets[-1] + sources[-1].numel() + 5
    ours, kernels = (torch.full((end,), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(2))
    during = pack_plan(ours, sources, offsets)
    assert during.torch_copies and not during.launches
    during.launch()
    assert thread.is_alive(), "the pack waited for the warm-up"
    gate.set()
    thread.join(30)
    pack_plan(kernels, sources, offsets, tuning=Tuning(torch_pieces=0)).launch()
    assert torch.equal(bits(ours), bits(kernels))


def test_exit_waits_for_a_warm_up_still_loading(monkeypatch, fresh_warm_ups):
    """The interpreter's exit waits (bounded) for a warm-up thread still running, so that no daemon thread is
    inside CUDA or Triton code when Python finalises; the wait is registered once, with the first thread."""
    registered = fresh_warm_ups
    gate, finished = threading.Event(), []

    def loading(device):
        gate.wait(5)
        finished.append(device)

    monkeypatch.setattr(warmup, "_run", loading)
    first = warmup.warm_up_in_background(5)
    warmup.warm_up_in_background(6)
    assert registered == [warmup._finish_at_exit] and first.is_alive()
    threading.Timer(0.2, gate.set).start()
    warmup._finish_at_exit()  # returns only once both have finished
    assert sorted(d.index for d in finished) == [5, 6]
    monkeypatch.setattr(warmup, "_EXIT_WAIT_S", 0.01)
    gate.clear()
    stuck = threading.Thread(target=lambda: gate.wait(5), daemon=True)
    stuck.start()
    warmup._threads.append(stuck)
    warmup._finish_at_exit()  # bounded: a thread that never ends does not hold the exit forever
    assert stuck.is_alive()
    gate.set()
