"""Generator states: which generator a random call draws from, its state before the call, and moving it.

A CUDA generator is philox: its whole state is (seed, offset), and a call's effect on it is arithmetic
(:mod:`.philox`). The CPU generator is a serial mt19937 whose state is an opaque 5 KB blob: the only
exact way to advance it as a call would is to make the call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CpuState", "PhiloxState", "capture", "generator_for", "restore"]


@dataclass(frozen=True)
class PhiloxState:
    """A CUDA generator's state: seed and philox offset (a multiple of 4)."""

    seed: int
    offset: int

    def advanced(self, offsets: int) -> "PhiloxState":
        return PhiloxState(self.seed, self.offset + offsets)

    def encode(self) -> torch.Tensor:
        # device= given: inside zero.Init, DeepSpeed sends a constructor call without one to the accelerator
        return torch.tensor([self.seed, self.offset], dtype=torch.int64, device="cpu").view(torch.uint8)

    @staticmethod
    def decode(raw: torch.Tensor) -> "PhiloxState":
        seed, offset = raw.view(torch.int64).tolist()
        return PhiloxState(seed, offset)


@dataclass(frozen=True, eq=False)
class CpuState:
    """A CPU generator's state, as ``Generator.get_state()`` gives it."""

    raw: torch.Tensor

    def encode(self) -> torch.Tensor:
        return self.raw

    @staticmethod
    def decode(raw: torch.Tensor) -> "CpuState":
        return CpuState(raw.clone())

    def __eq__(self, other) -> bool:
        return isinstance(other, CpuState) and torch.equal(self.raw, other.raw)


State = PhiloxState | CpuState


def generator_for(device: torch.device, generator: torch.Generator | None) -> torch.Generator:
    """The generator a random call on a tensor of ``device`` draws from (``generator`` if given)."""
    if generator is not None:
        if generator.device.type != device.type:
            raise RuntimeError(f"a random call on a {device} tensor was given a generator of {generator.device}; "
                               f"pass a {device.type} generator")
        return generator
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise NotImplementedError(f"sharded init knows the generators of cpu and cuda tensors, not {device.type}")


def capture(generator: torch.Generator) -> State:
    raw = generator.get_state()
    if generator.device.type == "cuda":
        return PhiloxState.decode(raw)
    return CpuState(raw)


def restore(generator: torch.Generator, state: State) -> None:
    generator.set_state(state.encode())

