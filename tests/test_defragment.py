"""The ZeRO-3 optimizer's flat partition buffer (ztriton/defragmenting.py and its DeepSpeed hook).

``defragment`` must return what DeepSpeed's ``deepspeed.runtime.zero.utils.defragment`` returns, bit
for bit, leave every tensor a view of it, move nothing when the tensors already fill one buffer in
order, and free the storages the tensors came from.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import deepspeed
from ds_reference import BitsModule, bits, bits_tensor, deepspeed_defragment, dtype_config
from ztriton.defragmenting import defragment, is_packed
from ztriton.policy import Tier
from ztriton.layout import zero3_slice

SHAPES = [(5, 7), (3,), (64, 33), (2, 3, 4), (1,), (17,)]


def alias(buffer: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """A partition as ztriton.partition makes them: its own tensor over part of a shared storage."""
    return torch.empty(0, dtype=buffer.dtype).set_(buffer.untyped_storage(), start, (numel,))


def scattered_tensors(dtype=torch.bfloat16):
    """Tensors as partitions come: some alone (DeepSpeed's), some sharing a buffer (ztriton's), out of
    storage order."""
    a = bits_tensor((40,), dtype, 1).clone()  # clone: bits_tensor's result is a view of a uint8 tensor
    b = bits_tensor((7,), dtype, 2).clone()
    shared = bits_tensor((30,), dtype, 3).clone()
    return [alias(shared, 10, 15), a, alias(shared, 0, 10), b, alias(shared, 25, 5)]


def test_defragment_matches_deepspeeds_and_frees_the_old_storages():
    expected_tensors = scattered_tensors()
    expected = deepspeed_defragment(expected_tensors)
    tensors = scattered_tensors()
    storages = [weakref.ref(t.untyped_storage()) for t in tensors]
    flat = defragment(tensors)
    gc.collect()
    assert torch.equal(bits(flat), bits(expected)) and flat.numel() == 40 + 7 + 30
    offset = 0
    for t in tensors:  # each is a 1-D alias of flat at its place, as DeepSpeed leaves them
        assert t.dim() == 1 and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert t.storage_offset() == offset
        offset += t.numel()
    assert all(ref() is None for ref in storages), "an old storage is still alive"


def test_forced_evict_tier_gives_the_same_bytes():
    reference = defragment(scattered_tensors())
    tensors = scattered_tensors()
    storages = [weakref.ref(t.untyped_storage()) for t in tensors]
    flat = defragment(tensors, tier="evict")
    gc.collect()
    assert torch.equal(bits(flat), bits(reference))
    assert all(t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for t in tensors)
    assert all(ref() is None for ref in storages)


def test_evicted_storages_are_freed_before_the_flat_buffer_is_allocated(monkeypatch):
    """The evict tier exists to make room: the old storages must be gone when the new buffer is asked for."""
    import ztriton.defragmenting as D

    tensors = scattered_tensors()
    storages = [weakref.ref(t.untyped_storage()) for t in tensors]
    alive_at_allocation = []
    real_try_empty = D.try_empty

    def spy(numel, dtype, device, what):
        gc.collect()
        alive_at_allocation.append(sum(ref() is not None for ref in storages))
        return real_try_empty(numel, dtype, device, what)

    monkeypatch.setattr(D, "try_empty", spy)
    defragment(tensors, tier="evict")
    assert alive_at_allocation == [0]


def test_evict_tier_moves_the_rest_when_the_buffer_still_does_not_fit(monkeypatch):
    import ztriton.defragmenting as D

    reference = defragment(scattered_tensors())
    tensors = scattered_tensors()
    attempts = []
    real_try_empty = D.try_empty

    def first_fails(numel, dtype, device, what):
        attempts.append(numel)
        return None if len(attempts) == 1 else real_try_empty(numel, dtype, device, what)

    monkeypatch.setattr(D, "try_empty", first_fails)
    # a policy that evicts only the first storage, as if the rest would have fitted beside the buffer
    monkeypatch.setattr(D.policy, "choose_defragment", lambda sizes, nbytes, free, headroom: D.policy.DefragmentDecision(
        Tier.EVICT, "test", nbytes, free, headroom, (0,)))
    flat = defragment(tensors, headroom_bytes=1 << 62)
    assert len(attempts) == 2 and torch.equal(bits(flat), bits(reference))


def test_packed_tensors_move_nothing():
    buffer = bits_tensor((50,), torch.float32, 4)
    tensors = [alias(buffer, start, n) for start, n in ((0, 20), (20, 5), (25, 25))]
    assert is_packed(tensors)
    flat = defragment(tensors)
    assert flat.data_ptr() == buffer.data_ptr() and torch.equal(bits(flat), bits(buffer))
    assert not is_packed(tensors[:2]), "a prefix does not fill the storage"
    assert not is_packed([tensors[1], tensors[0], tensors[2]]), "out of order"


def test_bad_input_is_refused_before_anything_moves():
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="one dtype and one device"):
        defragment(tensors)
    assert tensors[0].data_ptr() != tensors[1].data_ptr() and tensors[0].sum() == 3
    with pytest.raises(ValueError, match="tier must be"):
        defragment([torch.ones(3)], tier="host")
    with pytest.raises(TypeError, match=r"tensors\[1\] is a list"):
        defragment([torch.ones(3), [1]])


# ------------------------------------------------------------------------------- stage 3, key on and off


class TwoBits(torch.nn.Module):
    """Two submodules: under zero.Init each gets its own partition buffer, so the optimizer must pack."""

    def __init__(self, dtype=None):
        super().__init__()
        self.a = BitsModule(SHAPES, seed=2, dtype=dtype)
        self.b = BitsModule(SHAPES[::-1], seed=3, dtype=dtype)


def stage3_buffer(backend: str, world_size: int, rank: int, partition_first: bool = False):
    """Build BitsModule under zero.Init (or ztriton.partition), initialize stage 3, read the flat buffer.

    Returns the lp_param_buffer's valid bytes per param (the pad past each param's end on the last
    rank is uninitialised in DeepSpeed's partitions), and whether every ds_tensor aliases the buffer.
    """
    import ztriton

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3}, **dtype_config(torch.bfloat16), "partition_backend": backend}
    if partition_first:
        module = TwoBits(dtype=torch.bfloat16)
        made = ztriton.partition(module)
    else:
        made = None
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            module = TwoBits()
    engine, optimizer, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                                 config=cfg)
    flat = optimizer.lp_param_buffer
    valid, aliased, offset = [], True, 0
    for param in (p for group in optimizer.fp16_groups for p in group):
        n = zero3_slice(param.ds_numel, world_size).valid_numel(rank)
        valid.append(bits(flat.narrow(0, offset, param.ds_tensor.numel()))[:n].clone())
        aliased &= param.ds_tensor.data_ptr() == flat.data_ptr() + offset * flat.element_size()
        offset += param.ds_tensor.numel()
    same_storage = made is not None and flat.untyped_storage().data_ptr() == \
        made.buffers[torch.bfloat16].untyped_storage().data_ptr()
    engine.destroy()
    return valid, aliased and offset == flat.numel(), same_storage


@pytest.mark.parametrize("world_size, ranks", [(1, [0]), (3, [0, 2]), (8, [3, 7])])
def test_lp_param_buffer_key_on_matches_key_off(fake_world, caplog, world_size, ranks):
    import logging

    for rank in ranks:
        with fake_world(world_size, rank), caplog.at_level(logging.INFO, logger="ztriton"):
            off, off_aliased, _ = stage3_buffer("torch", world_size, rank)
            caplog.clear()
            on, on_aliased, _ = stage3_buffer("triton", world_size, rank)
        assert off_aliased and on_aliased
        assert any("ztriton defragment of 12 partitions: device" in r.getMessage() for r in caplog.records)
        for a, b in zip(off, on, strict=True):
            assert torch.equal(a, b)


def test_ztriton_partition_buffer_is_taken_as_is(fake_world, caplog):
    """ztriton.partition's per-rank buffer already has the optimizer's layout: nothing moves."""
    import logging

    with fake_world(3, 1), caplog.at_level(logging.INFO, logger="ztriton"):
        off, _, _ = stage3_buffer("torch", 3, 1)
        on, aliased, same_storage = stage3_buffer("triton", 3, 1, partition_first=True)
    assert aliased and same_storage
    assert any("already fill one buffer in order; nothing moves" in r.getMessage() for r in caplog.records)
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b)


def _both_buffers(rank, world_size):
    return stage3_buffer("torch", world_size, rank), stage3_buffer("triton", world_size, rank)


@pytest.mark.slow
def test_lp_param_buffer_key_on_matches_key_off_on_gloo(gloo_world):
    for (off, off_aliased, _), (on, on_aliased, _) in gloo_world(_both_buffers, 2):
        assert off_aliased and on_aliased
        for a, b in zip(off, on, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_defragment_frees_device_memory():
    """The allocator's numbers: after the pack only the flat buffer remains."""
    device = torch.device("cuda")
    gc.collect()  # an earlier test's garbage freed now, not by the collection below (it would lower the count)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    buffers = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in (1 << 20, 3 << 20, 5 << 19)]
    tensors = [b.view(-1)[s] for b in buffers for s in (slice(0, 1000), slice(1000, None))]
    tensors = [torch.empty(0, dtype=t.dtype, device=device).set_(t.untyped_storage(), t.storage_offset(), (t.numel(),))
               for t in tensors]
    expected = torch.cat([t.clone() for t in tensors])
    del buffers
    total_bytes = expected.numel() * 2
    flat = defragment(tensors[::-1])
    gc.collect()
    assert torch.equal(bits(flat), bits(torch.cat([t.clone() for t in tensors[::-1]])))
    del expected
    probe_base = torch.cuda.memory_allocated(device)
    probe = torch.empty_like(flat)  # what the allocator charges for a buffer of flat's size (rounded up)
    charged = torch.cuda.memory_allocated(device) - probe_base
    del probe
    assert charged >= total_bytes
    assert torch.cuda.memory_allocated(device) - base == charged, "an old partition buffer is still allocated"
    evicted = defragment([flat[:100].clone(), flat[100:]], tier="evict")
    assert evicted.numel() == flat.numel()
