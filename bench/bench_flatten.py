"""ZeRO-1/2 flatten on one GPU: ztriton.flatten_groups' tiers against DeepSpeed's two paths.

``python bench/bench_flatten.py [--out DIR] [--sizes 8.6 40] [--skip-host] [--device-only] [--keep-cache]
[--kernels-loaded] [--smoke]``

One optimizer group of bf16 params, the LLM mix (200 x [4096, 4096], 400 x [4096], 2 x [151936, 4096],
8.6 GiB) and a 40 GiB version (1200 x [4096, 4096], 2400 x [4096], 2 x [151936, 4096]), laid out as
DeepSpeed 0.19.8 does at W = 8 with parameter_alignment (the process is rank 3 of a simulated world
of 8 on torch's fake process group, so collectives move nothing). Per case, each method runs on
freshly generated params (the call consumes them: they end up aliasing the flat buffer):

* ``deepspeed_device``: DeepSpeed's on-device flatten (params + pad tensors, ``align_dense_tensors``,
  ``_flatten_dense_tensors``), then the params re-pointed at the buffer;
* ``deepspeed_cpu_fallback``: its insufficient-memory path (``param.data.cpu()`` for each param, the
  device copies freed, the same flatten on the CPU, ``.to(device)``, re-pointing);
* ``ztriton_device``, ``ztriton_evict`` (a forced budget of half the group: half of it goes through
  pinned host memory), ``ztriton_distributed`` (the same budget, so the params are freed before the
  flat buffer is allocated; its time is the window pack alone, timed separately, since the all-gather
  does nothing here; its peak is the whole call's), ``ztriton_host``.

Time is wall clock around the call (synchronised); peak is ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``, above what was allocated before the call (the params). Every result is
checked bit for bit first: each param's bytes at its offset, zeros in every pad (the distributed tier:
this rank's window, from the window pack). DeepSpeed's flatten is its own ``align_dense_tensors``
with pad tensors, through ``ztriton.testing.deepspeed_flatten``.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.harness import CUDA, cpu_fallback  # noqa: E402

cpu_fallback()  # --smoke on a CPU

import torch.distributed as dist  # noqa: E402

import ztriton  # noqa: E402
from bench.bench_kernels import WORLD, deepspeed_flatten, llm_mix  # noqa: E402
from bench.harness import (RESULTS, free_device_memory as free_memory, gbps, kernel_launches_skipped,  # noqa: E402
                           measure_peak, plot_ratios, time_ms, torch_copy_gbps, write_result)
from ztriton import memory  # noqa: E402
from ztriton.kernels import pack_plan, state as kernel_state  # noqa: E402
from ztriton.layout import zero12_group_layout  # noqa: E402

DTYPE = torch.bfloat16
RANK = 3
GiB = 1 << 30
DEVICE = "cuda" if CUDA else "cpu"
SMOKE_SHAPES = [[64, 64]] * 6 + [[64]] * 12 + [[1000, 8]] * 2
# --keep-cache: the CUDA caching allocator keeps its blocks between calls (a warm process: the flat buffer's
# allocation is a cache hit for both paths); by default each call starts from an emptied cache.
KEEP_CACHE = [False]


def llm_mix_40() -> list[list[int]]:
    """The LLM mix with 6x the layers: 39.8 GiB of bf16."""
    return [[4096, 4096]] * 1200 + [[4096]] * 2400 + [[151936, 4096]] * 2


# ------------------------------------------------------------------------------------------ set-up


@contextlib.contextmanager
def simulated_world(world: int, rank: int):
    """Rank ``rank`` of ``world`` on torch's fake process group (no DeepSpeed needed)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_params(shapes, seed: int = 0) -> list[torch.nn.Parameter]:
    """Random bf16 params, the same bits every time for a seed (so results can be checked against them
    after the originals are gone)."""
    return [torch.nn.Parameter(_param_values(shape, seed, i)) for i, shape in enumerate(shapes)]


def _param_values(shape, seed: int, index: int) -> torch.Tensor:
    generator = torch.Generator(device=DEVICE).manual_seed(seed * 1_000_003 + index)
    return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.float32).to(DTYPE)


def check(buf: torch.Tensor, layout, shapes, seed: int = 0, window: tuple[int, int] | None = None) -> None:
    """``buf`` holds elements ``[w0, w1)`` of the flat layout: each param's regenerated bits at its
    offset, zeros in every pad and in the tail. Exact (integer views); one param in memory at a time."""
    w0, w1 = window or (0, layout.total_numel)
    assert buf.numel() == w1 - w0, f"buffer has {buf.numel()} elements, the window {w1 - w0}"
    ints = buf.view(torch.int16)
    zero_ranges = [(off + n, off + n + pad) for off, n, pad in zip(layout.offsets, layout.numels, layout.paddings)]
    zero_ranges.append((layout.packed_numel, layout.total_numel))
    for index, off, n in zip(layout.order, layout.offsets, layout.numels):
        lo, hi = max(off, w0), min(off + n, w1)
        if lo < hi:
            want = _param_values(shapes[index], seed, index).reshape(-1)[lo - off:hi - off]
            assert torch.equal(ints[lo - w0:hi - w0], want.view(torch.int16)), f"param {index} differs"
    for a, b in zero_ranges:
        lo, hi = max(a, w0), min(b, w1)
        if lo < hi:
            assert int(torch.count_nonzero(ints[lo - w0:hi - w0])) == 0, f"pad [{a}, {b}) is not zero"


def budget_headroom(budget: int) -> int:
    """The headroom_bytes that leaves ``budget`` bytes of the probe's free memory to the policy."""
    return max(0, memory.probe_memory(DEVICE).device_free - budget)


# --------------------------------------------------------------------------------------- the methods


def _alias(params, flat, layout, shapes) -> None:
    """DeepSpeed's ``_update_model_bit16_weights``: each param's data becomes its view of the buffer."""
    for index, off, n in zip(layout.order, layout.offsets, layout.numels):
        params[index].data = flat.narrow(0, off, n).view(shapes[index])


def deepspeed_device(params, layout, shapes, headroom=None) -> torch.Tensor:
    flat = deepspeed_flatten(params, layout).detach()
    _alias(params, flat, layout, shapes)
    return flat


def deepspeed_cpu_fallback(params, layout, shapes, headroom=None) -> torch.Tensor:
    """``DeepSpeedZeroOptimizer.__init__`` without room on the device: via the CPU."""
    cpu = [p.data.cpu() for p in params]
    for p in params:
        p.data = torch.empty(1, device=DEVICE)
    if CUDA:
        torch.cuda.empty_cache()
    flat = deepspeed_flatten(cpu, layout).to(DEVICE)
    del cpu
    _alias(params, flat, layout, shapes)
    return flat


def ztriton_tier(tier: str):
    def run(params, layout, shapes, headroom=None) -> torch.Tensor:
        (group,) = ztriton.flatten_groups([params], parameter_alignment=True, tier=tier, headroom_bytes=headroom)
        assert group.tier.value == tier, f"asked for tier {tier}, got {group.tier}"
        return group.flat
    return run


def run_method(label, method, shapes, layout, entry, reps: int, checked: bool = True,
               budget: int | None = None) -> None:
    """One checked call (timed too when ``reps`` is 0), then ``reps`` timed calls, each on fresh params.

    ``budget``: device bytes the policy may use, set through headroom_bytes from a probe taken just
    before the call (with the fresh params resident), outside the timing.

    ``checked=False``: only that the params alias the result (the distributed tier on the fake process
    group, whose all-gather fills the buffer differently across torch versions; its window pack is
    checked by :func:`bench_window`).
    """
    samples = []
    for rep in range(1 + reps):
        params = make_params(shapes)
        headroom = None if budget is None else budget_headroom(budget)
        launched = kernel_state.launches()
        flat, secs, peak = measure_peak(lambda: method(params, layout, shapes, headroom))
        launches = kernel_state.launches() - launched  # the kernels' launches in this call (0: torch's copies)
        if rep == 0:
            first = secs  # the process's first call of this method (pinned memory, if any, allocated here)
            if checked:
                check(flat, layout, shapes)
        if rep > 0 or reps == 0:
            samples.append((secs, peak))
        aliased = all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
        assert aliased, f"{label}: params do not alias the flat buffer"
        del params, flat
        if not KEEP_CACHE[0]:
            free_memory()
    nbytes = layout.total_numel * 2
    secs = statistics.median(s for s, _ in samples)
    peak = max(p for _, p in samples)
    entry[label] = {"seconds": secs, "first_call_seconds": first, "peak_gib": peak / GiB,
                    "peak_over_group": peak / nbytes, "runs": len(samples), "launches": launches}
    print(f"   {label:26s} {secs * 1e3:10.1f} ms  launches {launches:3d}  peak +{peak / GiB:6.2f} GiB "
          f"({peak / nbytes:.2f}x group; first call {first * 1e3:.1f} ms)", flush=True)


def bench_window(shapes, layout, entry, copy_bw) -> None:
    """The distributed tier's own work at W = 8: this rank's window packed from all params."""
    params = make_params(shapes)
    w0, w1 = layout.rank_window(RANK)
    part = torch.empty(w1 - w0, dtype=DTYPE, device=DEVICE)
    ordered = [params[i].detach() for i in layout.order]
    plan = pack_plan(part, ordered, layout.offsets, window=(w0, w1))
    plan.launch()
    check(part, layout, shapes, window=(w0, w1))
    ms = time_ms(plan.launch)
    end_to_end_ms = time_ms(lambda: pack_plan(part, ordered, layout.offsets, window=(w0, w1)).launch(),
                            warmup_ms=10, rep_ms=100)
    nbytes = 2 * part.numel() * 2
    entry["ztriton_distributed"].update({
        "window_pack_ms": ms, "window_pack_plan_and_launch_ms": end_to_end_ms, "window_gib": part.numel() * 2 / GiB,
        "window_gbps": gbps(nbytes, ms), "window_ratio_to_copy": gbps(nbytes, ms) / copy_bw})
    print(f"   {'  window pack (rank 3/8)':26s} {ms:10.2f} ms  ({gbps(nbytes, ms) / copy_bw:.2f}x copy; "
          f"plan + launch {end_to_end_ms:.2f} ms)", flush=True)
    del params, part, ordered, plan
    free_memory()


def host_ms(fn, reps: int = 20) -> float:
    """Median wall-clock milliseconds of a host-side call."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _host_only_ms(shapes, reps: int = 5) -> float:
    """The device tier's whole call with kernel launches skipped (checks, layout, probe, planning, the flat
    buffer's allocation, re-pointing): what the host adds to the kernels. Median of ``reps``, fresh params
    each time; the buffers' contents are garbage, nothing is checked."""
    samples = []
    with kernel_launches_skipped():
        for _ in range(reps):
            params = make_params(shapes)
            torch.cuda.synchronize() if CUDA else None
            start = time.perf_counter()
            ztriton_tier("device")(params, None, shapes)
            torch.cuda.synchronize() if CUDA else None
            samples.append((time.perf_counter() - start) * 1e3)
            del params
            free_memory()
    return statistics.median(samples)


def device_breakdown(shapes, layout, entry) -> None:
    """Where ztriton_device's time goes: the memory probe, planning plus the pack launch, the kernels alone."""
    params = make_params(shapes)
    flat = torch.empty(layout.total_numel, dtype=DTYPE, device=DEVICE)
    ordered = [params[i].detach() for i in layout.order]
    plan = pack_plan(flat, ordered, layout.offsets)
    plan.launch()
    check(flat, layout, shapes)
    row = entry["ztriton_device"]
    row["probe_ms"] = host_ms(lambda: memory.probe_memory(DEVICE))
    row["pack_kernel_ms"] = time_ms(plan.launch)
    row["pack_plan_and_launch_ms"] = time_ms(lambda: pack_plan(flat, ordered, layout.offsets).launch(),
                                             warmup_ms=10, rep_ms=100)
    row["other_ms"] = row["seconds"] * 1e3 - row["probe_ms"] - row["pack_plan_and_launch_ms"]
    del params, flat, ordered, plan
    free_memory()  # before the host-only call's own params and buffer: 40 GiB twice over would not fit
    row["host_only_ms"] = _host_only_ms(shapes)
    row["fresh_allocation_ms"] = _fresh_allocation_ms(layout.total_numel)
    print(f"   {'  of which':26s} probe {row['probe_ms']:.2f} ms, plan + pack {row['pack_plan_and_launch_ms']:.2f} ms "
          f"(kernels {row['pack_kernel_ms']:.2f} ms), the rest {row['other_ms']:.2f} ms; the whole call with "
          f"launches skipped {row['host_only_ms']:.2f} ms; a fresh flat buffer ({layout.total_numel * 2 / GiB:.1f} GiB, "
          f"cudaMalloc) {row['fresh_allocation_ms']:.2f} ms", flush=True)


def _fresh_allocation_ms(numel: int) -> float:
    """Milliseconds of allocating the flat buffer from an emptied cache (a cudaMalloc): part of every
    flatten's call, DeepSpeed's too, wherever the allocator holds no free block that large. Median of 3."""
    if not CUDA:
        return 0.0
    samples = []
    for _ in range(3):
        free_memory()
        start = time.perf_counter()
        flat = torch.empty(numel, dtype=DTYPE, device=DEVICE)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
        del flat
    free_memory()
    return statistics.median(samples)


def pinned_floor_seconds(nbytes: int) -> float:
    """The hardware floor of moving ``nbytes`` out to host memory and back: one device-to-host and one
    host-to-device copy through an already pinned buffer (its allocation not timed). Median of 3."""
    if not CUDA:
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    samples = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    del host, dev
    free_memory()
    return statistics.median(samples)


def add_floors(entry: dict, nbytes: int) -> None:
    """Evict moves about half the group out and back, host all of it: each tier's time over its floor."""
    for label, moved in (("ztriton_evict", nbytes // 2), ("ztriton_host", nbytes)):
        if label in entry:
            floor = pinned_floor_seconds(moved)
            entry[label]["pinned_floor_seconds"] = floor
            entry[label]["over_pinned_floor"] = entry[label]["seconds"] / floor if floor else None
            if floor:
                print(f"   {label:26s} pinned floor {floor * 1e3:.0f} ms: {entry[label]['seconds'] / floor:.2f}x",
                      flush=True)


def run_case(name: str, shapes, figures: dict, copy_bw: float, reps: int, slow_reps: int, skip_host: bool,
             device_only: bool = False) -> None:
    """Every method on one group of ``shapes``; ``reps`` timed repetitions of the on-device methods
    (milliseconds each), ``slow_reps`` of evict (seconds); one checked-and-timed run of the host paths."""
    layout = zero12_group_layout([torch.Size(s).numel() for s in shapes], WORLD, element_size=2,
                                 parameter_alignment=True)
    nbytes = layout.total_numel * 2
    half = nbytes // 2
    entry = {"tensors": len(shapes), "gib": nbytes / GiB, "world_size": WORLD, "rank": RANK}
    print(f"{name}: {len(shapes)} params, {nbytes / GiB:.2f} GiB", flush=True)
    run_method("deepspeed_device", deepspeed_device, shapes, layout, entry, reps)
    run_method("ztriton_device", ztriton_tier("device"), shapes, layout, entry, reps)
    device_breakdown(shapes, layout, entry)
    if device_only:
        _device_ratios(entry, nbytes, copy_bw)
        figures[name] = entry
        return
    # Half the group's bytes: the distributed tier frees the params before allocating the flat buffer
    # (M + M/W would not fit), the evict tier moves about half of the params through host memory.
    run_method("ztriton_distributed", ztriton_tier("distributed"), shapes, layout, entry, 0, checked=False,
               budget=half)
    bench_window(shapes, layout, entry, copy_bw)
    run_method("ztriton_evict", ztriton_tier("evict"), shapes, layout, entry, slow_reps, budget=half)
    if not skip_host:
        run_method("ztriton_host", ztriton_tier("host"), shapes, layout, entry, slow_reps)
        run_method("deepspeed_cpu_fallback", deepspeed_cpu_fallback, shapes, layout, entry, 0)
    add_floors(entry, nbytes)
    _device_ratios(entry, nbytes, copy_bw)
    figures[name] = entry


def _device_ratios(entry: dict, nbytes: int, copy_bw: float) -> None:
    for label in ("ztriton_device", "deepspeed_device"):
        entry[label]["gbps"] = gbps(2 * nbytes, entry[label]["seconds"] * 1e3)
        entry[label]["ratio_to_copy"] = entry[label]["gbps"] / copy_bw
    entry["device_over_deepspeed"] = entry["ztriton_device"]["seconds"] / entry["deepspeed_device"]["seconds"]
    # No flatten can beat copying the group once at copy bandwidth, and when the allocator has no block that
    # large, allocating the buffer first (both paths do): the floor, as a fraction of DeepSpeed's time.
    row = entry["ztriton_device"]
    copy_ms = 2 * nbytes / (copy_bw * 1e9) * 1e3
    entry["copy_floor_ms"] = copy_ms
    entry["copy_floor_over_deepspeed"] = copy_ms / (entry["deepspeed_device"]["seconds"] * 1e3)
    if row.get("fresh_allocation_ms"):
        entry["allocation_and_copy_floor_over_deepspeed"] = \
            (copy_ms + row["fresh_allocation_ms"]) / (entry["deepspeed_device"]["seconds"] * 1e3)
    print(f"   ztriton_device / deepspeed_device {entry['device_over_deepspeed']:.2f}x; floor: one copy "
          f"{copy_ms:.2f} ms ({entry['copy_floor_over_deepspeed']:.2f}x DeepSpeed), with a fresh buffer's "
          f"allocation {entry.get('allocation_and_copy_floor_over_deepspeed', 0):.2f}x", flush=True)


def summary(figures: dict) -> None:
    """The short table, printed last: time and peak per method, speed-up over DeepSpeed's on-device path."""
    print(f"\n{'case':11s} {'method':23s} {'time':>11s} {'vs DS dev':>9s} {'vs DS cpu':>9s} {'peak':>10s} "
          f"{'peak/M':>6s}")
    for name, entry in figures.items():
        if not isinstance(entry, dict) or "deepspeed_device" not in entry:
            continue
        device = entry["deepspeed_device"]["seconds"]
        cpu = entry.get("deepspeed_cpu_fallback", {}).get("seconds")
        for label, row in entry.items():
            if not isinstance(row, dict):
                continue
            secs = row["window_pack_ms"] / 1e3 if "window_pack_ms" in row else row["seconds"]
            note = "*" if "window_pack_ms" in row else ""
            vs_cpu = f"{cpu / secs:8.2f}x" if cpu else f"{'-':>9s}"
            print(f"{name:11s} {label:23s} {secs * 1e3:9.1f}{note:1s}ms {device / secs:8.2f}x {vs_cpu} "
                  f"{row['peak_gib']:7.2f}GiB {row['peak_over_group']:6.2f}")
    print("* distributed: the window pack alone (the fake process group's all-gather moves nothing); "
          "peak: the whole call. peak: above the params, M = group bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sizes", nargs="+", default=["8.6", "40"], choices=["8.6", "40"])
    parser.add_argument("--skip-host", action="store_true", help="skip the host tier and DeepSpeed's CPU fallback")
    parser.add_argument("--name", default="flatten_h200")
    parser.add_argument("--device-only", action="store_true",
                        help="only the on-device flattens (DeepSpeed's and the device tier), 5 timed runs at 8.6 GiB")
    parser.add_argument("--keep-cache", action="store_true",
                        help="keep the CUDA allocator's cache between calls (warm process); default: empty it")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on the CPU too")
    parser.add_argument("--kernels-loaded", action="store_true",
                        help="load the kernels' commonest variant first (warm_up, as warm_up_kernels does); the "
                             "route is the job's either way")
    args = parser.parse_args()
    KEEP_CACHE[0] = args.keep_cache
    if args.kernels_loaded and CUDA:
        from ztriton.kernels.warmup import warm_up

        warm_up(torch.device(DEVICE, torch.cuda.current_device()))
    if not CUDA and not args.smoke:
        parser.error("needs a CUDA device (or --smoke)")
    started = time.perf_counter()
    copy_bw = torch_copy_gbps((2 << 30) if not args.smoke else (16 << 20))
    figures = {"torch_copy_gbps": copy_bw, "cuda_cache_kept_between_calls": args.keep_cache,
               "kernels_loaded_first": args.kernels_loaded}
    print(f"torch copy_: {copy_bw:.0f} GB/s", flush=True)
    with simulated_world(WORLD, RANK):
        run_case("warmup", SMOKE_SHAPES, {}, copy_bw, 0, 0, args.skip_host)  # Triton compiles here
        if args.smoke:
            run_case("smoke", SMOKE_SHAPES, figures, copy_bw, 1, 1, args.skip_host)
        for size in [] if args.smoke else args.sizes:
            # 40 GiB: the on-device methods still get one timed run after the checked one (a new kernel
            # specialisation would otherwise be timed); evict and the host paths run once.
            shapes = llm_mix() if size == "8.6" else llm_mix_40()
            reps = (5 if args.device_only else 2) if size == "8.6" else (3 if args.device_only else 1)
            run_case(f"llm_{size}gib", shapes, figures, copy_bw, reps=reps,
                     slow_reps=1 if size == "8.6" else 0, skip_host=args.skip_host, device_only=args.device_only)
    figures["total_seconds"] = time.perf_counter() - started
    name = "flatten_smoke" if args.smoke else args.name
    path = write_result(name, figures, args.out)
    cases = [k for k, v in figures.items() if isinstance(v, dict)]
    labels = [label for label in ("deepspeed_device", "deepspeed_cpu_fallback", "ztriton_device", "ztriton_distributed",
                                  "ztriton_evict", "ztriton_host") if all(label in figures[c] for c in cases)]
    plot_ratios(args.out / f"{name}.png", "ZeRO-1/2 flatten: peak device memory above the params / group size",
                labels, {c: [figures[c][label]["peak_over_group"] for label in labels] for c in cases},
                ylabel="peak / group bytes")
    print("wrote", path)
    summary(figures)


if __name__ == "__main__":
    main()
