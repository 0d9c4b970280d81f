"""The demo behind ``python -m ztriton demo``: a built-in MoE-shaped model, DeepSpeed's default path
and ``"partition_backend": "triton"`` side by side.

Three load-time steps, each run with the key off (DeepSpeed's own code) and on (ztriton), as one rank
of a simulated data-parallel world (torch's fake process group: every rank's layout, one process):

* ZeRO-3 ``zero.Init`` building the model: the fused expert tensors are the largest params; with the
  key each rank generates only its own slice, on the device (exact sharded init: the values equal
  DeepSpeed's bit for bit).
* ZeRO-3 ``deepspeed.initialize``: the optimizer's flat partition buffer (``lp_param_buffer``).
* ZeRO-2 ``deepspeed.initialize``: the optimizer's flat buffer of every param (``bit16_groups_flat``).

Bytes are compared (they must be identical, run to run and path to path); each step runs nine times on
a fresh model, and the median time and the largest peak device memory are printed side by side.

The output is a short header, one progress line per step and the table; ztriton's own lines (which path
and tier each call took, and why) are printed only with ``verbose`` (``--verbose``). On the CPU,
what ztriton's lines call the device is host memory, and they say so.
"""
from __future__ import annotations

import gc
import logging
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ztriton.layout import zero3_slice
from ztriton.integrations.deepspeed.worlds import simulated_world
from ztriton.kernels import bits
from ztriton.memory import measure_peak

DTYPE = torch.bfloat16
REPEATS = 9  # runs of each step and path; the table shows the median (3 left the 10 ms rows to a few ms of noise)


@dataclass(frozen=True)
class MoEShape:
    """Sizes of the built-in model: ``layers`` blocks of attention plus ``experts`` fused experts."""

    hidden: int
    ffn: int
    experts: int
    layers: int
    vocab: int


GPU_SHAPE = MoEShape(hidden=2048, ffn=1024, experts=64, layers=2, vocab=32000)
CPU_SHAPE = MoEShape(hidden=64, ffn=32, experts=4, layers=2, vocab=256)
WARMUP_SHAPE = MoEShape(hidden=64, ffn=32, experts=4, layers=1, vocab=64)  # compiles the kernels once


class Weights(torch.nn.Module):
    """Parameters of the given shapes, initialised in ``__init__`` as a model does (``nn.init.normal_``
    from a seeded generator). With the key, the large ones are exact-sharded-init placeholders: each
    rank draws only its own slice, and the values equal DeepSpeed's bit for bit. Under ``zero.Init``
    each module is partitioned as soon as its own ``__init__`` returns, hence one module per group of
    params and the init inside it."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int):
        super().__init__()
        torch.manual_seed(seed)  # each module's values independent of what was built before it
        for name, shape in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape))
            torch.nn.init.normal_(param, std=0.02)
            self.register_parameter(name, param)


class MoEModel(torch.nn.Module):
    """Embedding, then per layer attention weights, a router and two fused expert tensors."""

    def __init__(self, shape: MoEShape):
        super().__init__()
        h, f, e = shape.hidden, shape.ffn, shape.experts
        self.embed = Weights({"weight": (shape.vocab, h)}, seed=1)
        self.attention = torch.nn.ModuleList(
            Weights({"norm": (h,), "qkv": (3 * h, h), "o": (h, h), "router": (e, h)}, seed=10 + i)
            for i in range(shape.layers))
        self.experts = torch.nn.ModuleList(
            Weights({"up": (e, 2 * f, h), "down": (e, h, f)}, seed=20 + i) for i in range(shape.layers))


def config(backend: str, stage: int, sharded_init_bytes: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
            "partition_backend": backend, "ztriton": {"sharded_init_bytes": sharded_init_bytes}}


@dataclass
class Measured:
    seconds: float
    peak_mib: float | None
    bits: list[torch.Tensor] | None  # what must be identical between the two paths (CPU copies); None: runs differed


def _measure(device: str, step: Callable[[], list[torch.Tensor]]) -> Measured:
    """Run ``step`` once: seconds, peak of newly allocated device memory (MiB), the bytes it returns."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    values, seconds, peak = measure_peak(step)
    return Measured(seconds, peak / 2**20 if device == "cuda" else None, [b.to("cpu") for b in values])


def _median(runs: list[Measured]) -> Measured:
    """One row's figures from repeated runs: the median time, the largest peak, the first run's bytes
    (every run's bytes must match it)."""
    same = all(_same_bits(r.bits, runs[0].bits) for r in runs[1:])
    peaks = [r.peak_mib for r in runs if r.peak_mib is not None]
    return Measured(statistics.median(r.seconds for r in runs), max(peaks) if peaks else None,
                    runs[0].bits if same else None)


def _same_bits(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    """Both runs' bytes known and equal, tensor by tensor."""
    return (a is not None and b is not None and len(a) == len(b)
            and all(torch.equal(x, y) for x, y in zip(a, b)))


def _valid_partitions(model: torch.nn.Module, world_size: int, rank: int) -> list[torch.Tensor]:
    """Each param's partition up to its valid end (DeepSpeed leaves the padding uninitialised)."""
    return [bits(p.ds_tensor)[:zero3_slice(p.ds_numel, world_size).valid_numel(rank)].clone()
            for p in model.parameters()]


def zero_init_step(shape: MoEShape, backend: str, world_size: int, rank: int, sharded_init_bytes: int):
    import deepspeed

    def step():
        with deepspeed.zero.Init(config_dict_or_path=config(backend, 3, sharded_init_bytes)):
            model = MoEModel(shape)
        return _valid_partitions(model, world_size, rank)
    return step


def zero3_optimizer_step(shape: MoEShape, backend: str, world_size: int, rank: int, sharded_init_bytes: int):
    """deepspeed.initialize at stage 3 of a model built under zero.Init (not timed): lp_param_buffer."""
    import deepspeed

    cfg = config(backend, 3, sharded_init_bytes)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = MoEModel(shape)

    def step():
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                     config=cfg)
        flat, at, out = optimizer.lp_param_buffer, 0, []
        for p in (p for group in optimizer.fp16_groups for p in group):
            out.append(bits(flat[at:at + zero3_slice(p.ds_numel, world_size).valid_numel(rank)]).clone())
            at += p.ds_tensor.numel()
        engine.destroy()
        return out
    return step


def zero2_optimizer_step(shape: MoEShape, backend: str, device: str):
    """deepspeed.initialize at stage 2 of a model built plainly on the device (not timed): the flatten."""
    import deepspeed

    with torch.device(device):  # built where it will live: the host's serial generator would take seconds
        model = MoEModel(shape).to(dtype=DTYPE)

    def step():
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                     config=config(backend, 2, 0))
        out = [bits(flat).clone() for flat in optimizer.bit16_groups_flat]
        engine.destroy()
        return out
    return step


STEPS = (("ZeRO-3 zero.Init (model build)", "zero_init"),
         ("ZeRO-3 initialize (lp_param_buffer)", "zero3_optimizer"),
         ("ZeRO-2 initialize (flatten)", "zero2_optimizer"))


def run_steps(shape: MoEShape, device: str, world_size: int, sharded_init_bytes: int, quiet: bool = False,
              verbose: bool = False):
    """Every step with the key off, then on, as rank 0 of the simulated world: table rows. Unless ``quiet``,
    one progress line per step (``[1/3] step ... key off 7.5 ms, key on 11.0 ms, bytes identical``); with
    ``verbose`` ztriton's per-call lines come between, so the step's line is printed before them."""

    rows = []
    for number, (label, kind) in enumerate(STEPS, 1):
        if not quiet:
            print(f"[{number}/{len(STEPS)}] {label} ...", end="\n" if verbose else " ", flush=True)
        measured = {}
        for backend in ("torch", "triton"):
            runs = []
            for _ in range(REPEATS):  # each on a fresh model: a single run of a few ms is mostly noise
                with simulated_world(world_size, 0):
                    if kind == "zero_init":
                        step = zero_init_step(shape, backend, world_size, 0, sharded_init_bytes)
                    elif kind == "zero3_optimizer":
                        step = zero3_optimizer_step(shape, backend, world_size, 0, sharded_init_bytes)
                    else:
                        step = zero2_optimizer_step(shape, backend, device)
                    runs.append(_measure(device, step))
                    del step
            measured[backend] = _median(runs)
        off, on = measured["torch"], measured["triton"]
        same = _same_bits(off.bits, on.bits)
        rows.append((label, off.seconds, off.peak_mib, on.seconds, on.peak_mib, same))
        if not quiet:
            done = (f"key off {off.seconds * 1e3:.1f} ms, key on {on.seconds * 1e3:.1f} ms, "
                    f"bytes {'identical' if same else 'DIFFERENT'}")
            print(f"[{number}/{len(STEPS)}] {label}: {done}" if verbose else done, flush=True)
    return rows


class _DropMessage:
    """A logging filter that drops records whose message contains ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def quiet_foreign_warnings() -> None:
    """Silence, precisely, the warnings the demo would print that are neither ztriton's nor about the
    user's setup: each comes from DeepSpeed 0.19.8 calling torch, not from anything a user can change.

    DeepSpeed's logger stays at its default level, so its own lines and ztriton's (which go through it,
    see :mod:`.report`) still show."""
    import warnings

    # DeepSpeed's ZeRO-3 and ZeRO-2 call these c10d functions, which torch 2.13 deprecates in favour of
    # *_single; the demo cannot change DeepSpeed's calls.
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning)
    # DeepSpeed's modules decorate with torch.jit.script_method at import (deprecated in torch 2.13).
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.* is deprecated", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.* is deprecated", category=FutureWarning)
    from deepspeed.utils import logger as deepspeed_logger  # after the filters: importing it warns too

    # The demo uses torch.optim.SGD on purpose (no optimizer state to allocate, so the peaks compare the data
    # movement only) and says so with "zero_allow_untested_optimizer"; DeepSpeed still warns on every engine.
    deepspeed_logger.addFilter(_DropMessage("You are using ZeRO with an untested optimizer"))


class _SayHostMemory:
    """On the CPU, what ztriton's lines call the device (``tier=device``, ``device -- free 21.59 GiB``) is host
    memory: a logging filter that says so in the line (a filter may rewrite the record it passes)."""

    WORDS = (("tier=device", "tier=device (host memory)"), (": device -- free", ": device (host memory) -- free"),
             ("by tier device", "by tier device (host memory)"), ("peak device n/a", "peak n/a"))

    def filter(self, record) -> bool:
        message = record.getMessage()
        if any(old in message for old, _ in self.WORDS):
            for old, new in self.WORDS:
                message = message.replace(old, new)
            record.msg, record.args = message, ()
        return True


class _DropOurInfo:
    """A logging filter for DeepSpeed's handlers: drops ztriton's INFO lines (its banners and per-step
    summaries go through DeepSpeed's logger), keeps every warning and every line of DeepSpeed's own."""

    def filter(self, record) -> bool:
        return record.levelno >= logging.WARNING or not record.getMessage().startswith("ztriton: ")


def _describe(device: str, world_size: int, shape: MoEShape, numel: int) -> None:
    """The header: what runs, where, and how to read the table."""
    where = ("cuda (" + torch.cuda.get_device_name() + ")" if device == "cuda" else
             "cpu (kernels under the Triton interpreter; memory is host memory, its peak not measured)")
    print('ztriton demo: DeepSpeed ZeRO\'s load-time steps, "partition_backend" off (DeepSpeed) and on (ztriton)')
    print(f"  device: {where}")
    print(f"  world:  {world_size} ranks, simulated; this process is rank 0")
    print(f"  model:  built-in MoE, hidden {shape.hidden}, {shape.experts} fused experts x {shape.layers} layers, "
          f"{numel * 2 / 2**20:.1f} MiB of bf16 params")
    print(f"  each step runs {REPEATS} times per path on a fresh model: median times; the bytes must be identical",
          flush=True)


def run(device: str, world_size: int, json_path: str | None = None, verbose: bool = False) -> int:
    quiet_foreign_warnings()
    from deepspeed.utils import logger as deepspeed_logger

    ours = logging.getLogger("ztriton")  # which path and tier ztriton took, and why: --verbose
    ours.setLevel(logging.INFO if verbose else logging.WARNING)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  %(message)s"))
    # banners and step summaries already show through DeepSpeed's logger (see .report): not twice
    handler.addFilter(lambda record: not getattr(record, "ztriton_report", False))
    if device == "cpu":
        handler.addFilter(_SayHostMemory())
    # DeepSpeed's handlers show ztriton's banners and step summaries whatever the "ztriton" logger's level:
    # without --verbose they drop them; on the CPU they say host memory.
    ds_filter = _DropOurInfo() if not verbose else _SayHostMemory() if device == "cpu" else None
    added = [(h, ds_filter) for h in deepspeed_logger.handlers] if ds_filter is not None else []
    for h, f in added:
        h.addFilter(f)
    ours.addHandler(handler)
    try:
        shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
        # Params of this size or more are sharded-init placeholders under the key: the fused experts.
        sharded_init_bytes = 256 * 2**20 if device == "cuda" else 4096
        numel = shape.vocab * shape.hidden + shape.layers * (
            shape.hidden * (1 + 4 * shape.hidden + shape.experts) + 3 * shape.experts * shape.ffn * shape.hidden)
        _describe(device, world_size, shape, numel)
        if device == "cuda":
            print("[0/3] warm-up on a tiny model (loads the kernels) ...", end=" ", flush=True)
            run_steps(WARMUP_SHAPE, device, world_size, 4096, quiet=True)
            print("done", flush=True)
        rows = run_steps(shape, device, world_size, sharded_init_bytes, verbose=verbose)
    finally:
        ours.removeHandler(handler)
        for h, f in added:
            h.removeFilter(f)
    _print_table(rows, device)
    if json_path is not None:
        _write_json(json_path, rows, device, world_size, shape, numel, sharded_init_bytes)
    return 0 if all(r[-1] for r in rows) else 1


def _write_json(path: str, rows, device: str, world_size: int, shape: MoEShape, numel: int,
                sharded_init_bytes: int) -> None:
    """The table as ``--json`` writes it: each row's median seconds and largest peak, key off and on."""
    import dataclasses
    import json
    import platform

    import deepspeed
    import triton

    environment = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                   "deepspeed": deepspeed.__version__,
                   "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"}
    out = {"command": "python -m ztriton demo", "environment": environment, "world_size": world_size,
           "model": dataclasses.asdict(shape), "model_mib_bf16": numel * 2 / 2**20, "sharded_init_bytes": sharded_init_bytes,
           "repeats": REPEATS, "rows": [
               {"step": name, "key_off_s": off_s, "key_off_peak_mib": off_peak, "key_on_s": on_s,
                "key_on_peak_mib": on_peak, "bytes": "identical" if same else "DIFFERENT"}
               for name, off_s, off_peak, on_s, on_peak, same in rows]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}", flush=True)


def _print_table(rows, device: str) -> None:
    def mib(v):
        return f"{v:9.1f}" if v is not None else "      n/a"

    print()
    print(f"{'step (key off = DeepSpeed, on = ztriton)':40s} {'off ms':>8s} {'peak MiB':>9s} {'on ms':>8s} "
          f"{'peak MiB':>9s} {'bytes':>10s}")
    for name, ds_s, ds_peak, zt_s, zt_peak, same in rows:  # ms: seconds to 3 places hid the 10 ms rows' differences
        print(f"{name:40s} {ds_s * 1e3:8.1f} {mib(ds_peak)} {zt_s * 1e3:8.1f} {mib(zt_peak)} "
              f"{'identical' if same else 'DIFFERENT':>10s}")
    if device == "cpu":
        print("\n(CPU: the kernels run under the Triton interpreter, so ztriton's times here say nothing about "
              "its speed on a GPU; peak memory is measured on CUDA only. `--verbose` shows ztriton's own lines.)")
    else:
        print("\n(peak MiB: device memory above the step's start, the largest of the runs. `--verbose` shows "
              "ztriton's own lines: path, tier and why.)")
