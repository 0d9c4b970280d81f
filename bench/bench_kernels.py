"""Kernel bandwidth against torch, on one GPU: ``python bench/bench_kernels.py [--out DIR]``.

Cases (the kernels issue): a >= 1 GiB contiguous copy; packs with 16-byte param pads and
tail alignment of (a) 200 x 32 MiB, (b) 2,000 log-uniform 4 KiB..64 MiB and (c) the 8.6 GiB LLM mix,
each against torch copy bandwidth and, for (c), DeepSpeed's on-device flatten; one rank's 1/8 window
of (b); a transposed 32768 x 32768 bf16 source. Bytes counted are read plus written. Every result is
checked bit for bit before it is timed.

``--planning`` times only the host side (validation and launch tables, no launch) of the (b) pack, its
window and the LLM mix, and counts the kernel variants (constexpr and pointer-alignment classes, each
a compile or cache load in a fresh process) a plan needs. It runs on CPU too (under TRITON_INTERPRET=1),
with the shapes scaled down so that nothing large is allocated: planning cost depends on the number
of tensors, not their sizes. On a GPU it uses the real shapes.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import cpu_fallback  # noqa: E402

cpu_fallback()  # --planning on a CPU
from bench.harness import RESULTS, best_host_ms, gbps, plot_ratios, time_ms, torch_copy_gbps, write_result  # noqa: E402
from ztriton.kernels import KERNELS_ONLY, Piece, Tuning, copy_chunk, make_plan, pack, pack_plan  # noqa: E402
from bench.models import llm_mix, log_uniform_mix  # noqa: E402,F401  (bench_flatten imports llm_mix from here)
from ztriton.testing import bits  # noqa: E402
from ztriton.testing import deepspeed_flatten as ds_flatten  # noqa: E402
from ztriton.layout import zero12_group_layout  # noqa: E402

DTYPE = torch.bfloat16
WORLD = 8


def make_params(shapes) -> list[torch.Tensor]:
    return [torch.randn(s, device="cuda", dtype=torch.float32).to(DTYPE) for s in shapes]


def group_layout(params):
    layout = zero12_group_layout([p.numel() for p in params], WORLD, element_size=2, parameter_alignment=True)
    return layout, [layout.offsets[layout.order.index(i)] for i in range(len(params))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def deepspeed_flatten(params, layout):
    """DeepSpeed 0.19.8's on-device flatten of ``params`` in ``layout``'s order (``ztriton.testing``'s
    ``flatten_dense_tensors_aligned``: pad tensors, ``align_dense_tensors``, ``torch.cat``)."""
    return ds_flatten([params[i] for i in layout.order], layout.paddings, 2 * WORLD)


WORD_SWEEP = [Tuning(step_bytes=step, program_bytes=chunk, num_warps=warps, torch_pieces=0)
              for step, chunk in [(8 << 10, 16 << 10), (16 << 10, 16 << 10), (16 << 10, 32 << 10),
                                  (32 << 10, 32 << 10), (32 << 10, 64 << 10), (64 << 10, 64 << 10),
                                  (32 << 10, 128 << 10)]
              for warps in (2, 4, 8)]
TILE_SWEEP = [Tuning(tile_p=tp, tile_c=tc, tile_warps=warps, torch_pieces=0)
              for tp, tc, warps in [(64, 64, 4), (128, 64, 4), (128, 64, 8), (256, 64, 8), (128, 128, 4),
                                    (64, 128, 4), (256, 32, 4), (128, 32, 2)]]


def sweep(make_plan_for, tunings, nbytes, copy_bw) -> list[dict]:
    """Kernel-only ratio to copy bandwidth of the plan each tuning gives."""
    rows = []
    for tuning in tunings:
        ms = time_ms(make_plan_for(tuning).launch, warmup_ms=10, rep_ms=60)
        rows.append({**tuning.__dict__, "ratio_to_copy": gbps(nbytes, ms) / copy_bw})
    best = max(rows, key=lambda r: r["ratio_to_copy"])
    print(f"   sweep best {best}", flush=True)
    return rows


def single_call_ms(fn, reps: int = 15) -> float:
    """Median milliseconds of one call from an idle device to its end (synchronised before and after)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[reps // 2]


def bench_pack(name, shapes, figures, copy_bw, sweep_on):
    params = make_params(shapes)
    layout, offsets = group_layout(params)
    flat = torch.empty(layout.total_numel, dtype=DTYPE, device="cuda")
    plan = pack_plan(flat, params, offsets)
    plan.launch()
    reference = deepspeed_flatten(params, layout)
    assert same_bits(flat, reference), f"{name}: pack differs from DeepSpeed's flatten"
    del reference
    expected = bits(flat).clone()
    nbytes = 2 * sum(p.numel() * 2 for p in params) + 2 * (layout.total_numel - sum(p.numel() for p in params))
    ms = time_ms(plan.launch)
    entry = {"tensors": len(params), "gib": layout.total_numel * 2 / 2**30, "kernel_ms": ms,
             "kernel_gbps": gbps(nbytes, ms), "ratio_to_copy": gbps(nbytes, ms) / copy_bw}
    # Back to back (do_bench): each call's planning overlaps the previous call's kernel. One call alone, as a
    # user's flatten makes it: planning, then the kernel, with nothing to hide the planning behind.
    entry["end_to_end_ms"] = time_ms(lambda: pack_plan(flat, params, offsets).launch(), warmup_ms=10, rep_ms=100)
    entry["single_call_ms"] = single_call_ms(lambda: pack_plan(flat, params, offsets).launch())
    entry["single_call_ratio_to_copy"] = gbps(nbytes, entry["single_call_ms"]) / copy_bw
    # The same call as a flatten or a defragment makes it into the buffer it just allocated (fresh=True): the
    # sources checked and copied in turns, so the device starts after the first turn's checks, not the last's.
    # (flat is reused here; what a turn does does not depend on whether dst is really new.)
    flat.zero_()
    pack(flat, params, offsets, fresh=True)
    assert torch.equal(bits(flat), expected), f"{name}: pack(fresh=True) differs from the plan's result"
    entry["single_call_fresh_ms"] = single_call_ms(lambda: pack(flat, params, offsets, fresh=True))
    entry["single_call_fresh_ratio_to_copy"] = gbps(nbytes, entry["single_call_fresh_ms"]) / copy_bw
    ds_ms = time_ms(lambda: deepspeed_flatten(params, layout), warmup_ms=10, rep_ms=100)
    entry["deepspeed_ms"] = ds_ms
    entry["speedup_vs_deepspeed_kernel"] = ds_ms / ms
    entry["speedup_vs_deepspeed_end_to_end"] = ds_ms / entry["end_to_end_ms"]
    out = torch.empty(sum(p.numel() for p in params), dtype=DTYPE, device="cuda")
    cat_ms = time_ms(lambda: torch.cat([p.reshape(-1) for p in params], out=out), warmup_ms=10, rep_ms=100)
    entry["torch_cat_out_ratio_to_copy"] = gbps(4 * out.numel(), cat_ms) / copy_bw
    del out
    if sweep_on:
        entry["sweep"] = sweep(lambda t: pack_plan(flat, params, offsets, tuning=t), WORD_SWEEP, nbytes, copy_bw)
    figures[name] = entry
    print(f"{name:28s} {entry['ratio_to_copy']:.3f}x copy  ({entry['kernel_gbps']:.0f} GB/s, {ms:.2f} ms; "
          f"end-to-end {entry['end_to_end_ms']:.2f} ms back to back, {entry['single_call_ms']:.2f} ms one call "
          f"({entry['single_call_ratio_to_copy']:.3f}x), {entry['single_call_fresh_ms']:.2f} ms in turns "
          f"({entry['single_call_fresh_ratio_to_copy']:.3f}x); DeepSpeed {ds_ms:.2f} ms)", flush=True)
    del expected
    return params, layout, offsets


def bench_window(params, layout, offsets, figures, copy_bw, sweep_on):
    rank = 3
    w0, w1 = layout.rank_window(rank)
    out = torch.empty(w1 - w0, dtype=DTYPE, device="cuda")
    plan = pack_plan(out, params, offsets, window=(w0, w1))
    plan.launch()
    flat = torch.empty(layout.total_numel, dtype=DTYPE, device="cuda")
    pack_plan(flat, params, offsets).launch()
    assert same_bits(out, flat[w0:w1]), "window differs from the full pack"
    del flat
    ms = time_ms(plan.launch)
    nbytes = 2 * out.numel() * 2
    # torch's best: _foreach_copy_ of the same slices into views of the rank buffer.
    srcs, dsts = [], []
    for i, p in enumerate(params):
        lo, hi = max(offsets[i], w0), min(offsets[i] + p.numel(), w1)
        if lo < hi:
            srcs.append(p.reshape(-1)[lo - offsets[i]:hi - offsets[i]])
            dsts.append(out[lo - w0:hi - w0])
    foreach_ms = time_ms(lambda: torch._foreach_copy_(dsts, srcs))
    if sweep_on:
        figures["window_sweep"] = sweep(lambda t: pack_plan(out, params, offsets, window=(w0, w1), tuning=t),
                                        WORD_SWEEP, nbytes, copy_bw)
    figures["window_b_rank3_of_8"] = {"mib": out.numel() * 2 / 2**20, "kernel_ms": ms, "kernel_gbps": gbps(nbytes, ms),
                                      "ratio_to_copy": gbps(nbytes, ms) / copy_bw,
                                      "foreach_copy_ratio_to_copy": gbps(nbytes, foreach_ms) / copy_bw}
    print(f"{'window (b), 1/8':28s} {gbps(nbytes, ms) / copy_bw:.3f}x copy  (_foreach_copy_ "
          f"{gbps(nbytes, foreach_ms) / copy_bw:.3f}x)", flush=True)


def bench_contiguous(figures, copy_bw, sweep_on):
    n = (1 << 30) // 2
    src = torch.randn(n, device="cuda").to(DTYPE)
    dst = torch.empty_like(src)
    copy_chunk(src, dst)
    assert same_bits(dst, src)
    ms = time_ms(lambda: copy_chunk(src, dst))  # one contiguous piece: torch's copy_ (Tuning.torch_pieces)
    plan = make_plan(dst, [Piece(src, 0, n, 0)], tuning=KERNELS_ONLY)
    kernel_ms = time_ms(plan.launch)
    torch_ms = time_ms(lambda: dst.copy_(src))
    if sweep_on:
        figures["contiguous_sweep"] = sweep(lambda t: make_plan(dst, [Piece(src, 0, n, 0)], tuning=t), WORD_SWEEP,
                                            4 * n, copy_bw)
    figures["contiguous_1gib"] = {"end_to_end_ms": ms, "kernel_ms": kernel_ms, "torch_ms": torch_ms,
                                  "ratio_to_copy": torch_ms / ms, "kernel_ratio_to_copy": torch_ms / kernel_ms}
    print(f"{'contiguous 1 GiB':28s} {torch_ms / ms:.3f}x torch copy_ (kernel only {torch_ms / kernel_ms:.3f}x)",
          flush=True)


def bench_transposed(figures, copy_bw, sweep_on):
    base = torch.randn(32768, 32768, device="cuda").to(DTYPE)
    src = base.t()
    out = torch.empty(src.numel(), dtype=DTYPE, device="cuda")
    copy_chunk(src, out)
    assert same_bits(out, src.contiguous())
    nbytes = 2 * src.numel() * 2
    ms = time_ms(lambda: copy_chunk(src, out))
    plan = make_plan(out, [Piece(src, 0, src.numel(), 0)])
    kernel_ms = time_ms(plan.launch)
    contiguous_ms = time_ms(lambda: src.contiguous())
    copy_ms = time_ms(lambda: out.view(32768, 32768).copy_(src))
    slice_out = torch.empty(src.numel() // 8, dtype=DTYPE, device="cuda")
    start = 3 * slice_out.numel() + 5
    copy_chunk(src, slice_out, start)
    assert same_bits(slice_out, src.reshape(-1)[start:start + slice_out.numel()])
    slice_ms = time_ms(lambda: copy_chunk(src, slice_out, start))
    tile_sweep = sweep(lambda t: make_plan(out, [Piece(src, 0, src.numel(), 0)], tuning=t), TILE_SWEEP, nbytes,
                       copy_bw) if sweep_on else []
    slice_plan = make_plan(slice_out, [Piece(src, start, slice_out.numel(), 0)])
    slice_kernel_ms = time_ms(slice_plan.launch)
    figures["transposed_32768sq_bf16"] = {
        "sweep": tile_sweep, "eighth_slice_kernel_ratio_to_copy": gbps(nbytes / 8, slice_kernel_ms) / copy_bw,
        "end_to_end_ms": ms, "ratio_to_copy": gbps(nbytes, ms) / copy_bw,
        "kernel_ms": kernel_ms, "kernel_ratio_to_copy": gbps(nbytes, kernel_ms) / copy_bw,
        "torch_contiguous_ratio_to_copy": gbps(nbytes, contiguous_ms) / copy_bw,
        "torch_copy_into_ratio_to_copy": gbps(nbytes, copy_ms) / copy_bw,
        "eighth_slice_ratio_to_copy": gbps(nbytes / 8, slice_ms) / copy_bw,
    }
    print(f"{'transposed 32768^2':28s} {gbps(nbytes, ms) / copy_bw:.3f}x copy  (kernel only "
          f"{gbps(nbytes, kernel_ms) / copy_bw:.3f}x; .contiguous() "
          f"{gbps(nbytes, contiguous_ms) / copy_bw:.3f}x; 1/8 slice {gbps(nbytes / 8, slice_ms) / copy_bw:.3f}x)",
          flush=True)


def kernel_variants(plans) -> set:
    """The distinct (kernel, constexprs, 16-byte alignment of each pointer argument) of ``plans``'
    launches: triton's specialisation key for our kernels, whose integer argument is not specialised."""
    keys = set()
    for plan in plans:
        for kernel, _, args, kwargs in plan.launches:
            aligned = tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
            name = kernel if isinstance(kernel, str) else getattr(kernel, "__name__", None) or kernel.fn.__name__
            keys.add((name,
                      tuple(sorted((k, str(v)) for k, v in kwargs.items())), aligned))
    return keys


def bench_planning(figures) -> None:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    b = log_uniform_mix() if gpu else [[max(1, s[0] // 64)] for s in log_uniform_mix()]
    llm = llm_mix() if gpu else [[256, 256]] * 200 + [[256]] * 400 + [[151936 // 16, 256]] * 2
    for name, shapes in (("b_2000_loguniform", b), ("llm_mix_602", llm)):
        numels = [int(torch.Size(s).numel()) for s in shapes]
        if gpu:
            params = make_params(shapes)
        else:  # views of one small base: sources may share memory (only dst must not)
            base = torch.zeros(max(numels), dtype=DTYPE, device=device)
            params = [base[:n].view(s) for n, s in zip(numels, shapes)]
        layout, offsets = group_layout(params)
        flat = torch.empty(layout.total_numel, dtype=DTYPE, device=device)
        w0, w1 = layout.rank_window(3)
        window = torch.empty(w1 - w0, dtype=DTYPE, device=device)
        plans = [pack_plan(flat, params, offsets)] + [pack_plan(torch.empty(layout.partition_numel, dtype=DTYPE, device=device),
                                                                params, offsets, window=layout.rank_window(r))
                                                      for r in range(WORLD)]
        entry = {"tensors": len(params), "real_shapes": gpu,
                 "plan_ms": best_host_ms(lambda: pack_plan(flat, params, offsets)),
                 "window_plan_ms": best_host_ms(lambda: pack_plan(window, params, offsets, window=(w0, w1))),
                 "kernel_variants_full_and_8_windows": len(kernel_variants(plans))}
        figures[f"planning_{name}"] = entry
        print(f"planning {name:20s} full {entry['plan_ms']:.2f} ms, 1/8 window {entry['window_plan_ms']:.2f} ms, "
              f"{entry['kernel_variants_full_and_8_windows']} kernel variant(s) over the full pack and the 8 windows",
              flush=True)
        del params, flat, window, plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sweep", action="store_true", help="also sweep launch parameters on (b) and (c)")
    parser.add_argument("--name", default="kernels_h200")
    parser.add_argument("--planning", action="store_true", help="only the host cost of planning (CPU or GPU)")
    args = parser.parse_args()
    if args.planning:
        figures = {}
        bench_planning(figures)
        if torch.cuda.is_available():
            print("wrote", write_result(args.name + "_planning", figures, args.out))
        return
    copy_bw = torch_copy_gbps(2 << 30)
    figures = {"torch_copy_gbps": copy_bw}
    print(f"torch copy_: {copy_bw:.0f} GB/s", flush=True)
    bench_contiguous(figures, copy_bw, args.sweep)
    bench_transposed(figures, copy_bw, args.sweep)
    torch.cuda.empty_cache()
    bench_pack("pack_a_200x32MiB", [[16 << 20]] * 200, figures, copy_bw, sweep_on=False)
    torch.cuda.empty_cache()
    params, layout, offsets = bench_pack("pack_b_2000_loguniform", log_uniform_mix(), figures, copy_bw, args.sweep)
    bench_window(params, layout, offsets, figures, copy_bw, args.sweep)
    del params
    torch.cuda.empty_cache()
    bench_pack("pack_c_llm_mix", llm_mix(), figures, copy_bw, args.sweep)
    path = write_result(args.name, figures, args.out)
    labels = ["contiguous_1gib", "transposed_32768sq_bf16", "pack_a_200x32MiB", "pack_b_2000_loguniform",
              "window_b_rank3_of_8", "pack_c_llm_mix"]
    plot_ratios(args.out / f"{args.name}.png", "ztriton kernels on " + torch.cuda.get_device_name(),
                labels, {"ztriton": [figures[k]["ratio_to_copy"] for k in labels]}, target=0.9)
    print("wrote", path)


if __name__ == "__main__":
    main()
