"""A planned copy and its launch (:class:`Plan`): the kernels' launches (``compiled.py``: from the compiled cache
or Triton's JIT) and torch's copies, on the right device and stream, under the interpreter's lock where it runs,
after a background warm-up still loading the kernels."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from . import compiled, state

__all__ = ["Plan", "launch_stream"]


@dataclass
class Plan:
    """Launches that carry out one copy; reusable while its tensors stay where they are.

    It keeps the source tensors referenced: the tables name them only by address. On CUDA the tables
    were uploaded on ``stream`` (the stream current when the plan was made); a launch runs on the
    stream current at launch time, on dst's device.
    """

    launches: list  # (kernel name, grid, args, meta): compiled.launch's arguments
    keep_alive: list
    tables: list = field(default_factory=list)
    stream: Any = None
    copies: list = field(default_factory=list)  # (out, src) views for torch's copy_ (Tuning.torch_pieces)
    batches: list = field(default_factory=list)  # (outs, srcs) lists of views for one torch._foreach_copy_ each
    fills: list = field(default_factory=list)  # views of dst for torch's zero_
    inference: bool = False  # the views are inference tensors (made in inference mode): written only inside it
    zero_each: bool = False  # a zero_ per fill instead of one _foreach_zero_ (Tuning.foreach_from)
    cats: list = field(default_factory=list)  # (out, inputs): one torch.cat(inputs, out=out) each

    @property
    def torch_copies(self) -> bool:
        """Whether this plan copies with torch (copy_, cat, _foreach_copy_, zero_) instead of launching kernels."""
        return bool(self.copies or self.cats or self.batches or self.fills)

    def launch(self) -> None:
        """Run the plan on the current stream of dst's device (CPU: under the interpreter)."""
        if self.stream is None:  # CPU, under the interpreter
            with self._interpreter_lock():
                self._launch_all(None)
            return
        device = self.stream.device
        with torch.cuda.device(device) if torch.cuda.current_device() != device.index else nullcontext():
            current = torch.cuda.current_stream(device)
            if current != self.stream:
                # Launched on another stream than the tables' upload: wait for the upload, and keep
                # the tables' memory from being reused on the upload stream while this one reads it.
                current.wait_stream(self.stream)
                for table in self.tables:
                    table.record_stream(current)
            with self._interpreter_lock():
                self._launch_all(current)

    def _interpreter_lock(self):
        """The interpreter's lock for a plan that launches kernels under it; the torch copies' lock otherwise."""
        interpreted = self.stream is None or state.interpreter_on()  # asked without importing triton on CUDA
        return state.INTERPRETER_LOCK if self.launches and interpreted else state.torch_copies_lock()

    def copy_with_torch(self) -> None:
        """The torch part: each own copy, each ``torch.cat``, each batch's ``_foreach_copy_``, the gaps' ``zero_``
        each or one ``_foreach_zero_`` (in the caller's autograd mode)."""
        for out, src in self.copies:
            out.copy_(src)
        for out, inputs in self.cats:
            torch.cat(inputs, out=out)
        for outs, srcs in self.batches:
            torch._foreach_copy_(outs, srcs)
        if self.zero_each:
            for fill in self.fills:
                fill.zero_()
        elif self.fills:
            torch._foreach_zero_(self.fills)

    def _launch_all(self, stream) -> None:
        """Everything the plan does, on ``stream`` (the current one of dst's device; None on the CPU)."""
        if self.torch_copies:
            # Views made in inference mode may be written only inside it (entering it costs more than a small
            # partition's copy); the others without autograd, as the kernels write.
            with torch.inference_mode() if self.inference else torch.no_grad():
                self.copy_with_torch()
        if self.launches and stream is not None:
            state.await_warm_up(stream.device)
        for kernel, grid, args, meta in self.launches:
            compiled.launch(kernel, grid, args, meta, stream)


def launch_stream(dst: torch.Tensor):
    """The stream a plan for ``dst`` is made on (its tables uploaded on): the current one; None on the CPU."""
    return torch.cuda.current_stream(dst.device) if dst.device.type == "cuda" else None
