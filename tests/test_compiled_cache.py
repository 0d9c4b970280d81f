"""The compiled kernels' cache and the launch path (``kernels/cache.py``, ``compiled.py``, ``build.py``), the route
decided by the job alone, the launch counter and the summary line's route field, ``python -m ztriton compile``.

On the CPU: the key, entries written whole and read back (a damaged one is a miss), which launches go to the
cache and which to the JIT, counting under the interpreter, the background fill's once-per-process lock, the
command's argument errors, and one real compile for sm90 with triton's bundled ptxas. On a GPU: fresh processes
that launch from the cache without importing triton, and the launches of each default flow counted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch

from ztriton.kernels import Piece, Tuning, bits, cache, compiled, make_plan, pack, state, torch_pack, variants, warmup
from ztriton.kernels.validation import Sources

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
META = variants.word_meta(16, Tuning())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ZTRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_key_names_triton_arch_and_source_without_importing_triton(monkeypatch):
    key = cache.key(90)
    assert key.startswith(f"v{cache.FORMAT}-triton{cache.triton_version()}-sm90-") and key.endswith(cache.source_hash())
    assert cache.key(80) != key and cache.key(90, version="0.0") != key
    monkeypatch.setattr(cache, "triton_version", lambda: None)
    assert cache.key(90) is None and cache.key_dir(90) is None


def test_source_hash_covers_the_kernels_source():
    from pathlib import Path

    import hashlib

    here = Path(cache.__file__).parent
    digest = hashlib.sha256((here / "copy.py").read_bytes() + (here / "descriptor.py").read_bytes()).hexdigest()
    assert cache.source_hash() == digest[:16]


def test_cache_root_from_the_environment(cache_dir, monkeypatch):
    assert cache.cache_root() == cache_dir
    monkeypatch.delenv("ZTRITON_CACHE_DIR")
    assert cache.cache_root().parts[-3:] == (".cache", "ztriton", "kernels")


def test_variant_names_differ_by_every_meta_field():
    names = {cache.variant_name(k, m) for k, m in variants.every_variant()}
    assert len(names) == len(list(variants.every_variant()))
    assert cache.variant_name("k", {"a": 1, "b": 2}) == cache.variant_name("k", {"b": 2, "a": 1})


ENTRY = dict(name="copy_words_kernel", kernel="copy_words_kernel", num_warps=2, shared=0,
             arg_types=["*i64", "*i64", "i32", "*u8"], scratch_args=2)


def test_an_entry_reads_back_whole(cache_dir):
    cache.write_entry(cache_dir / "k", "v", ENTRY, b"\x7fELF binary")
    entry = cache.read_entry(cache_dir / "k", "v")
    assert entry.binary == b"\x7fELF binary" and entry["arg_types"] == ENTRY["arg_types"]
    assert sorted(p.name for p in (cache_dir / "k").iterdir()) == [entry["cubin"], "v.json"]  # no temporary left


@pytest.mark.parametrize("damage", ["no json", "no cubin", "short cubin", "other cubin", "bad json", "old format",
                                    "missing field", "json list"])
def test_a_damaged_entry_is_a_miss(cache_dir, damage):
    folder = cache_dir / "k"
    cache.write_entry(folder, "v", ENTRY, b"0123456789")
    record = json.loads((folder / "v.json").read_text())
    if damage == "no json":
        (folder / "v.json").unlink()
    elif damage == "no cubin":
        (folder / record["cubin"]).unlink()
    elif damage == "short cubin":
        (folder / record["cubin"]).write_bytes(b"01234")
    elif damage == "other cubin":
        (folder / record["cubin"]).write_bytes(b"9876543210")
    elif damage == "bad json":
        (folder / "v.json").write_text('{"name": ')
    elif damage == "json list":
        (folder / "v.json").write_text("[]")
    else:
        if damage == "old format":
            record["format"] = cache.FORMAT - 1
        else:
            del record["shared"]
        (folder / "v.json").write_text(json.dumps(record))
    assert cache.read_entry(folder, "v") is None


def test_writers_at_once_leave_one_whole_entry(cache_dir):
    """Ranks filling one folder at once: every reader sees a whole entry or none, never a mix."""
    folder = cache_dir / "k"
    blobs = [bytes([i]) * (1000 + i) for i in range(8)]
    threads = [threading.Thread(target=cache.write_entry, args=(folder, "v", ENTRY, blob)) for blob in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entry = cache.read_entry(folder, "v")
    assert entry is not None and entry.binary in blobs
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def _sources(count, contiguous=True):
    """Facts of ``count`` pieces, built the way validate builds them, without a device."""
    zeros, ones = np.zeros(count, np.int64), np.ones(count, np.int64)
    return Sources(start=zeros, count=ones, offset=np.arange(count, dtype=np.int64), numel=ones, lo=zeros, hi=ones,
                   contiguous=np.full(count, contiguous), local=np.full(count, True))


def test_the_route_is_the_jobs_alone():
    """Torch's copies for at most Tuning.torch_pieces contiguous pieces, the kernels for anything more or strided;
    nothing a process did before (no loaded-kernels state exists to consult)."""
    from ztriton.kernels import plan

    few = Tuning().torch_pieces
    assert plan._torch_copies_suffice(_sources(few), Tuning())
    assert not plan._torch_copies_suffice(_sources(few + 1), Tuning())
    assert not plan._torch_copies_suffice(_sources(2, contiguous=False), Tuning())
    assert not plan._torch_copies_suffice(_sources(1), Tuning(torch_pieces=0))
    assert not hasattr(state, "LOADED") and not hasattr(state, "kernels_loaded")
    assert not hasattr(plan, "BEFORE_LOAD_PIECES")


def test_launches_are_counted_under_the_interpreter():
    sources = [torch.arange(5 + i, dtype=torch.float32, device=DEVICE) for i in range(Tuning().torch_pieces + 1)]
    offsets = np.cumsum([0] + [s.numel() + 1 for s in sources[:-1]]).tolist()
    end = offsets[-1] + sources[-1].numel()
    dst = torch.full((end,), float("nan"), device=DEVICE)
    plan = make_plan(dst, [Piece(s, 0, s.numel(), o) for s, o in zip(sources, offsets)], [])
    assert plan.launches and all(isinstance(k, str) for k, _, _, _ in plan.launches)
    before = state.launches()
    pack(dst, sources, offsets)
    assert state.launches() - before == len(plan.launches)
    expected = torch.empty_like(dst)
    torch_pack(expected, sources, offsets)
    assert torch.equal(bits(dst), bits(expected))
    before = state.launches()
    pack(dst[:5], sources[:1], [0])  # one contiguous piece: torch's copy, no launch
    assert state.launches() == before


class _Recorder:
    """Stands for both routes: records what compiled.launch picked."""

    def __init__(self, monkeypatch, function=True):
        self.calls = []
        self.loaded = types.SimpleNamespace(launch=lambda grid, stream, values: self.calls.append(("cache", values)))
        monkeypatch.setattr(compiled, "_function", lambda index, kernel, meta: self.loaded if function else None)
        monkeypatch.setattr(compiled, "_jit_launch", lambda kernel, grid, args, meta: self.calls.append(("jit",)) or "compiled")
        monkeypatch.setattr(compiled, "_keep", lambda *a: self.calls.append(("keep",)))
        monkeypatch.setattr(state, "interpreter_on", lambda ask=None: False)


def _fake_stream():
    return types.SimpleNamespace(device=torch.device("cuda", 0), cuda_stream=0)


def _aligned_args():
    table = torch.zeros(4, dtype=torch.int64)
    return table, table, 3, torch.zeros(32, dtype=torch.uint8)


def test_a_cached_variant_launches_from_the_cache(monkeypatch):
    rec = _Recorder(monkeypatch)
    args = _aligned_args()
    compiled.launch("copy_words_kernel", (1,), args, META, _fake_stream())
    assert rec.calls == [("cache", [args[0].data_ptr(), args[1].data_ptr(), 3, args[3].data_ptr()])]


@pytest.mark.parametrize("case", ["miss", "unaligned pointer", "64-bit int", "turned off", "cpu", "interpreter"])
def test_everything_else_goes_through_the_jit(monkeypatch, case):
    rec = _Recorder(monkeypatch, function=case != "miss")
    args, stream = list(_aligned_args()), _fake_stream()
    if case == "unaligned pointer":
        args[3] = args[3][1:]
    elif case == "64-bit int":
        args[2] = 2 ** 31
    elif case == "turned off":
        monkeypatch.setenv("ZTRITON_COMPILED", "0")
    elif case == "cpu":
        stream = None
    elif case == "interpreter":
        monkeypatch.setattr(state, "interpreter_on", lambda ask=None: True)
    before = state.launches()
    compiled.launch("copy_words_kernel", (1,), tuple(args), META, stream)
    assert rec.calls[0] == ("jit",) and state.launches() == before + 1
    # What the JIT compiled is stored only for arguments the cache's variants assume.
    assert (("keep",) in rec.calls) == (case in ("miss", "turned off", "interpreter"))


def test_a_variant_is_looked_up_once_and_a_preloads_miss_is_not_remembered(monkeypatch):
    """The first ask loads the variant from the disk (the cache's answer is kept, a miss too, so the disk is asked
    once); the preload's miss is not kept: an entry written before the first launch (another rank's JIT, the
    background fill) is still found then."""
    monkeypatch.setattr(compiled, "_functions", {})
    monkeypatch.setattr(compiled, "_by_meta", {})
    answers = [None, "loaded"]
    asked = []
    monkeypatch.setattr(compiled, "_load", lambda index, variant: asked.append(variant) or answers.pop(0))
    assert compiled.preload(0, "copy_words_kernel", META) is False  # a miss, not remembered
    assert compiled._function(0, "copy_words_kernel", META) == "loaded"  # the disk asked again
    assert compiled._function(0, "copy_words_kernel", dict(META)) == "loaded"  # remembered: not asked again
    assert len(asked) == 2 and len(set(asked)) == 1
    monkeypatch.setattr(compiled, "_load", lambda index, variant: asked.append(variant))  # a launch's miss
    assert compiled._function(1, "copy_words_kernel", META) is None
    assert compiled._function(1, "copy_words_kernel", META) is None and len(asked) == 3


def _compiled_kernel(**metadata):
    md = dict(name="copy_words_kernel", num_warps=2, shared=0, num_ctas=1, launch_cooperative_grid=False,
              launch_pdl=False, global_scratch_size=0, profile_scratch_size=0, tmem_size=0, hash="h", target="t")
    md.update(metadata)
    signature = {"parts_ptr": "*i64", "first_ptr": "*i64", "n_parts": "i32", "dst_ptr": "*u8", "WORD": "constexpr"}
    return types.SimpleNamespace(metadata=types.SimpleNamespace(**md), asm={"cubin": b"cubin"},
                                 src=types.SimpleNamespace(signature=signature,
                                                           fn=types.SimpleNamespace(__name__="copy_words_kernel")))


def test_entry_of_a_compiled_kernel():
    from ztriton.kernels.build import entry_of

    metadata, cubin = entry_of(_compiled_kernel())
    assert cubin == b"cubin" and metadata["arg_types"] == ["*i64", "*i64", "i32", "*u8"]
    assert metadata["scratch_args"] == 2 and metadata["shared"] == 0
    for unsupported in (dict(num_ctas=2), dict(launch_pdl=True), dict(global_scratch_size=64),
                        dict(shared=300 * 1024), dict(launch_cooperative_grid=True)):
        assert entry_of(_compiled_kernel(**unsupported)) is None, unsupported


def test_a_jit_launch_stores_its_variant_and_starts_one_fill(cache_dir, monkeypatch):
    monkeypatch.setattr(compiled, "_saved", set())
    monkeypatch.setattr(compiled, "_folder", lambda index: cache_dir / "key")
    fills = []
    monkeypatch.setattr(warmup, "fill_in_background", fills.append)
    compiled._keep(0, "copy_words_kernel", META, _compiled_kernel())
    compiled._keep(0, "copy_words_kernel", META, _compiled_kernel())
    entry = cache.read_entry(cache_dir / "key", cache.variant_name("copy_words_kernel", META))
    assert entry.binary == b"cubin" and fills == [0]


def test_the_background_fill_starts_once_and_one_per_folder(cache_dir, monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, **kw: started.append((command, kw["env"])) or "proc")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(warmup, "_fill_started", False)
    assert warmup.fill_in_background(0) == "proc"
    assert warmup.fill_in_background(0) is None  # once per process
    command, env = started[0]
    assert command[1:] == ["-m", "ztriton", "compile", "--arch", "90", "--background"]
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "TRITON_INTERPRET" not in env
    monkeypatch.setattr(warmup, "_fill_started", False)  # another process: the fresh lock says someone fills
    assert warmup.fill_in_background(0) is None and len(started) == 1
    lock = cache.key_dir(90) / ".filling"
    os.utime(lock, (0, 0))  # a stale lock is taken over
    monkeypatch.setattr(warmup, "_fill_started", False)
    assert warmup.fill_in_background(0) == "proc"
    monkeypatch.setattr(warmup, "_fill_started", False)
    monkeypatch.setenv("ZTRITON_BACKGROUND_COMPILE", "0")
    assert warmup.fill_in_background(0) is None and len(started) == 2


@pytest.mark.parametrize("argv, message", [
    (["compile", "--jobs", "0"], "--jobs must be at least 1"),
    (["compile", "--arch", "9"], "--arch takes a compute capability"),
])
def test_compile_command_argument_errors(capsys, argv, message):
    from ztriton.__main__ import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_compile_command_needs_an_arch_without_a_gpu(capsys):
    from ztriton.__main__ import main

    before = dict(os.environ)
    assert main(["compile", "--cache-dir", "/nonexistent/ztriton-test"]) == 2
    assert "name the architecture with --arch" in capsys.readouterr().err
    assert dict(os.environ) == before  # the interpreter setting and cache folder of the caller's process stay


def test_compile_for_sm90_without_a_gpu(cache_dir):
    """Triton's bundled ptxas compiles for a named architecture on a machine without one: the entry reads back,
    with the launch metadata the direct path needs, and a second fill compiles nothing."""
    from ztriton.kernels.build import compile_into

    one = [("copy_words_kernel", META)]
    folder = cache_dir / "sm90"
    outcomes = compile_into(90, one, folder, jobs=1)
    variant = cache.variant_name(*one[0])
    assert outcomes == {variant: "compiled"}
    entry = cache.read_entry(folder, variant)
    assert entry["name"] == "copy_words_kernel" and entry["num_warps"] == META["num_warps"]
    assert entry["arg_types"] == ["*i64", "*i64", "i32", "*u8"] and entry.binary[:4] == b"\x7fELF"
    assert compile_into(90, one, folder, jobs=1) == {variant: "cached"}


def test_summary_line_names_the_route_and_launches(monkeypatch):
    from ztriton.integrations.deepspeed import report

    monkeypatch.setattr(report, "_is_rank0", lambda: False)  # the line is returned, not logged
    monkeypatch.setattr(report, "_steps", threading.local())  # as in a fresh process
    count = [10]
    monkeypatch.setattr(state, "thread_launches", lambda: count[0])
    line = report.step_summary("a", tier="device", nbytes=1, seconds=None, peak_bytes=None)
    assert "route=triton, launches=10" in line  # every launch since the process started, for a first line

    def work():
        count[0] += 3

    report.timed(work)
    line = report.step_summary("b", tier="device", nbytes=1, seconds=None, peak_bytes=None, extra=1)
    assert line.endswith("route=triton, launches=3, extra=1")
    assert "route=torch" in report.step_summary("c", tier="device", nbytes=1, seconds=None, peak_bytes=None)
    clock = report.StreamClock(torch.device("cpu"))
    count[0] += 2
    clock.stop()
    assert clock.launches == 2


def test_a_step_counts_its_own_threads_launches_only():
    """Launches another thread issues (a warm-up, a user's own work) during a step are the process's, not the
    step's: the summary line of a step on this thread does not count them."""
    from ztriton.integrations.deepspeed import report

    def elsewhere():
        for _ in range(5):
            state.count_launch()

    total, mine = state.launches(), state.thread_launches()

    def work():
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        state.count_launch()

    _, _, _ = report.timed(work)
    assert state.launches() == total + 6 and state.thread_launches() == mine + 1
    line = report.step_summary("a", tier="device", nbytes=1, seconds=None, peak_bytes=None)
    assert "route=triton, launches=1" in line


DEFAULT_FLOWS = """
import sys
import torch
import ztriton
from ztriton.kernels import pack_slices, state

device = torch.device("cuda", 0)
counts = {}
params = [torch.randn(64 + i, 32, device=device, dtype=torch.bfloat16, requires_grad=True) for i in range(200)]
before = state.launches()
ztriton.flatten_groups([params])
counts["flatten"] = state.launches() - before
parts = [torch.randn(100 + i, device=device, dtype=torch.bfloat16) for i in range(200)]
before = state.launches()
ztriton.defragment(parts)
counts["defragment"] = state.launches() - before
slices = [(torch.randn(50, device=device, dtype=torch.bfloat16), 0, 50, 60 * k) for k in range(17)]
dst = torch.empty(60 * 17, device=device, dtype=torch.bfloat16)
before = state.launches()
pack_slices(dst, slices)
counts["slices17"] = state.launches() - before
before = state.launches()
pack_slices(dst, slices[:16])
counts["slices16"] = state.launches() - before
torch.cuda.synchronize()
print("COUNTS", counts, "triton" in sys.modules)
"""


@pytest.mark.gpu
def test_gpu_default_flows_launch_the_kernels_from_the_cache(tmp_path):
    """Fresh processes: the ZeRO-2 flatten, the ZeRO-3 defragment and a 17-piece pack_slices (a loader job) launch
    the kernels, a 16-piece one takes torch's copies; with the cache filled by a first process, the next one
    launches the same kernels without importing triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ZTRITON_CACHE_DIR=str(tmp_path), ZTRITON_BACKGROUND_COMPILE="0")
    outs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", DEFAULT_FLOWS], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        outs.append(out.stdout.split("COUNTS", 1)[1].strip())
    first, second = outs
    counts = eval(first.rsplit(" ", 1)[0])  # noqa: S307 -- our own subprocess's dict
    assert counts["flatten"] > 0 and counts["defragment"] > 0 and counts["slices17"] > 0, counts
    assert counts["slices16"] == 0, counts
    assert second.endswith("False"), "the second process imported triton: " + second
    assert second.rsplit(" ", 1)[0] == first.rsplit(" ", 1)[0]
