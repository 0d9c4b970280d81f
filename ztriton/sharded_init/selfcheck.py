"""Whether the window replay reproduces this torch's generation on this device: a self-check, once per
process, device and kind (a random op and a dtype), before the first call of that kind is recorded.

:mod:`.philox` reads ATen's CUDA distribution kernels (grid, offsets per call, rounds); a torch that
changes them would make windows give other values and recording advance the generator by the wrong
amount, silently. So the first time a kind meets a placeholder on a device, a tiny tensor is generated
in full by torch's own call from a fixed generator state, windows of it are generated as replay
generates them, and both are compared byte for byte, along with the generator's offset after the
call. On any difference that kind is never recorded on that device in this process: each such call
materialises its tensor in full (the recorder's exact fallback), and rank 0 says so in one line.
ATen's 32-bit split of a tensor over 2**31 bytes is not checked here (that takes a 2 GiB tensor); the
GPU tests check it.

The check runs at recording, not at replay: recording already advances the generator by the
arithmetic the check verifies, and every random call after it depends on that.
"""
from __future__ import annotations

import logging
import os
import threading

import torch

from ztriton.sharded_init import philox, rng
from ztriton.sharded_init.record import RandomOp, empty
from ztriton.sharded_init.replay import CudaDraws, generate_range

logger = logging.getLogger("ztriton")

__all__ = ["check", "replay_verified"]

WINDOWED = ("cuda",)  # device types whose random calls are replayed by windows
START = rng.PhiloxState(seed=0x5EED_2B1D, offset=8)  # the fixed state; a non-zero offset checks the base

_verdicts: dict[tuple, bool] = {}
_lock = threading.Lock()


def draws_for(device: torch.device) -> CudaDraws:
    """The generation the check drives: torch's own calls (tests put a model in its place)."""
    return CudaDraws()


def replay_verified(func, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether calls of ``func`` on ``dtype`` tensors of ``device`` may be recorded and replayed by
    windows. The first ask per device and kind runs :func:`check` (a few ms); later asks are a lookup."""
    device = torch.device(device)
    if device.type not in WINDOWED:
        return True
    key = (_indexed(device), func, dtype)
    verdict = _verdicts.get(key)
    if verdict is None:
        with _lock:
            verdict = _verdicts.get(key)
            if verdict is None:
                verdict = _verdicts[key] = _decide(func, dtype, key[0])
    return verdict


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _decide(func, dtype: torch.dtype, device: torch.device) -> bool:
    """Run the check with the device's generator kept; say any difference in one line (rank 0)."""
    generator = rng.generator_for(device, None)
    saved = rng.capture(generator)
    try:
        differences = check(func, dtype, device, draws_for(device), generator)
    except torch.OutOfMemoryError:
        raise  # no verdict: the tensors the check needs are a small fraction of what full generation needs
    except Exception as error:  # a torch whose calls the check cannot even make is not verified either
        differences = [f"the check raised {type(error).__name__}: {error}"]
    finally:
        rng.restore(generator, saved)
    if differences:
        _report(func, dtype, device, differences)
    return not differences


def _cases(period: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Tensor sizes and the element ranges replayed from each. Windows shift rounds by whole periods, so
    only a tensor of more than one period has windows at an offset past the call's base: two periods
    and a tail shorter than one block, replayed from an unaligned element of the first period across
    the second boundary, and the tail alone (a window padded to a full grid); plus a tensor of one
    block, which replay generates whole."""
    n = 2 * period + 199
    return [(n, [(period - period // 4 - 1, 2 * period + 99), (2 * period + 50, n)]), (200, [(17, 200)])]


def check(func, dtype: torch.dtype, device: torch.device, draws: CudaDraws,
          generator: torch.Generator) -> list[str]:
    """What differs between torch's full call of ``func`` and its replay by windows (empty: nothing).
    Moves ``generator``; :func:`replay_verified` puts it back."""
    geometry, unroll = draws.geometry(device), philox.unroll(dtype)
    period = unroll * philox.BLOCK * geometry.max_blocks
    differences = []
    for n, ranges in _cases(period):
        op = RandomOp(func, (), {}, dtype, torch.Size([n]), generator, START)
        full = empty((n,), dtype, device)
        draws.fill(op, full, 0)
        reserved = draws.state(op).offset - START.offset
        expected, _ = philox.call_layout(n, full.element_size(), geometry, unroll)
        if reserved != expected:
            differences.append(f"a call on {n} elements reserved {reserved} offsets, replay assumes {expected}")
        for begin, end in ranges:
            window = empty((end - begin,), dtype, device)
            generate_range(op, n, window, begin, end, draws)
            if not _same_bytes(window, full.narrow(0, begin, end - begin)):
                differences.append(f"elements [{begin}, {end}) of {n} differ")
    return differences


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _report(func, dtype: torch.dtype, device: torch.device, differences: list[str]) -> None:
    if not _is_rank0():
        return
    kind = f"{_op_name(func)} on {dtype}"
    logger.warning("ztriton sharded init: torch %s on %s: the window replay of %s does not reproduce torch's own "
                   "call (%s); %s is generated in full in this process, as without sharded init",
                   torch.__version__, _describe(device), kind, "; ".join(differences), kind)


def _op_name(func) -> str:
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet, "__name__", None) or str(func)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _is_rank0() -> bool:
    """Rank 0 of the world; before torch.distributed is initialised, the launcher's ``RANK`` says."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")
