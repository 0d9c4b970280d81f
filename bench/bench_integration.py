"""The ``"partition_backend": "triton"`` config key end to end: DeepSpeed with the key on against off.

``python bench/bench_integration.py [--cases a,b,c] [--sizes 4 20] [--out bench/results/integration_h200.json]``
on one GPU; ``--smoke`` runs tiny sizes on the CPU (DeepSpeed's CPU accelerator, kernels under the
Triton interpreter). Every case runs key off (DeepSpeed's own code) and key on in the same process, on
a simulated world (torch's fake process group: this process plays one rank, collectives move nothing):

(a) ``with deepspeed.zero.Init(config_dict_or_path=cfg):`` building a module that holds one fused
    expert tensor (``nn.Parameter(torch.empty(E, out, in))`` + ``nn.init.normal_``; 4 and 20 GiB of
    bf16) beside two small Linear layers, at W = 8 as rank 0 and 7 (ranks 0 only above 8 GiB), and with
    ``offload_param: cpu`` for the smallest size. Key off, DeepSpeed creates the full tensor on the
    device in fp32 and converts it; key on, a tensor of ``sharded_init_bytes`` or more is a placeholder
    (exact sharded init): each rank replays the recorded ``normal_`` on its own slice, on the device.
    Every partition (experts included) must be bit-identical to key off's and the device generator must
    end in the same state (on a fake world key off is defined on every rank: its broadcast moves nothing,
    so rank r keeps slice r of the tensor it generated from the same seed).
(b) ZeRO-2 ``deepspeed.initialize`` of the 8.6 GiB LLM mix (``bench_kernels.llm_mix``, on the device,
    SGD, bf16) at W = 8: the optimizer's init-time flatten (DeepSpeed's ``torch.cat`` against
    ``ztriton.flatten_groups``). The flat buffers are compared bit for bit, pads included.
(c) ZeRO-3: the same mix built under ``zero.Init``, then ``deepspeed.initialize``, at W = 8 and 1: the
    stage-3 optimizer's ``lp_param_buffer`` (DeepSpeed: device -> pageable host -> device; ztriton: an
    on-device pack). Every partition's valid part is checked against the values written at build time,
    and both backends must place it at the same offset of ``lp_param_buffer``.

Per call: wall seconds (device synchronised) and peak device memory (``max_memory_allocated`` after
``reset_peak_memory_stats``, above what was allocated before the call), as bytes and as a multiple of
this rank's partition; in (b) and (c) also the flatten's / defragment's own time and peak (DeepSpeed's
function wrapped for the run, synchronised). Ratios are key on over key off from the same run. The
parameters of (b) and (c) hold a fixed bit pattern (one random period of 1,000,003 bf16 values, finite,
shifted per parameter) written in place, so both backends and both devices produce the same bits
without a full-size temporary. Results: ``bench/results/<name>.json`` (written after every case, so a
run that is cut short keeps what it finished) and a plot of the ratios; ``--smoke``: ``integration_smoke``.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.harness import CUDA, cpu_fallback  # noqa: E402

cpu_fallback()  # --smoke on a CPU

import ztriton  # noqa: E402,F401  (hooks DeepSpeed as soon as it is imported)
import deepspeed  # noqa: E402
from deepspeed.runtime.zero import stage3, stage_1_and_2  # noqa: E402

from bench.harness import (RESULTS, allocated, measure_peak, measure_with_probe, plot_ratios, ratio, release,  # noqa: E402
                           sync, write_result, ztriton_log)
from bench.models import Experts, LLMMix, expert_shape, llm_mix, matches_pattern, pattern  # noqa: E402
from ztriton.layout import zero3_slice  # noqa: E402
from ztriton.testing import bits, simulated_world  # noqa: E402

GiB = 1 << 30
DEVICE = "cuda" if CUDA else "cpu"
STARTED = time.perf_counter()
SMOKE_MIX = [[64, 64]] * 6 + [[64]] * 12 + [[1000, 8]] * 2  # bench_flatten's smoke group
MIX_LAYERS, SMOKE_LAYERS = 50, 3
BIG_GIB = 8  # (a) sizes above this run as the first --ranks rank only, and after (b) and (c)
# Smoke-size sharded_init_bytes (key on), so that the placeholders (exact sharded init) are used: ztriton compares a request's size in
# zero.Init's dtype (bf16) with it. (a): the [4, 8, 16] experts (1,024 B), not the small layers;
# (c): the two [1000, 8] tensors (16,000 B), not the [64, 64] ones (8,192 B).
SMOKE_A_HOST, SMOKE_C_HOST = 1024, 10000


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {message}", flush=True)


def ds_config(backend: str, stage: int, offload: bool = False, sharded_init_bytes: int | None = None) -> dict:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": zero, "bf16": {"enabled": True}}
    if backend == "triton":  # key off: no key at all, DeepSpeed exactly as shipped
        config["partition_backend"] = "triton"
        if sharded_init_bytes is not None:
            config["ztriton"] = {"sharded_init_bytes": sharded_init_bytes}
    return config


def _sharded_count(lines: list[str]) -> int:
    """Params initialised shard by shard (exact sharded init), from zero.Init's DEBUG lines."""
    return sum(len(re.findall(r"(?:shard by shard \(|, )\w+\.\w+ \(", line)) for line in lines
               if "initialised shard by shard" in line)


def _figures(secs: float, peak: int, unit_bytes: int, unit: str) -> dict:
    return {"seconds": secs, "peak_bytes": peak, "peak_gib": peak / GiB, f"peak_over_{unit}": peak / unit_bytes}


def _ztriton_lines(lines: list[str], backend: str, entry: dict) -> None:
    entry["ztriton_log"] = lines[:40] + ([f"... {len(lines) - 40} more"] if len(lines) > 40 else [])
    if backend == "torch" and lines:
        raise AssertionError(f"key off, yet ztriton logged: {lines[:3]}")


# ----------------------------------------------------------------------------------------- (a) zero.Init


def zero_init_once(shape, hidden, world, rank, backend, offload, sharded_init_bytes) -> tuple[dict, dict]:
    """One zero.Init build: its figures, and what is compared across backends."""
    config = ds_config(backend, 3, offload, sharded_init_bytes)
    marks: dict[str, Any] = {}

    def build():
        marks["start"] = time.perf_counter()
        init = deepspeed.zero.Init(config_dict_or_path=config)
        with init:
            marks["entered"] = time.perf_counter()
            model = Experts(shape, hidden)
        marks["init"] = init
        return model

    torch.manual_seed(0)
    before = allocated()
    with ztriton_log() as lines:
        model, secs, peak = measure_peak(build)
    experts = model.experts
    shard = zero3_slice(experts.ds_numel, world).partition_numel * experts.ds_tensor.element_size()
    entry = _figures(secs, peak, shard, "shard")
    entry.update({
        "shard_bytes": shard,
        "setup_seconds": marks["entered"] - marks["start"],
        "construct_seconds": model.construct_done - marks["entered"],
        "partition_and_exit_seconds": secs - (model.construct_done - marks["start"]),
        "experts_partition_device": str(experts.ds_tensor.device),
        "experts_partition_dtype": str(experts.ds_tensor.dtype),
        "sharded_params": _sharded_count(lines),
        "fallback_lines": sum("cannot be recorded" in line for line in lines),
    })
    _ztriton_lines(lines, backend, entry)
    compared = {
        "layout": [(n, tuple(p.ds_shape), p.ds_numel, p.ds_tensor.numel(), str(p.ds_tensor.dtype))
                   for n, p in model.named_parameters()],
        # kept on the device: the experts' shard is GiBs, and a compare there costs milliseconds
        "values": {n: bits(p.ds_tensor)[:zero3_slice(p.ds_numel, world).valid_numel(rank)].clone()
                   for n, p in model.named_parameters()},
        "rng": torch.cuda.get_rng_state() if CUDA else torch.get_rng_state(),
    }
    del model, experts, marks
    release()
    entry["leftover_bytes"] = allocated() - before
    return entry, compared


def case_zero_init(gib: float, world: int, rank: int, offload: bool, sharded_init_bytes: int | None) -> dict:
    shape, hidden = expert_shape(gib)
    label = f"{gib:g} GiB experts {shape}, W={world} rank {rank}" + (", offload_param cpu" if offload else "")
    out: dict[str, Any] = {"part": "a", "what": "zero.Init", "gib": gib, "shape": shape, "world_size": world,
                           "rank": rank, "offload_param": "cpu" if offload else None}
    compared = {}
    with simulated_world(world, rank):
        for backend in ("torch", "triton"):
            log(f"(a) zero.Init {label}, key {'on' if backend == 'triton' else 'off'} ...")
            out[backend], compared[backend] = zero_init_once(shape, hidden, world, rank, backend, offload,
                                                             sharded_init_bytes)
            row = out[backend]
            log(f"    {row['seconds']:.3f} s (construct {row['construct_seconds']:.3f} s), peak "
                f"{row['peak_gib']:.2f} GiB = {row['peak_over_shard']:.2f}x shard, experts partition on "
                f"{row['experts_partition_device']}, {row['sharded_params']} param(s) initialised shard by shard, "
                f"{row['fallback_lines']} fallback(s)")
    off, on = compared["torch"], compared["triton"]
    out["check"] = {
        "layout_identical": off["layout"] == on["layout"],
        "values_identical": off["values"].keys() == on["values"].keys() and all(
            torch.equal(off["values"][n], on["values"][n]) for n in off["values"]),
        "generator_state_identical": torch.equal(off["rng"], on["rng"]),
        "experts_sharded": out["triton"]["sharded_params"] >= 1 and out["triton"]["fallback_lines"] == 0,
    }
    del off, on
    compared.clear()
    release()
    out["ok"] = all(out["check"].values())
    _ratios(out)
    return out


def _ratios(out: dict) -> None:
    off, on = out["torch"], out["triton"]
    out["time_on_over_off"] = ratio(on["seconds"], off["seconds"])
    out["peak_on_over_off"] = ratio(on["peak_bytes"], off["peak_bytes"]) if CUDA else None


# ------------------------------------------------------------------------------ (b) ZeRO-2 initialize


def zero2_once(shapes, layers, backend) -> tuple[dict, Any, torch.Tensor]:
    before = allocated()
    model = LLMMix(shapes, layers, dtype=torch.bfloat16, device=DEVICE)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-3)
    sync()
    with ztriton_log() as lines:
        (engine, *_), secs, peak, calls = measure_with_probe(
            lambda: deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(backend, 2)),
            stage_1_and_2.DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned")
    flats = engine.optimizer.bit16_groups_flat
    group_bytes = sum(f.numel() * f.element_size() for f in flats)
    entry = _figures(secs, peak, group_bytes, "group")
    entry.update({"group_bytes": group_bytes, "groups": len(flats), "flatten_calls": calls,
                  "flatten_seconds": sum(c["seconds"] for c in calls),
                  "flatten_peak_bytes": max((c["peak_bytes"] for c in calls), default=0)})
    _ztriton_lines(lines, backend, entry)
    entry["params_match_values"] = all(matches_pattern(bits(p.data), 0, p.pattern_salt) for p in params)
    flat = flats[0]
    entry["params_alias_flat"] = all(p.data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                                     for p in params)
    return entry, (engine, model, optimizer, params, before), flat


def case_zero2(shapes, layers, world: int, rank: int, name: str) -> dict:
    out: dict[str, Any] = {"part": "b", "what": "ZeRO-2 deepspeed.initialize", "mix": name, "params": len(shapes),
                           "world_size": world, "rank": rank}
    reference = None
    with simulated_world(world, rank):
        for backend in ("torch", "triton"):
            log(f"(b) ZeRO-2 initialize, {name}, W={world} rank {rank}, key {'on' if backend == 'triton' else 'off'} ...")
            entry, keep, flat = zero2_once(shapes, layers, backend)
            if reference is None:
                reference = flat.detach().clone()  # on the device: a compare there costs milliseconds
            else:
                entry["flat_identical_to_key_off"] = reference.numel() == flat.numel() and \
                    torch.equal(bits(reference), bits(flat))
                reference = None
            engine, model, optimizer, params, before = keep
            engine.destroy()
            del engine, model, optimizer, params, keep, flat
            release()
            entry["leftover_bytes"] = allocated() - before
            out[backend] = entry
            log(f"    {entry['seconds']:.3f} s (flatten {entry['flatten_seconds'] * 1e3:.1f} ms), peak "
                f"{entry['peak_gib']:.2f} GiB = {entry['peak_over_group']:.2f}x group, values "
                f"{'ok' if entry['params_match_values'] else 'WRONG'}")
    del reference
    release()
    out["check"] = {"flat_identical": out["triton"]["flat_identical_to_key_off"],
                    "values_match": out["torch"]["params_match_values"] and out["triton"]["params_match_values"]}
    out["ok"] = all(out["check"].values()) and out["triton"]["params_alias_flat"] and out["torch"]["params_alias_flat"]
    _ratios(out)
    off, on = out["torch"], out["triton"]
    out["flatten_time_on_over_off"] = ratio(on["flatten_seconds"], off["flatten_seconds"])
    return out


# ------------------------------------------------------------------------------ (c) ZeRO-3 initialize


def zero3_once(shapes, layers, world, rank, backend, sharded_init_bytes) -> dict:
    config = ds_config(backend, 3, sharded_init_bytes=sharded_init_bytes)
    marks: dict[str, Any] = {}

    def build():
        marks["init"] = deepspeed.zero.Init(config_dict_or_path=config)
        with marks["init"]:
            return LLMMix(shapes, layers)

    release()
    before = allocated()
    entry: dict[str, Any] = {}
    with ztriton_log() as lines:
        model, secs, peak = measure_peak(build)
        params = list(model.parameters())
        partition_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
        entry["zero_init"] = _figures(secs, peak, partition_bytes, "partition")
        entry["zero_init"]["sharded_params"] = _sharded_count(lines)
        entry["partition_bytes"] = partition_bytes
        optimizer = torch.optim.SGD(params, lr=1e-3)
        sync()
        (engine, *_), secs, peak, calls = measure_with_probe(
            lambda: deepspeed.initialize(model=model, optimizer=optimizer, config=config), stage3, "defragment")
    init = entry["initialize"] = _figures(secs, peak, partition_bytes, "partition")
    init.update({"defragment_calls": calls, "defragment_seconds": sum(c["seconds"] for c in calls),
                 "defragment_peak_bytes": max((c["peak_bytes"] for c in calls), default=0)})
    _ztriton_lines(lines, backend, entry)
    buffer = engine.optimizer.lp_param_buffer
    base = buffer.untyped_storage().data_ptr()
    placement, good = [], True
    for group in engine.optimizer.fp16_groups:
        for p in group:
            sl = zero3_slice(p.ds_numel, world)
            valid = sl.valid_numel(rank)
            inside = p.ds_tensor.untyped_storage().data_ptr() == base
            placement.append((p.pattern_salt, p.ds_tensor.storage_offset() - buffer.storage_offset() if inside else None, valid))
            good &= inside and matches_pattern(bits(p.ds_tensor)[:valid], sl.rank_start(rank), p.pattern_salt)
    entry["partitions_match_values"] = bool(good)
    entry["lp_param_buffer_bytes"] = buffer.numel() * buffer.element_size()
    engine.destroy()
    del engine, model, optimizer, params, buffer, marks
    release()
    entry["leftover_bytes"] = allocated() - before
    entry["_placement"] = placement
    return entry


def case_zero3(shapes, layers, world: int, rank: int, name: str, sharded_init_bytes: int | None) -> dict:
    out: dict[str, Any] = {"part": "c", "what": "ZeRO-3 zero.Init + deepspeed.initialize", "mix": name,
                           "params": len(shapes), "world_size": world, "rank": rank}
    with simulated_world(world, rank):
        for backend in ("torch", "triton"):
            log(f"(c) ZeRO-3 zero.Init + initialize, {name}, W={world} rank {rank}, "
                f"key {'on' if backend == 'triton' else 'off'} ...")
            entry = out[backend] = zero3_once(shapes, layers, world, rank, backend, sharded_init_bytes)
            z, i = entry["zero_init"], entry["initialize"]
            log(f"    zero.Init {z['seconds']:.3f} s peak {z['peak_gib']:.2f} GiB; initialize {i['seconds']:.3f} s "
                f"(defragment {i['defragment_seconds']:.3f} s) peak {i['peak_gib']:.2f} GiB = "
                f"{i['peak_over_partition']:.2f}x partition; values {'ok' if entry['partitions_match_values'] else 'WRONG'}")
    off, on = out["torch"], out["triton"]
    same_place = off.pop("_placement") == on.pop("_placement")
    out["check"] = {"values_match": off["partitions_match_values"] and on["partitions_match_values"],
                    "same_offsets_in_lp_param_buffer": same_place}
    out["check"]["lp_param_buffer_identical_on_valid_parts"] = all(out["check"].values())
    out["ok"] = out["check"]["lp_param_buffer_identical_on_valid_parts"]
    for step in ("zero_init", "initialize"):
        out[f"{step}_time_on_over_off"] = ratio(on[step]["seconds"], off[step]["seconds"])
        out[f"{step}_peak_on_over_off"] = ratio(on[step]["peak_bytes"], off[step]["peak_bytes"]) if CUDA else None
    out["defragment_time_on_over_off"] = ratio(on["initialize"]["defragment_seconds"],
                                               off["initialize"]["defragment_seconds"])
    out["time_on_over_off"] = out["initialize_time_on_over_off"]
    out["peak_on_over_off"] = out["initialize_peak_on_over_off"]
    # The data movement itself against device copy bandwidth (read + write of every partition byte).
    seconds = on["initialize"]["defragment_seconds"]
    moved = 2 * on["partition_bytes"]
    out["defragment_gbps_on"] = moved / seconds / 1e9 if seconds else None
    out["defragment_over_copy_bandwidth"] = out["defragment_gbps_on"] / COPY_GBPS[0] \
        if out["defragment_gbps_on"] and COPY_GBPS else None
    return out


COPY_GBPS: list[float] = []  # torch's device copy_ bandwidth, measured once per run (main)


# ------------------------------------------------------------------------------------------ the run


def plan(args) -> list[tuple[str, Callable[[], dict]]]:
    """(key, job) in running order: (a) up to BIG_GIB, (b), (c), then (a) above BIG_GIB (host RNG: slow)."""
    cases = set(args.cases)
    mix, layers, mix_name = (SMOKE_MIX, SMOKE_LAYERS, "smoke mix") if args.smoke else \
        (llm_mix(), MIX_LAYERS, "LLM mix 8.6 GiB")
    a_host = SMOKE_A_HOST if args.smoke and args.sharded_init_bytes is None else args.sharded_init_bytes
    c_host = SMOKE_C_HOST if args.smoke and args.sharded_init_bytes is None else args.sharded_init_bytes
    small, big = [], []
    for gib in args.sizes:
        ranks = args.ranks if gib <= BIG_GIB else args.ranks[:1]
        target = small if gib <= BIG_GIB else big
        for rank in ranks:
            target.append((f"a_zero_init_{gib:g}gib_w{args.world}_r{rank}",
                           functools.partial(case_zero_init, gib, args.world, rank, False, a_host)))
    if not args.no_offload and args.sizes:
        gib = min(args.sizes)
        (small if gib <= BIG_GIB else big).append(
            (f"a_zero_init_{gib:g}gib_w{args.world}_r{args.ranks[0]}_offload_cpu",
             functools.partial(case_zero_init, gib, args.world, args.ranks[0], True, a_host)))
    jobs = small if "a" in cases else []
    if "b" in cases:
        jobs.append((f"b_zero2_initialize_w{args.world}_r0", functools.partial(case_zero2, mix, layers, args.world, 0,
                                                                               mix_name)))
    if "c" in cases:
        for world in args.c_worlds:
            jobs.append((f"c_zero3_initialize_w{world}_r0",
                         functools.partial(case_zero3, mix, layers, world, 0, mix_name, c_host)))
    if "a" in cases:
        jobs += big
    return jobs


def warm_up(args) -> None:
    """Every case once at the smoke size, both keys, not recorded: Triton compiles its kernels and
    DeepSpeed's first-use costs are paid here rather than in the first measured case."""
    log("warm-up (smoke sizes, not recorded) ...")
    cases = set(args.cases)
    if "a" in cases:
        case_zero_init(0, args.world, 0, False, SMOKE_A_HOST)
    if "b" in cases:
        case_zero2(SMOKE_MIX, SMOKE_LAYERS, args.world, 0, "warm-up")
    if "c" in cases:
        for world in args.c_worlds:
            case_zero3(SMOKE_MIX, SMOKE_LAYERS, world, 0, "warm-up", SMOKE_C_HOST)
    release()
    log("warm-up done")


def _fmt_peak(row: dict, unit: str) -> str:
    return f"{row['peak_gib']:7.2f} {row[f'peak_over_{unit}']:6.2f}x" if CUDA else f"{'n/a':>15s}"


def table(figures: dict) -> None:
    print(f"\n{'case':44s} {'key off s':>9s} {'key on s':>9s} {'on/off':>7s}  {'off peak GiB (x)':>16s} "
          f"{'on peak GiB (x)':>16s} {'on/off':>7s}  check")
    for key, out in figures["cases"].items():
        if "error" in out:
            print(f"{key:44s} ERROR {out['error']}")
            continue
        rows = [(key, out["torch"], out["triton"], "shard" if out["part"] == "a" else "group", "")]
        if out["part"] == "c":
            rows = [(f"{key} zero.Init", out["torch"]["zero_init"], out["triton"]["zero_init"], "partition", ""),
                    (f"{key} initialize", out["torch"]["initialize"], out["triton"]["initialize"], "partition", "")]
        for label, off, on, unit, _ in rows:
            peak_ratio = ratio(on["peak_bytes"], off["peak_bytes"]) if CUDA else None
            print(f"{label:44s} {off['seconds']:9.3f} {on['seconds']:9.3f} {on['seconds'] / off['seconds']:7.3f}  "
                  f"{_fmt_peak(off, unit):>16s} {_fmt_peak(on, unit):>16s} "
                  f"{(f'{peak_ratio:7.3f}' if peak_ratio is not None else '    n/a')}  "
                  f"{'ok' if out['ok'] else 'FAILED ' + str(out['check'])}")
        if out["part"] == "b":
            print(f"{'   of which the flatten':44s} {out['torch']['flatten_seconds']:9.4f} "
                  f"{out['triton']['flatten_seconds']:9.4f} {out['flatten_time_on_over_off'] or 0:7.3f}")
        if out["part"] == "c":
            print(f"{'   of which the defragment':44s} {out['torch']['initialize']['defragment_seconds']:9.4f} "
                  f"{out['triton']['initialize']['defragment_seconds']:9.4f} {out['defragment_time_on_over_off'] or 0:7.3f}"
                  + (f"  ztriton at {out['defragment_over_copy_bandwidth']:.2f}x copy bandwidth"
                     if out.get("defragment_over_copy_bandwidth") else ""))
    print("x: peak over this rank's shard (a: the experts tensor's partition), group (b: the flat buffer) or "
          "partition (c: all of this rank's partitions). (a): every partition and the generator state compared.")
    if not CUDA:
        print("(CPU smoke: kernels under the Triton interpreter; times say nothing about speed, no device peaks.)")


def plot(figures: dict, path: Path) -> None:
    keys = [k for k, v in figures["cases"].items() if "error" not in v]
    if not keys:
        return
    series = {"time on/off": [figures["cases"][k]["time_on_over_off"] or 0.0 for k in keys]}
    if CUDA:
        series["peak on/off"] = [figures["cases"][k]["peak_on_over_off"] or 0.0 for k in keys]
    try:
        plot_ratios(path, "partition_backend: key on / key off (same run)", keys, series, ylabel="key on / key off",
                    target=1.0)
    except ImportError as exc:  # matplotlib is optional: the JSON and the table carry every figure
        log(f"no plot ({exc})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 20], help="(a): expert tensor sizes, GiB")
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 7],
                        help=f"(a): ranks to play; sizes above {BIG_GIB} GiB play the first only")
    parser.add_argument("--world", type=int, default=8, help="(a), (b): simulated world size")
    parser.add_argument("--c-worlds", type=int, nargs="+", default=[8, 1], help="(c): simulated world sizes")
    parser.add_argument("--no-offload", action="store_true", help="(a): skip the offload_param cpu case")
    parser.add_argument("--sharded-init-bytes", type=int, default=None,
                        help="key on: ztriton.sharded_init_bytes (default: the library's own choice)")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="a folder, or a .json path whose stem is the result's name (default bench/results)")
    parser.add_argument("--name", default="integration_h200")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU too")
    parser.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logging")
    args = parser.parse_args()
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not set(args.cases) <= {"a", "b", "c"}:
        parser.error(f"--cases takes a comma-separated subset of a,b,c, got {args.cases}")
    if not CUDA and not args.smoke:
        parser.error("needs a CUDA device (or --smoke)")
    if any(not 0 <= r < args.world for r in args.ranks):
        parser.error(f"--ranks must lie in [0, {args.world})")
    out_dir, name = (args.out.parent, args.out.stem) if args.out.suffix == ".json" else (args.out, args.name)
    if args.smoke:
        args.sizes = [0]
        name = "integration_smoke" if args.out.suffix != ".json" else name
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as ds_logger

    assert get_accelerator().device_name() == DEVICE, f"DeepSpeed's accelerator is not {DEVICE}"
    if not args.verbose:
        ds_logger.setLevel(logging.WARNING)
    for device in {"cpu", DEVICE}:
        pattern(device)  # before any measurement
    if CUDA:
        from bench.harness import torch_copy_gbps

        COPY_GBPS.append(torch_copy_gbps(1 << 30))
        log(f"torch copy_ bandwidth {COPY_GBPS[0]:.0f} GB/s (1 GiB, read + write)")

    jobs = plan(args)
    figures: dict[str, Any] = {
        "config": {"cases": args.cases, "sizes_gib": args.sizes, "ranks": args.ranks, "world_size": args.world,
                   "c_world_sizes": args.c_worlds, "offload_case": not args.no_offload,
                   "sharded_init_bytes": args.sharded_init_bytes, "smoke": args.smoke,
                   "device_total_gib": torch.cuda.get_device_properties(0).total_memory / GiB if CUDA else None,
                   "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "plan": [k for k, _ in jobs]},
        "notes": [
            "Simulated worlds: torch's fake process group; this process plays one rank, collectives move nothing.",
            "Peaks: torch.cuda.max_memory_allocated after reset_peak_memory_stats, above memory_allocated before "
            "the call. Ratios: key on ('partition_backend': 'triton') over key off (no key), same run.",
            "(a) key on: tensors of sharded_init_bytes or more are placeholders and each rank replays their init on "
            "its own slice (exact sharded init): every partition's valid prefix and the device generator state "
            "after the Init are compared with key off's, bit for bit. One repetition per case, after a smoke-sized "
            "warm-up.",
            "(b) the ZeRO-2 flat buffers are compared whole (pads included) on the device, the key-off one kept "
            "as a device copy during the key-on case; every param's values are checked against the fill pattern.",
            "(c) every partition's valid part is checked against the fill pattern and must sit at the same offset "
            "of lp_param_buffer in both backends (DeepSpeed leaves partition padding unset, so pads are not compared).",
        ],
        "cases": {},
        "torch_copy_gbps": COPY_GBPS[0] if COPY_GBPS else None,
    }
    log(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; plan: {', '.join(k for k, _ in jobs)}")
    failed = False
    if not args.no_warmup:
        try:
            warm_up(args)
        except Exception as exc:
            failed = True
            figures["warmup_error"] = f"{type(exc).__name__}: {exc}"
            log(f"warm-up FAILED: {figures['warmup_error']}\n{traceback.format_exc()}")
            release()
    excepthook = sys.excepthook  # every simulated world's init_process_group wraps it in one more "[rankN]:"
    for key, job in jobs:
        try:
            figures["cases"][key] = job()
            failed |= not figures["cases"][key]["ok"]
        except Exception as exc:
            failed = True
            figures["cases"][key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            log(f"{key} FAILED: {figures['cases'][key]['error']}\n{figures['cases'][key]['traceback']}")
            release()
        sys.excepthook = excepthook
        figures["total_seconds"] = time.perf_counter() - STARTED
        write_result(name, figures, out_dir)  # after every case: a run cut short keeps what it finished
    path = write_result(name, figures, out_dir)
    plot(figures, out_dir / f"{name}.png")
    log(f"wrote {path}")
    table(figures)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
