"""One fresh pack from an idle device to its end, as a flatten makes it, for pack (b) (2,000 log-uniform tensors),
the LLM mix and a Llama-2-7B's params: ``pack(fresh=True)`` (in turns) and one plan, median of 25 each, with
torch's ``copy_`` bandwidth measured in the same process for the ratio, and DeepSpeed's flatten (pads and
``torch.cat``) of the same params into the same layout. One GPU.

    python bench/probes/probe_fresh_pack.py [--tree DIR] [--out FILE.json]

``--tree DIR``: import ztriton from another checkout (its ``ztriton/`` and ``kernels/``), so that two trees are
compared in alternating processes on one machine (``bench/gpu_session.sh``-style set-up first).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--first-turns", type=int, nargs="*", default=[],
                        help="also time the call in turns with each of these first turns, interleaved")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    sys.path.insert(1, str(ROOT))
    import torch

    import ztriton.kernels  # the tree's, before bench's modules put this checkout first on the path
    from ztriton.kernels import bits, pack, pack_plan

    sys.path.insert(0, str(ROOT))  # bench from this checkout (an older tree's may lack its cases); ztriton stays
    from bench.bench_kernels import deepspeed_flatten, group_layout, make_params, single_call_ms
    from bench.harness import gbps, time_ms, torch_copy_gbps
    from bench.models import llama_7b, llm_mix, log_uniform_mix

    assert Path(ztriton.kernels.__file__).resolve().is_relative_to(args.tree.resolve()), ztriton.kernels.__file__
    copy_bw = torch_copy_gbps(2 << 30)  # as bench_kernels.py measures it
    figures = {"tree": str(args.tree), "copy_gbps": copy_bw}
    for name, shapes in (("pack_b_2000", log_uniform_mix()), ("llm_mix_602", llm_mix()), ("llama_7b_291", llama_7b())):
        params = make_params(shapes)
        layout, offsets = group_layout(params)
        flat = torch.empty(layout.total_numel, dtype=params[0].dtype, device="cuda")
        pack_plan(flat, params, offsets).launch()
        expected = bits(flat).clone()
        flat.fill_(float("nan"))
        pack(flat, params, offsets, fresh=True)
        assert torch.equal(bits(flat), expected), f"{name}: in turns differs from one plan"
        moved = 2 * sum(p.numel() * p.element_size() for p in params) + \
            2 * (layout.total_numel - sum(p.numel() for p in params)) * params[0].element_size()
        turns_ms = single_call_ms(lambda: pack(flat, params, offsets, fresh=True), reps=25)
        plan_ms = single_call_ms(lambda: pack_plan(flat, params, offsets).launch(), reps=25)
        deepspeed_ms = single_call_ms(lambda: deepspeed_flatten(params, layout), reps=25)
        by_first = _by_first_turn(args.first_turns, lambda: pack(flat, params, offsets, fresh=True), single_call_ms)
        # bench_kernels.py times the call in turns after ~100 ms of back-to-back plans (its end-to-end figure),
        # with a plan kept: the same call again after those, to see whether what they leave changes it.
        kept = pack_plan(flat, params, offsets)
        time_ms(lambda: pack_plan(flat, params, offsets).launch(), warmup_ms=10, rep_ms=100)
        after_ms = single_call_ms(lambda: pack(flat, params, offsets, fresh=True), reps=25)
        del kept
        print(f"{name}: in turns after back-to-back plans {after_ms:.2f} ms", flush=True)
        if by_first:
            print(f"{name}: in turns by first turn: " + ", ".join(f"{k} {v:.2f} ms" for k, v in by_first.items()))
        figures[name] = {"turns_ms": turns_ms, "one_plan_ms": plan_ms, "turns_ms_by_first_turn": by_first,
                         "turns_ms_after_back_to_back": after_ms, "deepspeed_flatten_ms": deepspeed_ms,
                         "turns_ratio_to_copy": gbps(moved, turns_ms) / copy_bw,
                         "one_plan_ratio_to_copy": gbps(moved, plan_ms) / copy_bw}
        print(f"{name}: in turns {turns_ms:.2f} ms ({figures[name]['turns_ratio_to_copy']:.3f}x copy_), "
              f"one plan {plan_ms:.2f} ms ({figures[name]['one_plan_ratio_to_copy']:.3f}x); "
              f"DeepSpeed's flatten {deepspeed_ms:.2f} ms", flush=True)
        del params, flat, expected
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    return 0


def _by_first_turn(sizes: list[int], call, single_call_ms) -> dict[int, float]:
    """The median call in turns with ``turns.FIRST_TURN`` at each of ``sizes``, rounds interleaved."""
    from ztriton.kernels import turns

    default, samples = turns.FIRST_TURN, {size: [] for size in sizes}
    try:
        for _ in range(9):
            for size in sizes:
                turns.FIRST_TURN = size
                samples[size].append(single_call_ms(call, reps=3))
    finally:
        turns.FIRST_TURN = default
    return {size: sorted(found)[len(found) // 2] for size, found in samples.items()}


if __name__ == "__main__":
    sys.exit(main())
