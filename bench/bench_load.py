"""``from_pretrained`` of a fused-expert MoE under ZeRO-3: transformers' path (key off) against ztriton's
shard-on-read loader (``"partition_backend": "triton"``), each measurement in a process of its own.

    python bench/bench_load.py --make /tmp/ckpt_a --layers 1            # write a Mixtral-shaped checkpoint
    python bench/bench_load.py --checkpoints /tmp/ckpt_a --out bench/results/load_h200.json
    python bench/bench_load.py --smoke                                  # tiny, on the CPU

The checkpoint is what ``save_pretrained`` writes for Mixtral (per-expert ``block_sparse_moe.experts.N.w1/w2/w3``
tensors in shards of at most 4 GiB with an index); transformers fuses them at load into ``mlp.experts.gate_up_proj``
(``[E, 2 * ffn, hidden]``) and ``down_proj``. Each case is one fresh process that plays one rank of a simulated
world (torch's fake process group) and records: wall seconds of ``from_pretrained``, peak device bytes above the
start (``max_memory_allocated``), peak host RSS growth (``VmHWM`` after resetting it through ``clear_refs``),
bytes read through read()/pread() (``/proc/self/io`` rchar: mmap page faults, transformers' way of reading, are
not counted there), and a SHA-256 of every partition's valid bytes. Key on and key off are compared by those
digests (a world of one, rank 0 of a simulated world, where key off's values are defined); on the other ranks key
on is compared with the rank's slice of a plain CPU ``from_pretrained`` (``--verify``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 1 << 30
MIXTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=2, max_position_embeddings=4096,
               tie_word_embeddings=False)
SMOKE = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
             num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
             head_dim=8)


# ------------------------------------------------------------------------------------------------ checkpoint


def make_checkpoint(directory: Path, layers: int, shape: dict, shard_bytes: int = 4 * GiB) -> None:
    """Write a Mixtral checkpoint as ``save_pretrained`` lays it out, without building the model in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import MixtralConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = MixtralConfig(num_hidden_layers=layers, **shape)
    config.save_pretrained(directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    h, f, e = config.hidden_size, config.intermediate_size, config.num_local_experts
    kv = config.num_key_value_heads * (config.head_dim or h // config.num_attention_heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        q = config.num_attention_heads * (config.head_dim or h // config.num_attention_heads)
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                       f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                       f"{p}.block_sparse_moe.gate.weight": (e, h)})
        for x in range(e):
            for w, s in (("w1", (f, h)), ("w2", (h, f)), ("w3", (f, h))):
                shapes[f"{p}.block_sparse_moe.experts.{x}.{w}.weight"] = s
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict]] = []

    def flush():
        if shard:
            files.append((f"part-{len(files):05d}", dict(shard)))
            name = files[-1][0]
            save_file({k: v.cpu() for k, v in shard.items()}, directory / f"{name}.safetensors",
                      metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard.clear()

    total = 0
    for name, s in shapes.items():
        t = torch.randn(s, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16) * 0.02
        if sum(v.numel() * 2 for v in shard.values()) + t.numel() * 2 > shard_bytes:
            flush()
        shard[name] = t
        total += t.numel() * 2
    flush()
    n = len(files)
    rename = {f"{old}.safetensors": f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, (old, _) in enumerate(files)}
    for old, new in rename.items():
        (directory / old).rename(directory / new)
    index = {"metadata": {"total_size": total},
             "weight_map": {k: rename[f"{v}.safetensors"] for k, v in weight_map.items()}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    print(f"[bench_load] wrote {total / GiB:.2f} GiB in {n} files to {directory}", flush=True)


# ------------------------------------------------------------------------------------------------ one case


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _digest(t) -> str:
    import torch

    data = t.detach().contiguous().view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()[:32]


def _digests(tensors: dict) -> dict:
    """``_digest`` of each tensor, in threads: SHA-256 releases the GIL, and at W = 1 a 22 GiB model's
    digests took longer than its load when hashed one after the other (a batch's time limit cut the case)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return dict(zip(tensors, pool.map(_digest, tensors.values())))


def run_case(checkpoint: str, backend: str, world: int, rank: int) -> dict:
    """One ``from_pretrained`` as rank ``rank`` of a simulated world of ``world``: figures and digests."""
    import torch

    from bench.harness import cpu_fallback

    cpu_fallback()
    import ztriton  # noqa: F401  (hooks DeepSpeed and transformers)
    import deepspeed  # noqa: F401
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from ztriton.testing import simulated_world

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
              "partition_backend": backend}
    cuda = torch.cuda.is_available()
    with simulated_world(world, rank):
        holder = HfDeepSpeedConfig(config)  # noqa: F841  (transformers keeps a weak reference)
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        rss0, rchar0 = _rss_bytes("VmRSS"), _rchar()
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak_rss = _rss_bytes("VmHWM") - rss0
        read = _rchar() - rchar0
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        partition_bytes, valid_parts = 0, {}
        for name, p in model.named_parameters():
            part = p.ds_tensor
            partition_bytes += part.numel() * part.element_size()
            start_el = rank * part.numel()
            valid_parts[name] = part[:max(0, min(part.numel(), p.ds_numel - start_el))]
        digests = _digests(valid_parts)
    return {"backend": backend, "world": world, "rank": rank, "seconds": seconds, "device_peak_bytes": peak,
            "partition_bytes": partition_bytes, "rss_growth_bytes": peak_rss, "rchar_bytes": read,
            "digests": digests}


def verify_digests(checkpoint: str, world: int, ranks: list[int]) -> dict:
    """Digests of each rank's valid slice of every param of a plain CPU ``from_pretrained`` (no DeepSpeed)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cpu")
    out = {}
    for rank in ranks:
        slices = {}
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            ps = -(-flat.numel() // world)
            slices[name] = flat[rank * ps:min(flat.numel(), (rank + 1) * ps)]
        out[str(rank)] = _digests(slices)
    return out


def measure_floor(checkpoint: str, threads: int = 2, chunk: int = 64 << 20, limit: int = 8 * GiB) -> dict:
    """What the hardware allows the loader: page-cache read bandwidth (``preadv`` of the checkpoint's files,
    already cached by the cases before, with the loader's default thread count and buffer size, into pinned
    buffers) and pinned host-to-device bandwidth. A rank that reads B bytes cannot load faster than
    ``B / read`` (the two overlap) or ``B / read + B / h2d`` (they do not)."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    spans = []  # (path, offset, length) chunks, up to ``limit`` bytes
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, chunk):
            spans.append((f, off, min(chunk, size - off)))
    total, picked = 0, []
    for span in spans:
        if total >= limit:
            break
        picked.append(span)
        total += span[2]
    cuda = torch.cuda.is_available()
    buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(threads)]

    def read_every(k: int) -> None:
        """Thread k reads spans k, k + threads, ... into its own buffer."""
        view = memoryview(buffers[k].numpy())
        for f, off, n in picked[k::threads]:
            with open(f, "rb", buffering=0) as fh:
                got = 0
                while got < n:
                    got += os.preadv(fh.fileno(), [view[got:n]], off + got)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(read_every, range(threads)))
    read_seconds = time.perf_counter() - start
    out = {"read_bytes": total, "read_GBps": total / read_seconds / 1e9, "threads": threads}
    if cuda:
        host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_GBps"] = 5 * GiB / (time.perf_counter() - start) / 1e9
    return out


# ------------------------------------------------------------------------------------------------ driver


def _child(args: list[str], timeout: float = 900) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"error": f"exit {proc.returncode}", "tail": tail}
    for ln in (proc.stdout + proc.stderr).splitlines():
        if "ztriton" in ln and "RESULT" not in ln:
            print("   ", ln[:240], flush=True)
    return json.loads(lines[-1][len("RESULT "):])


def compare(cases: list[dict], reference: dict) -> dict:
    """Bits: key on against key off where key off's values are defined, and against the plain load's slices."""
    by = {(c.get("backend"), c.get("world"), c.get("rank")): c for c in cases if "error" not in c}
    out = {}
    for (backend, world, rank), case in by.items():
        if backend != "triton":
            continue
        key = f"W{world}r{rank}"
        off = by.get(("torch", world, rank))
        if off is not None and (world == 1 or rank == 0):
            out[f"{key}_equal_key_off"] = case["digests"] == off["digests"]
        ref = reference.get(str(world), {}).get(str(rank))
        if ref is not None:
            out[f"{key}_equal_plain_load"] = case["digests"] == ref
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", type=Path, help="write a Mixtral-shaped checkpoint to this folder")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--case", nargs=4, metavar=("CKPT", "BACKEND", "WORLD", "RANK"), help=argparse.SUPPRESS)
    parser.add_argument("--floor", nargs=1, metavar="CKPT", help=argparse.SUPPRESS)
    parser.add_argument("--verify", nargs=3, metavar=("CKPT", "WORLD", "RANKS"), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", nargs="*", type=Path, default=[])
    parser.add_argument("--worlds", default="8:0,8:7,1:0", help="WORLD:RANK pairs")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint on the CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.case:
        ckpt, backend, world, rank = args.case
        print("RESULT " + json.dumps(run_case(ckpt, backend, int(world), int(rank))), flush=True)
        return 0
    if args.floor:
        print("RESULT " + json.dumps(measure_floor(args.floor[0])), flush=True)
        return 0
    if args.verify:
        ckpt, world, ranks = args.verify
        print("RESULT " + json.dumps(verify_digests(ckpt, int(world), [int(r) for r in ranks.split(",")])), flush=True)
        return 0
    if args.make:
        make_checkpoint(args.make, args.layers, MIXTRAL)
        return 0

    checkpoints = list(args.checkpoints)
    if args.smoke:
        smoke = Path("/tmp/ztriton_bench_load_smoke")
        make_checkpoint(smoke, 2, SMOKE, shard_bytes=64 << 10)
        checkpoints = [smoke]
    pairs = [tuple(int(x) for x in p.split(":")) for p in args.worlds.split(",")]
    results = {}
    out = args.out or (ROOT / "bench" / "results" / ("load_smoke.json" if args.smoke else "load.json"))

    def save(figures: dict) -> Path:
        """Written after every case, so that a run cut short keeps what it finished."""
        from bench.harness import write_result

        return write_result(out.stem, figures, out.parent)

    for ckpt in checkpoints:
        cases = []
        for world, rank in pairs:
            for backend in ("torch", "triton"):
                print(f"[bench_load] {ckpt.name} W={world} rank={rank} key={backend}", flush=True)
                case = _child(["--case", str(ckpt), backend, str(world), str(rank)])
                case.setdefault("backend", backend), case.setdefault("world", world), case.setdefault("rank", rank)
                cases.append(case)
                save({**results, ckpt.name: {"cases": [{k: v for k, v in c.items() if k != "digests"} for c in cases],
                                             "partial": True}})
                if "error" in case:
                    print(case["tail"], flush=True)
                else:
                    print(f"    {case['seconds']:.2f} s, device peak {case['device_peak_bytes'] / GiB:.3f} GiB "
                          f"({case['device_peak_bytes'] / max(1, case['partition_bytes']):.2f}x the partition), "
                          f"RSS +{case['rss_growth_bytes'] / GiB:.2f} GiB, read {case['rchar_bytes'] / GiB:.2f} GiB",
                          flush=True)
        reference = {}
        if not args.no_verify:
            for world in sorted({w for w, _ in pairs}):
                ranks = ",".join(str(r) for w, r in pairs if w == world)
                reference[str(world)] = _child(["--verify", str(ckpt), str(world), ranks])
        bits = compare(cases, reference)
        print(f"[bench_load] bits: {bits}", flush=True)
        ratios = {}
        for world, rank in pairs:
            on = next((c for c in cases if c["backend"] == "triton" and c["world"] == world and c["rank"] == rank
                       and "error" not in c), None)
            off = next((c for c in cases if c["backend"] == "torch" and c["world"] == world and c["rank"] == rank
                        and "error" not in c), None)
            if on and off:
                ratios[f"W{world}r{rank}"] = {"time_on_over_off": on["seconds"] / off["seconds"],
                                              "peak_over_partition_on": on["device_peak_bytes"] / on["partition_bytes"],
                                              "peak_over_partition_off": off["device_peak_bytes"] / off["partition_bytes"],
                                              "rss_growth_on_over_partition": on["rss_growth_bytes"] / on["partition_bytes"],
                                              "rss_growth_off_over_partition": off["rss_growth_bytes"] / off["partition_bytes"]}
        floor = _child(["--floor", str(ckpt)])
        if "error" not in floor:
            for key, c in ratios.items():
                on = next(x for x in cases if x["backend"] == "triton" and f"W{x['world']}r{x['rank']}" == key)
                b = on["rchar_bytes"]
                c["floor_overlapped_s"] = b / (floor["read_GBps"] * 1e9)
                c["floor_serial_s"] = b / (floor["read_GBps"] * 1e9) + b / (floor.get("h2d_GBps", float("inf")) * 1e9)
                c["time_on_over_floor_overlapped"] = on["seconds"] / c["floor_overlapped_s"]
        for c in cases:
            c.pop("digests", None)
        results[ckpt.name] = {"cases": cases, "bits": bits, "ratios": ratios, "floor": floor}
        print(json.dumps(ratios, indent=1), flush=True)
        print(f"[bench_load] wrote {save(results)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
