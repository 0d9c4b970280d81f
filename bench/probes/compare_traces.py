"""Where the key's time goes in a fresh process's initialize: ``bench_coldstart.py --trace-deepspeed`` cells, key on
against key off, call path by call path, the warm processes paired per round as ``bench_coldstart``'s ratios pair
them (the cold processes run first, one per backend, and are shown apart), and the background threads' spans
against the main thread's initialize.

    python bench/probes/compare_traces.py bench/results/coldstart_zero2_trace.json [--on triton@ab] [--top 25]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# A phase of DeepSpeed's initialize the key does nothing in, whose spread between fresh processes hides the key's
# milliseconds (its optimizer sanity check imports torch._inductor: bench/NOTES.md): "initialize without it" is
# the figure the key's cost is read from.
SPREAD_PHASE = "engine.DeepSpeedEngine._do_optimizer_sanity_check"


def without(trace: dict, phase: str) -> float:
    """initialize's ms less every outermost call path that ends in ``phase`` (their children are inside)."""
    whole = trace.get("deepspeed.initialize", {}).get("ms", 0.0)
    return whole - sum(v["ms"] for p, v in trace.items() if p.endswith(phase) and phase not in p[:-len(phase)])


def runs(cells: dict, step: str, backend: str, temperature: str) -> list[dict]:
    """The processes of one cell (a cell of one process keeps no list), none if it failed."""
    cell = cells.get(f"{step}/{backend}/{temperature}", {})
    if not cell or "error" in cell:
        return []
    return cell.get("runs", [cell])


def paired(off: list[dict], on: list[dict], read) -> tuple[float, float, float, int]:
    """Median of key off, of key on, of on minus off per round, and the rounds on was the faster."""
    pairs = [(read(a), read(b)) for a, b in zip(off, on)]
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(b - a for a, b in pairs), sum(b < a for a, b in pairs))


def _figures(off: list[dict], on: list[dict]) -> list[tuple[str, float, float, float, int]]:
    """The whole steps' figures (ms), paired."""
    rows = []
    for field in ("initialize_seconds", "initialize_cpu_seconds", "flatten_seconds"):
        if all(field in r for r in off + on):
            rows.append((field, *paired(off, on, lambda r: r[field] * 1e3)))
    if all("deepspeed_trace" in r for r in off + on):
        rows.append(("initialize w/o SPREAD_PHASE",
                     *paired(off, on, lambda r: without(r["deepspeed_trace"], SPREAD_PHASE))))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--step", default="zero2")
    parser.add_argument("--on", default="triton", help="the key-on backend (triton@ab: --ab-tree's cells)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    cells = json.loads(args.result.read_text())["figures"]["cells"]
    off, on = (runs(cells, args.step, b, "warm") for b in ("torch", args.on))
    count = min(len(off), len(on))
    off, on = off[:count], on[:count]
    print(f"{count} warm rounds; key off / key on / paired on - off (ms), rounds key on was faster:")
    for name, a, b, d, faster in _figures(off, on):
        print(f"  {name:28s} {a:9.1f} {b:9.1f} {d:+8.1f}  {faster}/{count}")
    cold_off, cold_on = (runs(cells, args.step, b, "cold") for b in ("torch", args.on))
    if cold_off and cold_on:
        print("cold (one process each, run before the warm rounds):")
        for name, a, b, d, _ in _figures(cold_off, cold_on):
            print(f"  {name:28s} {a:9.1f} {b:9.1f} {d:+8.1f}")
    paths = {p for r in off + on for p in r.get("deepspeed_trace", {})}
    rows = []
    for path in paths:
        a, b, d, faster = paired(off, on, lambda r: r.get("deepspeed_trace", {}).get(path, {}).get("ms", 0.0))
        rows.append((abs(d), path, a, b, d, faster))
    print(f"\nthe {args.top} call paths whose paired difference is largest (inclusive ms, warm rounds):")
    for _, path, a, b, d, faster in sorted(rows, reverse=True)[:args.top]:
        print(f"  {a:9.2f} {b:9.2f} {d:+8.2f}  {faster:2d}/{count}  {path}")
    print("\nkey on's threads (seconds from initialize's start: start, end; CPU seconds), per warm round:")
    for run in on:
        origin = run.get("initialize_start", 0.0)
        spans = ", ".join(f"{t['name']} {t['start'] - origin:+.3f}..{t['end'] - origin:+.3f} cpu {t['cpu_seconds']:.3f}"
                          for t in run.get("threads", []))
        print(f"  initialize {run['initialize_seconds']:.3f} s: {spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
