"""Small launches of every kernel path, for ``compute-sanitizer --tool memcheck``; exits 1 on a wrong byte."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ztriton.kernels import copy_chunk, pack, pack_slices  # noqa: E402


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    ok = torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8))
    print(f"{name:40s} {'ok' if ok else 'WRONG'}")
    return ok


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    ok = True
    a = torch.randn(1001, device=dev).to(torch.bfloat16)
    b = torch.randn(17, 5, device=dev).to(torch.bfloat16).t()
    c = torch.randn(3, device=dev).to(torch.bfloat16)[1:]
    flat = torch.full((1200,), float("nan"), dtype=torch.bfloat16, device=dev)
    pack(flat, [a, b, c], [3, 1010, 1100])
    ref = torch.zeros(1200, dtype=torch.bfloat16, device=dev)
    ref[3:1004], ref[1010:1010 + b.numel()], ref[1100:1102] = a, b.reshape(-1), c
    ok &= check("pack: misaligned + strided + tiny", flat, ref)
    win = torch.empty(333, dtype=torch.bfloat16, device=dev)
    pack(win, [a, b, c], [3, 1010, 1100], window=(801, 1134))
    ok &= check("window", win, ref[801:1134])
    x = torch.randn(5, 6, 7, device=dev).permute(2, 0, 1)
    out = torch.empty(150, device=dev)
    copy_chunk(x, out, 33, 150)
    ok &= check("copy_chunk permuted slice", out, x.reshape(-1)[33:183])
    t = torch.randn(300, 200, device=dev).to(torch.float16).t()
    out = torch.empty(t.numel(), dtype=torch.float16, device=dev)
    copy_chunk(t, out)
    ok &= check("copy_chunk transposed", out, t)
    buf = torch.full((64,), 7, dtype=torch.int8, device=dev)
    p = torch.randint(-100, 100, (45,), dtype=torch.int8, device=dev)
    pack_slices(buf, [(p, 30, 15, 0), (p, 0, 20, 20)])
    want = torch.zeros(64, dtype=torch.int8, device=dev)
    want[:15], want[20:40] = p[30:], p[:20]
    ok &= check("pack_slices with zero tails", buf, want)
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
