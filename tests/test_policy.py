"""ztriton.policy: tier thresholds, forced tiers, fallbacks, chunk sizes, evictions, probes and logging.

Pure functions of numbers, tested at and around every threshold; Hypothesis for the properties.
"""
from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ztriton import memory
from ztriton.memory import GiB, MemoryInfo, MiB, probe_memory
from ztriton.policy import (DEFAULT_HEADROOM_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Options, Tier, choose_chunk_bytes,
                            choose_evictions, choose_flatten_tier, flatten_fallbacks, log_decision, parse_tier)

# ------------------------------------------------------------------------------- choose_flatten_tier

M = 8 * GiB  # the group
H = 1 * GiB  # headroom


def tier_of(free, world=4, host=1 << 50, headroom=H, group=M, forced=None):
    return choose_flatten_tier(group, world, free, host, headroom, forced)


def test_device_tier_exactly_at_threshold():
    assert tier_of(M + H).tier is Tier.DEVICE
    assert tier_of(M + H - 1).tier is not Tier.DEVICE


def test_distributed_tier_between_window_and_group():
    """W > 1: below the flat buffer but at least this rank's 1/W window (rounded up)."""
    window = -(-M // 4)
    assert tier_of(M + H - 1).tier is Tier.DISTRIBUTED
    assert tier_of(window + H).tier is Tier.DISTRIBUTED
    assert tier_of(window + H - 1).tier is Tier.EVICT
    odd = choose_flatten_tier(10, 3, 4 + H, 1 << 40, H)  # ceil(10 / 3) = 4
    assert odd.tier is Tier.DISTRIBUTED
    assert choose_flatten_tier(10, 3, 3 + H, 1 << 40, H).tier is Tier.EVICT


def test_world_of_one_skips_distributed():
    assert tier_of(M + H - 1, world=1).tier is Tier.EVICT
    assert tier_of(M + H, world=1).tier is Tier.DEVICE


def test_evict_bytes_are_what_is_missing():
    d = tier_of(3 * GiB + H, world=1)
    assert d.tier is Tier.EVICT and d.evict_bytes == M - 3 * GiB
    # headroom above what is free: everything must go
    d = tier_of(H // 2, world=1)
    assert d.tier is Tier.EVICT and d.evict_bytes == M


def test_host_tier_when_host_cannot_take_the_evictions():
    assert tier_of(3 * GiB + H, world=1, host=M - 3 * GiB).tier is Tier.EVICT
    d = tier_of(3 * GiB + H, world=1, host=M - 3 * GiB - 1)
    assert d.tier is Tier.HOST and d.evict_bytes == 0


def test_decision_carries_its_figures():
    d = tier_of(5 * GiB, world=2, host=7, headroom=3)
    assert (d.group_bytes, d.world_size, d.free_bytes, d.headroom_bytes) == (M, 2, 5 * GiB, 3)
    assert "GiB" in d.reason


def test_default_headroom_is_one_gib():
    assert DEFAULT_HEADROOM_BYTES == GiB
    assert choose_flatten_tier(M, 1, M + GiB, 0).tier is Tier.DEVICE
    assert choose_flatten_tier(M, 1, M + GiB - 1, 1 << 50).tier is Tier.EVICT


@pytest.mark.parametrize("forced", list(Tier) + [t.value for t in Tier])
def test_forced_tiers_win(forced):
    d = tier_of(0, world=4, host=0, forced=forced)  # nothing fits, yet the caller's tier is taken
    assert d.tier is Tier(forced)
    assert "forced" in d.reason
    assert d.evict_bytes == (M if Tier(forced) is Tier.EVICT else 0)


def test_forced_device_with_plenty_of_room_evicts_nothing():
    assert tier_of(1 << 50, forced="evict").evict_bytes == 0


def test_forced_distributed_needs_more_than_one_rank():
    with pytest.raises(ValueError, match="needs a world of more than one rank"):
        tier_of(M * 4, world=1, forced="distributed")


@pytest.mark.parametrize("kwargs, name", [
    (dict(group=-1), "group_bytes"), (dict(free=-1), "free_bytes"), (dict(host=-1), "host_bytes"),
    (dict(headroom=-1), "headroom_bytes"), (dict(world=0), "world_size"),
])
def test_flatten_tier_rejects_negative_figures(kwargs, name):
    args = dict(free=M, world=2, host=0, headroom=H, group=M)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{name}"):
        tier_of(**args)


def test_flatten_tier_rejects_unknown_tier():
    with pytest.raises(ValueError):
        tier_of(M, forced="gpu")


@given(group=st.integers(0, 1 << 40), world=st.integers(1, 64), free=st.integers(0, 1 << 41),
       host=st.integers(0, 1 << 41), headroom=st.integers(0, 1 << 32))
def test_flatten_tier_properties(group, world, free, host, headroom):
    """The chosen tier's extra device memory fits the budget, and no cheaper tier's would."""
    d = choose_flatten_tier(group, world, free, host, headroom)
    budget = free - headroom
    window = -(-group // world)
    if d.tier is Tier.DEVICE:
        assert budget >= group
    else:
        assert budget < group
    if d.tier is Tier.DISTRIBUTED:
        assert world > 1 and budget >= window
    if d.tier in (Tier.EVICT, Tier.HOST):
        assert world == 1 or budget < window
    if d.tier is Tier.EVICT:
        assert d.evict_bytes == group - max(budget, 0) <= host
        assert max(budget, 0) + d.evict_bytes >= group  # evicting that much makes room
    if d.tier is Tier.HOST:
        assert host < group - max(budget, 0)


# ------------------------------------------------------------------------------------ fallbacks


def test_flatten_fallbacks():
    assert flatten_fallbacks(Tier.DEVICE) == (Tier.DEVICE, Tier.EVICT, Tier.HOST)
    assert flatten_fallbacks("distributed") == (Tier.DISTRIBUTED, Tier.EVICT, Tier.HOST)
    assert flatten_fallbacks(Tier.EVICT) == (Tier.EVICT, Tier.HOST)
    assert flatten_fallbacks(Tier.HOST) == (Tier.HOST,)
    for tier in Tier:  # distributed (collective) is never entered as a fallback
        assert Tier.DISTRIBUTED not in flatten_fallbacks(tier)[1:]
    with pytest.raises(ValueError):
        flatten_fallbacks("gpu")


# ------------------------------------------------------------------------------------ chunk sizes


def test_chunk_requested_wins():
    assert choose_chunk_bytes(0, requested=3 * MiB) == 3 * MiB
    assert choose_chunk_bytes(1 << 50, requested=MIN_CHUNK_BYTES) == MIN_CHUNK_BYTES
    assert choose_chunk_bytes(0, requested=5 * GiB) == 5 * GiB  # above the default cap: the caller's call


def test_chunk_requested_below_minimum_rejected():
    with pytest.raises(ValueError, match=r"chunk_bytes=1048575 is below the minimum of 1048576"):
        choose_chunk_bytes(1 << 40, requested=MIN_CHUNK_BYTES - 1)


@pytest.mark.parametrize("free, headroom, buffers, expected", [
    (0, GiB, 2, MIN_CHUNK_BYTES),                 # nothing free: the minimum
    (GiB, GiB, 2, MIN_CHUNK_BYTES),
    (GiB + 80 * MiB, GiB, 2, 10 * MiB),           # a quarter of 80 MiB, over 2 buffers
    (GiB + 81 * MiB, GiB, 2, 10 * MiB),           # rounded down to whole MiB
    (GiB + 80 * MiB, GiB, 5, 4 * MiB),
    (1 << 50, GiB, 2, MAX_CHUNK_BYTES),           # capped
    (8 * GiB, 0, 2, MAX_CHUNK_BYTES),
    (8 * MiB, 0, 1, 2 * MiB),
])
def test_chunk_from_free_memory(free, headroom, buffers, expected):
    assert choose_chunk_bytes(free, headroom, buffers=buffers) == expected


@given(free=st.integers(0, 1 << 45), headroom=st.integers(0, 1 << 34), buffers=st.integers(1, 16))
def test_chunk_properties(free, headroom, buffers):
    chunk = choose_chunk_bytes(free, headroom, buffers=buffers)
    assert MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES and chunk % MiB == 0
    if chunk > MIN_CHUNK_BYTES:  # all buffers together stay within a quarter of what is free
        assert buffers * chunk * 4 <= free - headroom


# ------------------------------------------------------------------------------------- evictions


def test_evictions_examples():
    assert choose_evictions([], 10) == []
    assert choose_evictions([5, 7], 0) == []
    assert choose_evictions([4, 9, 6, 12], 5) == [2]        # the smallest that covers it alone
    assert choose_evictions([4, 9, 6, 12], 12) == [3]
    assert choose_evictions([4, 9, 6, 12], 13) == [0, 3]    # the largest, then the smallest covering the rest
    assert choose_evictions([4, 9, 6, 12], 100) == [0, 1, 2, 3]  # not enough: all
    assert choose_evictions([3, 3, 3], 3) == [0]            # ties: the first


def test_evictions_reject_negatives():
    with pytest.raises(ValueError, match="evict_bytes"):
        choose_evictions([1], -1)
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        choose_evictions([1, -2], 1)


@given(sizes=st.lists(st.integers(0, 1000), max_size=40), need=st.integers(0, 20000))
def test_evictions_properties(sizes, need):
    chosen = choose_evictions(sizes, need)
    assert chosen == sorted(set(chosen)) and all(0 <= i < len(sizes) for i in chosen)
    freed = sum(sizes[i] for i in chosen)
    if need == 0:
        assert chosen == []
    elif sum(sizes) < need:
        assert freed == sum(sizes)  # everything that has bytes goes (zero-size ones too, harmlessly)
    else:
        assert freed >= need
        assert freed - min(sizes[i] for i in chosen) < need  # just enough: without its smallest it falls short


# ------------------------------------------------------------------------------------ probes and logs


def test_probe_memory_on_cpu():
    info = probe_memory("cpu")
    assert info.source == "host" and info.device == "cpu"
    assert info.device_free == info.host_available > 0
    assert memory.host_available_bytes() > 0


@pytest.mark.gpu
def test_probe_memory_on_cuda():
    info = probe_memory("cuda")
    assert info.source in ("nvml", "torch")
    assert 0 < info.device_free <= info.device_total
    assert info.host_available > 0


@pytest.mark.gpu
def test_probe_counts_the_allocators_idle_cache_as_free():
    """Freed blocks the caching allocator keeps are free to this process: the probe adds exactly
    reserved - allocated to the driver's figure."""
    import torch

    torch.cuda.empty_cache()
    idle = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del idle  # 256 MiB cached, not allocated
    assert memory._cached_bytes(torch.cuda.current_device()) == \
        torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 256 << 20
    torch.cuda.empty_cache()
    assert memory._cached_bytes(torch.cuda.current_device()) == torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


@pytest.mark.gpu
def test_measure_peak_reports_the_peak_above_the_start():
    """The peak figure is what max_memory_allocated - memory_allocated gives: a 64 MiB buffer held at the
    start does not count, a 32 MiB temporary made and freed inside the call does."""
    import torch

    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def work():
        temporary = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        del temporary
        return torch.empty(8 << 20, dtype=torch.uint8, device="cuda")

    out, seconds, peak = memory.measure_peak(work)
    assert out.numel() == 8 << 20 and seconds > 0
    assert peak == 32 << 20 == torch.cuda.max_memory_allocated() - (torch.cuda.memory_allocated() - (8 << 20))
    del held, out


def test_nvml_handle_looked_up_once_per_process(monkeypatch):
    """A probe asks NVML for the device's memory each time but for its handle once per process (a forked
    child, with another pid, looks it up anew); a failing NVML gives None (the probe then asks torch)."""
    import types

    lookups = []
    fake = types.SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda index: lookups.append(index) or f"handle{index}",
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(free=3 * GiB, total=8 * GiB))
    monkeypatch.setattr(memory, "_nvml", lambda: fake)
    monkeypatch.setattr(memory, "_NVML_HANDLES", {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert memory._nvml_free(1) == memory._nvml_free(1) == (3 * GiB, 8 * GiB)
    assert lookups == [1]
    monkeypatch.setattr(memory.os, "getpid", lambda: -1)
    memory._nvml_free(1)
    assert lookups == [1, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-6a1b")  # a UUID: no index to look up
    assert memory._nvml_free(0) is None


def test_log_decision(caplog):
    decision = choose_flatten_tier(M, 4, 3 * GiB + H, 1 << 50, H)
    memory = MemoryInfo("cuda:0", 4 * GiB, 80 * GiB, 100 * GiB, "nvml")
    with caplog.at_level(logging.INFO, logger="ztriton"):
        log_decision("flatten group 3", decision, memory)
        log_decision("plain", "a string decision")
    first, second = caplog.messages
    assert first.startswith("ztriton flatten group 3: distributed -- free 3.00 GiB after headroom")
    assert "[free 4.00 GiB of 80.00 GiB on cuda:0 (nvml), host 100.00 GiB]" in first
    assert second == "ztriton plain: a string decision -- "


def test_tier_is_a_string_enum():
    assert Tier("evict") is Tier.EVICT and Tier.HOST == "host"


def test_host_init_threshold():
    from ztriton.policy import GiB, MiB, choose_sharded_init_bytes

    assert choose_sharded_init_bytes(139 * GiB) == 1 * GiB  # a roomy device: 1 GiB
    assert choose_sharded_init_bytes(4 * GiB) == 512 * MiB  # a tight one: an eighth of what is free
    assert choose_sharded_init_bytes(0) == 1 * MiB  # never below the minimum chunk
    assert choose_sharded_init_bytes(139 * GiB, configured=0) == 0  # configured: every param to the host
    assert choose_sharded_init_bytes(0, configured=12345) == 12345
    with pytest.raises(ValueError, match="sharded_init_bytes must be an int >= 0"):
        choose_sharded_init_bytes(GiB, configured=-1)


def test_defragment_decision():
    from ztriton.policy import GiB, Tier, choose_defragment

    roomy = choose_defragment([GiB, GiB], 2 * GiB, free_bytes=10 * GiB, headroom_bytes=GiB)
    assert roomy.tier is Tier.DEVICE and roomy.evict == ()
    # 2.5 GiB free after headroom, 4 GiB to build: evict at least 1.5 GiB, the fewest bytes that cover it
    tight = choose_defragment([GiB, 2 * GiB, GiB // 2, GiB // 2], 4 * GiB, free_bytes=int(3.5 * GiB), headroom_bytes=GiB)
    assert tight.tier is Tier.EVICT and tight.evict == (1,)
    assert "1 partition storage(s), 2.00 GiB" in tight.reason
    nothing_free = choose_defragment([GiB, GiB], 2 * GiB, free_bytes=0, headroom_bytes=GiB)
    assert nothing_free.evict == (0, 1)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        choose_defragment([GiB], -1, 0)


# ------------------------------------------------------------------------------------ options


def test_options_defaults_resolved_once():
    assert Options.of() == Options(DEFAULT_HEADROOM_BYTES, None, None)
    assert Options.of(headroom_bytes=0, chunk_bytes=MIN_CHUNK_BYTES, sharded_init_bytes=0) == Options(0, MIN_CHUNK_BYTES, 0)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(headroom_bytes=-1), r"^headroom_bytes must be an int >= 0 \(bytes\), got -1"),
    (dict(headroom_bytes=True), r"^headroom_bytes must be an int >= 0"),
    (dict(chunk_bytes=1.5 * MiB), r"^chunk_bytes must be an int >= 0"),
    (dict(chunk_bytes=MIN_CHUNK_BYTES - 1), r"^chunk_bytes=1048575 is below the minimum of 1048576"),
    (dict(sharded_init_bytes=-5), r"^sharded_init_bytes must be an int >= 0"),
])
def test_options_refuse_bad_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Options.of(**kwargs)


def test_parse_tier():
    assert parse_tier(None) is None and parse_tier("evict") is Tier.EVICT and parse_tier(Tier.HOST) is Tier.HOST
    with pytest.raises(ValueError, match=r"tier must be one of \['device', 'evict'\] or None, got 'host'"):
        parse_tier("host", allowed=(Tier.DEVICE, Tier.EVICT))
    with pytest.raises(ValueError, match=r"got 'gpu'"):
        parse_tier("gpu")


def test_staging_chunk_clamped_to_the_data():
    """A requested chunk never exceeds the data it stages: chunk_bytes=2**40 on a small model is
    not a 2**40-byte allocation per rank on the staging rank; a failed size is retried at its halves."""
    from ztriton.policy import staging_numels

    assert staging_numels(2**40, 5 * MiB, 2)[0] == 5 * MiB
    assert staging_numels(4 * MiB, 5 * MiB, 2)[0] == 2 * MiB
    assert staging_numels(2**40, 3, 4) == [3, 1]
    assert staging_numels(MIN_CHUNK_BYTES, 1, 2) == [1]
    sizes = staging_numels(MIN_CHUNK_BYTES, 10 * MiB, 4)
    assert sizes[0] == MIN_CHUNK_BYTES // 4 and sizes[-1] == 1
    assert all(a == 2 * b or a == 2 * b + 1 for a, b in zip(sizes, sizes[1:]))


def test_options_take_integer_likes_as_ints():
    import numpy as np

    options = Options.of(headroom_bytes=np.int64(5), chunk_bytes=np.uint32(2 * MiB), sharded_init_bytes=np.int16(7))
    assert options == Options(5, 2 * MiB, 7) and type(options.headroom_bytes) is int
    for bad in ("5", 5.0, [5], np.float64(5), True):
        with pytest.raises(ValueError, match=r"^chunk_bytes must be an int >= 0"):
            Options(chunk_bytes=bad)
    with pytest.raises(ValueError, match=r"^headroom_bytes must be an int >= 0 \(bytes\), got None"):
        Options(headroom_bytes=None)
