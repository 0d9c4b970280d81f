"""The background kernel warm-up (``kernels/warmup.py``) and where the DeepSpeed key starts it.

On the CPU: which device the integration picks (never a guess among several GPUs), that nothing starts
without CUDA or without the key, and that one thread serves a device. On a GPU: the thread loads the
exact variant a real 16-byte-aligned pack uses, so that pack loads nothing more. The route a job takes never
depends on the warm-up (``test_compiled_cache.py``); the compiled cache's background fill is tested there too.
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    from ztriton.kernels import state

    registered = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(state, "interpreted", lambda: False)  # what state.interpreter_on asks
    monkeypatch.setattr(warmup, "_requested", set())
    monkeypatch.setattr(warmup, "_cat_started", {})
    monkeypatch.setattr(warmup, "_preloaded", {})
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


def test_the_key_preloads_on_the_engines_device_only(monkeypatch):
    """Under the key a ZeRO optimizer's construction starts torch's cat load and the compiled word copies' preload
    on the engine's device (indexed CUDA); a CPU or unindexed device starts nothing, and a thread that cannot start
    changes nothing else."""
    from ztriton.integrations.deepspeed import optimizers

    cats, preloads = [], []
    monkeypatch.setattr(warmup, "load_torch_cat_in_background", cats.append)
    monkeypatch.setattr(warmup, "preload_in_background", lambda device, element_size: preloads.append(device))
    for device in (torch.device("cpu"), torch.device("cuda"), "cuda:0", torch.device("cuda", 1)):
        optimizers._preload(device)
    assert cats == preloads == [torch.device("cuda", 1)]
    sizes = []
    monkeypatch.setattr(warmup, "preload_in_background", lambda device, element_size: sizes.append(element_size))
    optimizers._preload(torch.device("cuda", 1), 2)
    assert sizes == [2]  # the params' bytes each, where the engine's config says

    def no_threads(device, element_size):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(warmup, "preload_in_background", no_threads)
    optimizers._preload(torch.device("cuda", 1))  # logged at debug level, not raised; the cat load still starts
    assert cats == [torch.device("cuda", 1)] * 3


@pytest.mark.parametrize("precision, element_size", [({"bf16": {"enabled": True}}, 2), ({"fp16": {"enabled": True}}, 2),
                                                      ({}, None)])
def test_the_engine_s_hook_preloads_the_classes_its_config_s_params_use(monkeypatch, precision, element_size):
    """The engine's hook (``_configure_zero_optimizer`` under the key) tells the preload the params' bytes each, as
    the engine's DeepSpeed config says them."""
    from types import SimpleNamespace

    from deepspeed.runtime.config import DeepSpeedConfig

    from ztriton.integrations.deepspeed import optimizers

    asked = []
    monkeypatch.setattr(warmup, "preload_in_background", lambda device, size: asked.append((device, size)))
    monkeypatch.setattr(warmup, "load_torch_cat_in_background", lambda device: None)
    config = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2},
                              "partition_backend": "triton", **precision})
    engine = SimpleNamespace(_config=config, device=torch.device("cuda", 1))
    assert optimizers.engine_configure_zero_optimizer(lambda self: "built", engine) == "built"
    assert asked == [(torch.device("cuda", 1), element_size)]


def test_preload_loads_each_word_class_from_the_cache_only_once_per_device(monkeypatch, fresh_warm_ups):
    """The preload asks the compiled cache (never Triton's JIT) for every word class, once per device and process,
    in a thread waited for at exit; it starts nothing on a CPU device, under the interpreter or with
    ZTRITON_COMPILED=0."""
    from ztriton.kernels.tuning import KERNELS_ONLY
    from ztriton.kernels.variants import word_meta

    asked, pinned = [], []
    monkeypatch.setattr(warmup.compiled, "preload", lambda index, kernel, meta: asked.append((index, kernel, meta)))
    monkeypatch.setattr(warmup, "warm_up", lambda device, work: work(device))
    monkeypatch.setattr(warmup, "_fill_pinned_cache", pinned.append)
    first = warmup.preload_in_background(3)
    assert warmup.preload_in_background(torch.device("cuda", 3)) is first
    first.join(5)
    assert [meta for _, _, meta in asked] == [word_meta(unit, KERNELS_ONLY) for unit in (16, 2, 4, 8, 1)]
    assert {(index, kernel) for index, kernel, _ in asked} == {(3, "copy_words_kernel")}
    assert pinned == [torch.device("cuda", 3)]
    assert fresh_warm_ups == [warmup._finish_at_exit] and warmup._threads == [first]
    assert warmup.preload_in_background("cpu") is None
    monkeypatch.setenv("ZTRITON_COMPILED", "0")
    assert warmup.preload_in_background(4) is None
    monkeypatch.delenv("ZTRITON_COMPILED")
    asked.clear()
    monkeypatch.setattr(warmup, "_preloaded", {})
    warmup.preload_in_background(5, element_size=2).join(5)  # bf16 params: every class but the 1-byte one
    assert [meta for _, _, meta in asked] == [word_meta(unit, KERNELS_ONLY) for unit in (16, 2, 4, 8)]


@pytest.mark.parametrize("element_size, units", [(None, (16, 2, 4, 8, 1)), (1, (16, 2, 4, 8, 1)), (2, (16, 2, 4, 8)),
                                                 (4, (16, 4, 8)), (8, (16, 8)), (16, (16,)), (32, (16,)),
                                                 (3, (16, 2, 4, 8, 1)), (0, (16, 2, 4, 8, 1))])
def test_word_units_are_the_classes_whole_elements_can_use(element_size, units):
    assert warmup.word_units(element_size) == units


@settings(max_examples=80, deadline=None)
@given(log_size=st.integers(0, 4), aligned=st.booleans(), shift=st.integers(0, 16), extra=st.integers(0, 31),
       pieces=st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64), st.integers(0, 9)), min_size=1, max_size=6))
def test_word_units_cover_every_class_a_plan_of_whole_elements_cuts(log_size, aligned, shift, extra, pieces):
    """The classes a plan cuts pieces of whole elements into (sources and destinations at element-aligned
    addresses, the zeros after them included; ``aligned``: every piece and zero range starting at a 16-byte
    address, the common case of params from the caching allocator, which takes another cut, its tails in the
    last zero range) are among ``word_units`` of that element size: the preload leaves out none that is used."""
    from ztriton.kernels import pack_plan
    from ztriton.kernels.tuning import KERNELS_ONLY
    from ztriton.kernels.variants import WORD_COPY, word_meta

    dtype = (torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.complex128)[log_size]
    per16 = max(1, 16 // dtype.itemsize)  # elements in 16 bytes
    snap = (lambda k: k // per16 * per16) if aligned else (lambda k: k)
    source = torch.zeros(200, dtype=dtype)
    sources, offsets, at = [], [], snap(shift)
    for start, length, gap in pieces:
        length = snap(length + per16 - 1) if aligned else length
        sources.append(source[snap(start):snap(start) + length])
        offsets.append(at)
        at = snap(at + length + gap)
    dst = torch.zeros(snap(shift) + at + extra, dtype=dtype)[snap(shift):]  # a view at an offset into its storage
    plan = pack_plan(dst, sources, offsets, tuning=KERNELS_ONLY)
    preloaded = [word_meta(unit, KERNELS_ONLY) for unit in warmup.word_units(dtype.itemsize)]
    used = [meta for kernel, _, _, meta in plan.launches if kernel == WORD_COPY]
    assert used and all(meta in preloaded for meta in used), (used, preloaded)


@pytest.mark.gpu
def test_gpu_torch_cat_load_runs_on_the_device(caplog):
    index = torch.cuda.current_device()
    with caplog.at_level("DEBUG", logger="ztriton"):
        thread = warmup.load_torch_cat_in_background(index)
        thread.join(30)
    assert not thread.is_alive() and "failed" not in caplog.text, caplog.text


GPU_CHECK = """
import sys
import torch
from ztriton.kernels import Tuning, compiled, pack_plan, warmup


def loaded():  # variants loaded so far: from the compiled cache, or compiled by the JIT (by specialisation)
    jit = 0
    if "ztriton.kernels.copy" in sys.modules:
        from ztriton.kernels.copy import copy_words_kernel
        jit = len(copy_words_kernel.device_caches[0][0])
    return len(compiled.loaded_variants()) + jit


device = torch.device("cuda", 0)
assert loaded() == 0, "a fresh process has loaded nothing yet"
warmup.warm_up_in_background(device).join(120)
assert loaded() == 1, loaded()
sources = [torch.randn(4096, 64, device=device).to(torch.bfloat16) for _ in range(3)]
flat = torch.full((3 * 4096 * 64 + 64,), float("nan"), dtype=torch.bfloat16, device=device)
pack_plan(flat, sources, [0, 4096 * 64, 2 * 4096 * 64], tuning=Tuning(torch_pieces=0)).launch()
assert torch.equal(flat[:4096 * 64].view(4096, 64), sources[0])
assert loaded() == 1, "the real pack needed another variant"
assert sys.argv[-1] != "cached" or "triton" not in sys.modules, "launched from the cache, triton not imported"
print("OK")
"""


PRELOAD_CHECK = """
import sys
import torch
from ztriton.kernels import compiled, pack, warmup

element_size = None if sys.argv[-1] == "all" else int(sys.argv[-1])
classes = len(warmup.word_units(element_size))
device = torch.device("cuda", 0)
torch.zeros(1, device=device)
warmup.preload_in_background(device, element_size).join(120)
assert len(compiled.loaded_variants()) == classes, compiled.loaded_variants()
assert "triton" not in sys.modules, "the preload compiled nothing"
sources = [torch.randn(1000 + k, device=device).to(torch.bfloat16) for k in range(40)]
offsets = [2048 * k for k in range(40)]
flat = torch.full((2048 * 40,), float("nan"), dtype=torch.bfloat16, device=device)
pack(flat, sources, offsets, fresh=True)
assert all(torch.equal(flat[o:o + s.numel()], s) for o, s in zip(offsets, sources))
assert len(compiled.loaded_variants()) == classes, "the pack needed a variant the preload left out"
assert "triton" not in sys.modules, "the pack went through Triton's JIT"
print("OK")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("element_size", ["all", "2"])
def test_gpu_preload_loads_the_word_copies_a_fresh_pack_uses(tmp_path, element_size):
    """In a fresh process with the compiled cache filled: the preload loads the five word classes (or the four that
    2-byte elements can use) without importing triton, and a pack of odd-sized bf16 sources (heads and tails of
    several classes) needs no other."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ZTRITON_CACHE_DIR=str(tmp_path), ZTRITON_BACKGROUND_COMPILE="0")
    filled = subprocess.run([sys.executable, "-m", "ztriton", "compile"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert filled.returncode == 0, filled.stdout + filled.stderr
    out = subprocess.run([sys.executable, "-c", PRELOAD_CHECK, element_size], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["empty", "filled"])
def test_gpu_warm_up_loads_the_variant_a_real_pack_uses(tmp_path, cache):
    """In a fresh process (the suite's earlier GPU tests load the kernels themselves): the thread loads one
    variant (compiled by the JIT with the compiled cache empty, from the cache once a first process filled it),
    and a 16-byte-aligned bf16 pack then finds its kernel loaded (no new variant)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ZTRITON_CACHE_DIR=str(tmp_path), ZTRITON_BACKGROUND_COMPILE="0")
    if cache == "filled":  # a first process stores the variant its JIT compiled
        first = subprocess.run([sys.executable, "-c", GPU_CHECK], capture_output=True, text=True, env=env,
                               timeout=300)
        assert first.returncode == 0, first.stdout + first.stderr
    out = subprocess.run([sys.executable, "-c", GPU_CHECK, "cached" if cache == "filled" else "jit"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


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


def test_torch_s_cat_is_loaded_with_the_inputs_a_flatten_s_cat_has(monkeypatch):
    """The cat that loads torch's kernel has ``_CAT_INPUTS`` inputs of 16 int64 words, each contiguous at a 16-byte
    (here 128-byte) address: torch picks its cat kernel by the inputs' count, alignment and contiguity."""
    seen = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda parts, out: seen.append((list(parts), out)) or real_cat(parts, out=out))
    warmup._cat_once(torch.device("cpu"))
    (parts, out), = seen
    assert len(parts) == warmup._CAT_INPUTS and out.numel() == 16 * warmup._CAT_INPUTS
    assert all(p.dtype == torch.int64 and p.shape == (16,) and p.is_contiguous() for p in parts)
    assert all(p.data_ptr() % 16 == 0 for p in parts) and len({p.data_ptr() for p in parts}) == len(parts)


@pytest.mark.parametrize("count, local_rank, expected", [(8, "3", [3, 3]), (1, None, [0, 0]), (8, None, [])])
def test_the_key_s_config_parse_preloads_on_the_rank_s_device_only(started, monkeypatch, count, local_rank, expected):
    """Under the key the preload and torch's cat load start from the config's parse (``prepare_step`` calls
    ``start_preload``), on the device the warm-up would pick: LOCAL_RANK's, the only GPU's, or none."""
    asked = []
    monkeypatch.setattr(warmup, "preload_in_background", lambda device, size: asked.append((device, size)))
    monkeypatch.setattr(warmup, "load_torch_cat_in_background", asked.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    ds_config.start_preload(2)
    assert asked == ([(expected[0], 2), expected[1]] if expected else [])
