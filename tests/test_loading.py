"""Shard-on-read loading: safetensors parsing, load_into, and load_checkpoint into ZeRO-3 partitions.

Every value check compares bytes (``bits``: same-width integer views). Checkpoint values differ from
the module's own, and partitions are filled with a marker byte before each load, so a missed write,
a write to the wrong place or unzeroed padding all show.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import ztriton
from ds_reference import bits, bits_tensor
from ztriton.integrations.zero3_loading import load_checkpoint
from ztriton.layout import zero3_slice
from ztriton.loading import Checkpoint, CheckpointError, Concat, Key, Stack, Target, load_into
from ztriton.loading import checkpoint as checkpoint_module
from ztriton.loading import reader as reader_module

MARK = 0x5A  # byte written over every partition before a load


# ------------------------------------------------------------------------------------ helpers


def write_raw(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file with a hand-made header (and a given header length, to corrupt it)."""
    raw = json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


def save_sharded(tensors: dict, folder: Path, shards: int = 2) -> Path:
    """``save_pretrained``'s layout: tensors spread over ``shards`` files plus an index json."""
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


class Net(torch.nn.Module):
    """Params of awkward sizes (one smaller than any W > 2), a persistent and a non-persistent buffer."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.proj = torch.nn.Linear(7, 5, dtype=dtype)
        self.embed = torch.nn.Embedding(11, 3, dtype=dtype)
        self.tiny = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


NET_PARAMS = {"proj.weight": (5, 7), "proj.bias": (5,), "embed.weight": (11, 3), "tiny": (2,)}


def net_checkpoint(dtype=torch.float32, seed=7) -> dict[str, torch.Tensor]:
    tensors = {name: bits_tensor(shape, dtype, seed, i) for i, (name, shape) in enumerate(NET_PARAMS.items())}
    if dtype != torch.float32:  # a cast test: finite values, so that the cast itself is what is checked
        tensors = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + i)).to(dtype) * 3
                   for i, (n, t) in enumerate(tensors.items())}
    tensors["steps"] = torch.arange(4, dtype=torch.int64) * 1000 + 3
    return tensors


def partition(module, how: str):
    if how == "ztriton":
        ztriton.partition(module)
    else:
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        deepspeed.zero.Init(module=module, config_dict_or_path=config)
    for p in module.parameters():
        p.ds_tensor.view(torch.uint8).fill_(MARK)
    return module


def snapshot(module) -> dict[str, torch.Tensor]:
    """Every partition's and buffer's bytes."""
    state = {n: bits(p.ds_tensor).clone() if hasattr(p, "ds_tensor") else bits(p).clone()
             for n, p in module.named_parameters()}
    state.update({n: bits(b).clone() for n, b in module.named_buffers()})
    return state


def assert_unchanged(module, before):
    after = snapshot(module)
    assert after.keys() == before.keys()
    for name in before:
        assert torch.equal(after[name], before[name]), f"{name} changed"


def assert_partition(param, full: torch.Tensor, world: int, rank: int, name: str):
    """``ds_tensor`` holds the rank's slice of ``full`` (already in the param's dtype), zeros after."""
    sl = zero3_slice(full.numel(), world)
    valid = sl.valid_numel(rank)
    start = sl.rank_start(rank)
    expected = full.reshape(-1)[start:start + valid]
    assert param.ds_tensor.numel() == sl.partition_numel
    assert torch.equal(bits(param.ds_tensor[:valid]), bits(expected)), name
    assert not bits(param.ds_tensor[valid:]).any(), f"{name}: padding is not zero"


COLLECTIVES = ["broadcast", "all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "barrier",
               "scatter", "reduce", "send", "recv", "all_to_all_single"]


@contextlib.contextmanager
def no_collectives(monkeypatch):
    """Fail on any collective or point-to-point call, through torch.distributed or deepspeed.comm."""
    import deepspeed.comm

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"the load ran a collective: {name}")
        return call

    with monkeypatch.context() as patch:
        for module in (torch.distributed, deepspeed.comm):
            for name in COLLECTIVES:
                if hasattr(module, name):
                    patch.setattr(module, name, refuse(name))
        patch.setattr(deepspeed.zero.GatheredParameters, "__enter__", refuse("GatheredParameters"))
        yield


def partition_bytes(shapes: dict, itemsize: int, world: int, rank: int) -> int:
    return sum(zero3_slice(math.prod(s), world).valid_numel(rank) * itemsize for s in shapes.values())


# ------------------------------------------------------------------------------------ parsing


ST_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def test_parser_agrees_with_safetensors(tmp_path):
    tensors = {f"t{i}.{str(d)[6:]}": bits_tensor(shape, d, 3, i) for i, (d, shape) in
               enumerate(zip(ST_DTYPES, [(3, 5), (7,), (2, 3, 4), (1,), (0, 4), (5, 1), (), (9,), (4, 4), (3,),
                                         (6, 2), (1, 1, 1)]))}
    tensors["t0.float64"] = tensors["t0.float64"].view(torch.int64) % 1000 * 1.0  # not every bit pattern is a float64
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    ckpt = Checkpoint(path)
    assert sorted(ckpt.keys()) == sorted(tensors)
    with safe_open(str(path), "pt") as reference:
        assert ckpt.metadata[path] == reference.metadata()
        raw = path.read_bytes()
        for key in tensors:
            info = ckpt.info(key)
            want = reference.get_tensor(key)
            assert (info.file, info.dtype, info.shape, info.nbytes) == \
                   (path, want.dtype, tuple(want.shape), want.numel() * want.element_size())
            got = torch.frombuffer(bytearray(raw[info.offset:info.offset + info.nbytes]) or bytearray(1),
                                   dtype=torch.uint8)[:info.nbytes]
            assert torch.equal(got, want.reshape(-1).view(torch.uint8)), key


def test_dtype_table_matches_safetensors():
    from safetensors.torch import _TYPES

    for name, dtype in _TYPES.items():
        if dtype is not None:
            assert checkpoint_module.SAFETENSORS_DTYPES[name] == dtype, name


def test_directory_and_index_open_the_same_tensors(tmp_path):
    tensors = net_checkpoint()
    index = save_sharded(tensors, tmp_path)
    by_index, by_dir = Checkpoint(index), Checkpoint(tmp_path)
    assert sorted(by_index.keys()) == sorted(by_dir.keys()) == sorted(tensors)
    assert len(by_dir.files()) == 2
    for key in tensors:
        assert by_index.info(key) == by_dir.info(key)
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"a": tensors["tiny"]}, str(plain / "a.safetensors"))
    save_file({"b": tensors["steps"]}, str(plain / "b.safetensors"))
    assert sorted(Checkpoint(plain).keys()) == ["a", "b"]  # no index: every file


def corrupt_cases(tmp_path):
    """(label, path, error pattern): every way a checkpoint can be broken, each named in the error."""
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32), "v": torch.ones(2, dtype=torch.float32)}, str(good))
    data = good.read_bytes()
    cases = [("missing file", tmp_path / "nope.safetensors", "does not exist")]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-3])
    cases.append(("truncated data", cut, r"tensor '[wv]' in .*cut.safetensors.*truncated"))
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:5])
    cases.append(("shorter than the length word", short, r"short.safetensors.*too short"))
    cases.append(("header length past the end",
                  write_raw(tmp_path / "len.safetensors", {"w": {}}, length=10**6), r"len.safetensors: header length"))
    cases.append(("bad json", write_raw(tmp_path / "json.safetensors", {}, length=0).with_name("json.safetensors"),
                  "not valid JSON"))
    (tmp_path / "json.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops")
    cases.append(("not an object", write_raw(tmp_path / "list.safetensors", []), "not an object"))
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases.append(("out of bounds", write_raw(tmp_path / "oob.safetensors", {"w": entry}, b"\0" * 4),
                  r"tensor 'w' in .*oob.safetensors.*run past the end"))
    cases.append(("overlap", write_raw(tmp_path / "ovl.safetensors", {
        "a": entry, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
        r"ovl.safetensors: tensors 'a' .* and 'b' .* overlap"))
    cases.append(("unknown dtype", write_raw(tmp_path / "dt.safetensors", {
        "w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        r"tensor 'w' in .*dt.safetensors.*'X9'"))
    cases.append(("size mismatch", write_raw(tmp_path / "sz.safetensors", {
        "w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        r"tensor 'w' in .*sz.safetensors.*hold 8 bytes but shape \(3,\) of BF16 needs 6"))
    cases.append(("bad shape", write_raw(tmp_path / "shape.safetensors", {
        "w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "shape"))
    cases.append(("bad offsets", write_raw(tmp_path / "off.safetensors", {
        "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4), "data_offsets"))
    cases.append(("bad metadata", write_raw(tmp_path / "meta.safetensors", {"__metadata__": {"a": 1}}),
                  "__metadata__"))
    folder = tmp_path / "sharded"
    folder.mkdir()
    index = save_sharded({"w": torch.ones(3), "v": torch.zeros(2)}, folder)
    (folder / json.loads(index.read_text())["weight_map"]["w"]).unlink()
    cases.append(("index names a missing shard", index, r"index puts 1 tensors \('w', ...\) in .*does not exist"))
    folder2 = tmp_path / "sharded2"
    folder2.mkdir()
    index2 = save_sharded({"w": torch.ones(3), "v": torch.zeros(2)}, folder2)
    content = json.loads(index2.read_text())
    content["weight_map"]["ghost"] = content["weight_map"]["w"]
    index2.write_text(json.dumps(content))
    cases.append(("index names a tensor the file lacks", index2, r"tensor 'ghost' in .*whose header does not hold it"))
    dup = tmp_path / "dup"
    dup.mkdir()
    save_file({"w": torch.ones(1)}, str(dup / "a.safetensors"))
    save_file({"w": torch.ones(1)}, str(dup / "b.safetensors"))
    cases.append(("tensor in two files", dup, r"tensor 'w' is stored twice"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append(("empty directory", empty, "holds no"))
    return cases


def test_every_corruption_is_refused_naming_file_and_tensor(tmp_path):
    for label, path, pattern in corrupt_cases(tmp_path):
        with pytest.raises(CheckpointError, match=pattern):
            Checkpoint(path)
        assert issubclass(CheckpointError, ValueError), label


def test_corrupt_checkpoint_changes_no_partition(tmp_path, fake_world):
    with fake_world(3, 1):
        module = partition(Net(), "ztriton")
        before = snapshot(module)
        for label, path, pattern in corrupt_cases(tmp_path):
            with pytest.raises(CheckpointError, match=pattern):
                load_checkpoint(module, path, progress=False)
            assert_unchanged(module, before)


# ------------------------------------------------------------------------------------ loading into ZeRO-3


WORLDS = [(1, 0), (3, 0), (3, 2), (8, 0), (8, 7)]


@pytest.mark.parametrize("how", ["ztriton", "deepspeed"])
@pytest.mark.parametrize("world,rank", WORLDS)
def test_partitions_equal_the_checkpoint_slices(tmp_path, fake_world, monkeypatch, world, rank, how):
    tensors = net_checkpoint()
    sharded = (world + rank) % 2 == 1  # both layouts across the worlds
    path = save_sharded(tensors, tmp_path) if sharded else tmp_path / "model.safetensors"
    if not sharded:
        save_file(tensors, str(path))
    with fake_world(world, rank):
        module = partition(Net(), how)
        with no_collectives(monkeypatch):
            report = load_checkpoint(module, tmp_path if sharded and rank else path, progress=False, staging_bytes=96)
            with pytest.raises(AssertionError, match="ran a collective"):  # the guard is live
                torch.distributed.barrier()
    params = dict(module.named_parameters())
    for name in NET_PARAMS:
        assert_partition(params[name], tensors[name], world, rank, name)
    assert torch.equal(module.steps, tensors["steps"])  # buffers load whole
    assert sorted(report.loaded) == sorted([*NET_PARAMS, "steps"])
    assert report.missing_keys == [] and report.unexpected_keys == []
    # exactly this rank's slices plus the unpartitioned buffer: nothing else was read
    assert report.bytes_read == partition_bytes(NET_PARAMS, 4, world, rank) + tensors["steps"].nbytes


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 2), (8, 7)])
def test_fp32_checkpoint_into_bf16_partitions(tmp_path, fake_world, world, rank):
    tensors = net_checkpoint(torch.float32, seed=11)
    tensors = {n: (t if n == "steps" else torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) * 7)
               for i, (n, t) in enumerate(tensors.items())}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with fake_world(world, rank):
        module = partition(Net(torch.bfloat16), "ztriton")
        report = load_checkpoint(module, tmp_path / "m.safetensors", progress=False, staging_bytes=64)
    params = dict(module.named_parameters())
    for name in NET_PARAMS:
        assert params[name].ds_tensor.dtype == torch.bfloat16
        assert_partition(params[name], tensors[name].to(torch.bfloat16), world, rank, name)
    assert report.bytes_read == partition_bytes(NET_PARAMS, 4, world, rank) + tensors["steps"].nbytes


class Experts(torch.nn.Module):
    """A fused-expert module: gate_up[e] = cat(w1_e, w3_e), down[e] = w2_e (Mixtral's conversion)."""

    def __init__(self, experts=3, ffn=4, hidden=5):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.zeros(experts, 2 * ffn, hidden))
        self.down = torch.nn.Parameter(torch.zeros(experts, hidden, ffn))
        self.norm = torch.nn.Parameter(torch.zeros(hidden))


def expert_checkpoint(experts=3, ffn=4, hidden=5):
    tensors = {}
    for e in range(experts):
        for i, (w, shape) in enumerate([("w1", (ffn, hidden)), ("w2", (hidden, ffn)), ("w3", (ffn, hidden))]):
            tensors[f"experts.{e}.{w}.weight"] = bits_tensor(shape, torch.float32, 5, 10 * e + i)
    tensors["norm.weight"] = bits_tensor((hidden,), torch.float32, 5, 99)
    sources = {"gate_up": Stack(tuple(Concat((Key(f"experts.{e}.w1.weight"), Key(f"experts.{e}.w3.weight")))
                                      for e in range(experts))),
               "down": Stack(tuple(Key(f"experts.{e}.w2.weight") for e in range(experts))),
               "norm": Key("norm.weight")}
    fused = {"gate_up": torch.stack([torch.cat([tensors[f"experts.{e}.w1.weight"], tensors[f"experts.{e}.w3.weight"]])
                                     for e in range(experts)]),
             "down": torch.stack([tensors[f"experts.{e}.w2.weight"] for e in range(experts)]),
             "norm": tensors["norm.weight"]}
    return tensors, sources, fused


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1), (8, 7)])
def test_fused_experts_from_per_expert_tensors(tmp_path, fake_world, world, rank):
    tensors, sources, fused = expert_checkpoint()
    index = save_sharded(tensors, tmp_path, shards=3)
    with fake_world(world, rank):
        module = partition(Experts(), "ztriton")
        report = load_checkpoint(module, index, sources=sources, progress=False, staging_bytes=128)
    params = dict(module.named_parameters())
    for name, full in fused.items():
        assert_partition(params[name], full, world, rank, name)
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert report.bytes_read == partition_bytes({n: t.shape for n, t in fused.items()}, 4, world, rank)


def test_plain_params_tied_weights_and_strided_tensors(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(6, 4)
            self.head = torch.nn.Linear(4, 6, bias=False)
            self.head.weight = self.embed.weight  # tied: one tensor, two names
            self.t = torch.nn.Parameter(torch.zeros(5, 3).t())  # a transposed (non-contiguous) param

    tensors = {"embed.weight": bits_tensor((6, 4), torch.float32, 1, 0), "t": bits_tensor((3, 5), torch.float32, 1, 1),
               "extra": torch.ones(2)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    module = Tied()
    report = load_checkpoint(module, tmp_path / "m.safetensors", progress=False)
    assert torch.equal(bits(module.head.weight), bits(tensors["embed.weight"]))
    assert torch.equal(bits(module.t), bits(tensors["t"])) and module.t.stride() == (1, 3)
    assert sorted(report.loaded) == ["embed.weight", "t"]
    assert report.missing_keys == [] and report.unexpected_keys == ["extra"]
    assert report.bytes_read == tensors["embed.weight"].nbytes + tensors["t"].nbytes
    with pytest.raises(CheckpointError, match=r"unexpected keys \['extra'\]"):
        load_checkpoint(module, tmp_path / "m.safetensors", strict=True, progress=False)


def test_missing_keys_are_reported_and_left_alone(tmp_path, fake_world):
    tensors = net_checkpoint()
    del tensors["proj.bias"], tensors["steps"]
    tensors["cache"] = torch.ones(3)  # a non-persistent buffer's name: unexpected, as in load_state_dict
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with fake_world(3, 2):
        module = partition(Net(), "ztriton")
        before = snapshot(module)
        pattern = r"missing keys \['proj.bias', 'steps'\].*unexpected keys \['cache'\]"
        with pytest.raises(CheckpointError, match=pattern):
            load_checkpoint(module, tmp_path / "m.safetensors", strict=True, progress=False)
        assert_unchanged(module, before)
        report = load_checkpoint(module, tmp_path / "m.safetensors", progress=False)
    assert report.missing_keys == ["proj.bias", "steps"] and report.unexpected_keys == ["cache"]
    after = snapshot(module)
    assert torch.equal(after["proj.bias"], before["proj.bias"]) and torch.equal(after["steps"], before["steps"])
    assert_partition(dict(module.named_parameters())["tiny"], tensors["tiny"], 3, 2, "tiny")


def model_errors(tmp_path):
    """(label, checkpoint tensors, sources, error pattern) of loads that must be refused up front."""
    good = net_checkpoint()
    cases = []
    wrong = dict(good, **{"proj.weight": torch.zeros(7, 5)})
    cases.append(("shape mismatch", wrong, None,
                  r"target 'proj.weight': checkpoint tensor 'proj.weight' in .*m.safetensors has shape \(7, 5\) "
                  r"but the model expects \(5, 7\)"))
    cases.append(("uncastable dtype", dict(good, steps=torch.zeros(4)), None,
                  r"target 'steps': checkpoint tensor 'steps' in .*m.safetensors is torch.float32, which cannot be cast"
                  r" to the model's torch.int64"))
    cases.append(("source of missing key", good, {"proj.weight": Concat((Key("proj.weight"), Key("proj.wieght")))},
                  r"target 'proj.weight': checkpoint tensor 'proj.wieght' is not in .*close names: \['proj.weight'"))
    cases.append(("source builds another shape", good, {"embed.weight": Stack((Key("proj.bias"),))},
                  r"target 'embed.weight': its source \(1 tensors\) in .*m.safetensors has shape \(1, 5\) but the "
                  r"model expects \(11, 3\)"))
    cases.append(("concat that cannot be built", good, {"proj.weight": Concat((Key("proj.weight"), Key("tiny")), 1)},
                  r"target 'proj.weight': Concat.*part 1 \(Key\('tiny'\)\) has shape \(2,\).*m.safetensors"))
    cases.append(("source for no param", good, {"nope": Key("tiny")}, r"sources name \['nope'\]"))
    return cases


def test_model_mismatches_are_refused_before_any_write(tmp_path, fake_world):
    with fake_world(8, 7):
        module = partition(Net(), "ztriton")
        before = snapshot(module)
        for label, tensors, sources, pattern in model_errors(tmp_path):
            save_file(tensors, str(tmp_path / "m.safetensors"))
            with pytest.raises(CheckpointError, match=pattern):
                load_checkpoint(module, tmp_path / "m.safetensors", sources=sources, progress=False)
            assert_unchanged(module, before)


def test_gathered_params_are_refused(tmp_path, fake_world):
    save_file(net_checkpoint(), str(tmp_path / "m.safetensors"))
    with fake_world(1, 0):
        module = partition(Net(), "ztriton")
        import deepspeed

        before = snapshot(module)
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            with pytest.raises(CheckpointError, match="is gathered"):
                load_checkpoint(module, tmp_path / "m.safetensors", progress=False)
        assert_unchanged(module, before)


# ------------------------------------------------------------------------------------ load_into


def test_load_into_checks_every_target_first(tmp_path):
    save_file({"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    good = torch.full((4,), 9.0)
    bad_cases = [
        (Target("x", Key("a"), (3, 4), torch.zeros(2, 2)), "1-D contiguous"),
        (Target("x", Key("a"), (3, 4), torch.zeros(8)[::2]), "1-D contiguous"),
        (Target("x", Key("a"), (3, 4), torch.zeros(4), start=-1), "start must be"),
        (Target("x", Key("a"), (3, 4), torch.zeros(4), start=10, count=4), r"elements \[10, 14\) are outside"),
        (Target("x", Key("a"), (3, 4), torch.zeros(4), count=5), "do not fit in out of 4"),
        (Target("x", Key("a"), (3, 4), torch.zeros(4, device="meta")), "meta"),
        (Target("x", Key("a"), (4, 3), torch.zeros(4)), r"has shape \(3, 4\) but the model expects \(4, 3\)"),
    ]
    for bad, pattern in bad_cases:
        with pytest.raises(CheckpointError, match=pattern):
            load_into([Target("ok", Key("a"), (3, 4), good), bad], ckpt)
        assert torch.equal(good, torch.full((4,), 9.0))
    shared = torch.zeros(8)
    with pytest.raises(CheckpointError, match="overlap in memory"):
        load_into([Target("p", Key("b"), (5,), shared[:5]), Target("q", Key("a"), (3, 4), shared[4:])], ckpt)
    with pytest.raises(ValueError, match="staging_bytes"):
        load_into([Target("ok", Key("a"), (3, 4), good)], ckpt, staging_bytes=8)
    assert torch.equal(good, torch.full((4,), 9.0)) and not shared.any()


BAD_LOAD_ARGUMENTS = [
    ("checkpoint", None, TypeError), ("checkpoint", 3, TypeError), ("checkpoint", "", ValueError),
    ("group", [0, 1], ValueError), ("group", 0, ValueError),  # without torch.distributed: no group to give
    ("sources", [Key("weight")], TypeError), ("sources", torch.ones(2), TypeError),
    ("sources", {"weight": "weight"}, TypeError), ("sources", {0: Key("weight")}, TypeError),
    ("strict", torch.ones(2), TypeError), ("strict", 1, TypeError),
    ("progress", torch.ones(2), TypeError), ("progress", None, TypeError),
    ("threads", 2**64, ValueError), ("threads", 0, ValueError), ("threads", 65, ValueError),
    ("threads", True, TypeError), ("threads", 2.0, TypeError),
    ("staging_bytes", 2**64, ValueError), ("staging_bytes", 63, ValueError), ("staging_bytes", True, TypeError),
    ("staging_bytes", "64", TypeError),
]


@pytest.mark.parametrize("arg,value,error", BAD_LOAD_ARGUMENTS,
                         ids=[f"{a}-{type(v).__name__}-{i}" for i, (a, v, _) in enumerate(BAD_LOAD_ARGUMENTS)])
def test_bad_arguments_are_refused_before_the_checkpoint_is_opened(tmp_path, monkeypatch, arg, value, error):
    save_file({"weight": torch.randn(2, 3), "bias": torch.randn(2)}, str(tmp_path / "m.safetensors"))
    opened = []
    real_read_header = checkpoint_module._read_header
    monkeypatch.setattr(checkpoint_module, "_read_header", lambda f: opened.append(f) or real_read_header(f))
    module = torch.nn.Linear(3, 2)
    before = [bits(p.detach()).clone() for p in module.parameters()]
    args = dict(checkpoint=tmp_path / "m.safetensors", group=None, sources=None, strict=False, progress=False,
                staging_bytes=None, threads=2)
    args[arg] = value
    with pytest.raises(error, match=arg):
        load_checkpoint(module, **args)
    assert not opened, f"the checkpoint was opened before {arg}={value!r} was refused"
    assert all(torch.equal(b, bits(p.detach())) for b, p in zip(before, module.parameters()))
    # The same arguments of load_into are checked by the same code, as early.
    if arg in ("progress", "threads", "staging_bytes"):
        out = torch.full((6,), 7.0)
        with pytest.raises(error, match=arg):
            load_into([Target("weight", Key("weight"), (2, 3), out)], tmp_path / "m.safetensors", **{arg: value})
        assert not opened and torch.equal(out, torch.full((6,), 7.0))


def test_load_into_refuses_targets_that_are_not_a_sequence(tmp_path):
    save_file({"a": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    for junk in (None, 3, "a"):
        with pytest.raises(TypeError, match="targets"):
            load_into(junk, tmp_path / "m.safetensors")
    with pytest.raises(TypeError, match=r"targets\[0\]"):
        load_into([torch.ones(3)], tmp_path / "m.safetensors")


def test_kernels_run_on_follows_what_triton_decided(monkeypatch):
    """triton chose at its import whether it interprets: TRITON_INTERPRET=1 set later must not send
    CPU tensors to kernels that cannot run there (the loader would fail halfway); "0" still opts out."""
    from ztriton.kernels import plan
    from ztriton.memory import kernels_run_on

    assert plan.interpreted() and os.environ["TRITON_INTERPRET"] == "1"  # conftest set it before the import
    assert kernels_run_on(torch.device("cpu"))
    assert not kernels_run_on(torch.device("meta"))
    monkeypatch.setattr(plan, "interpreted", lambda: False)  # as if triton had been imported without the variable
    assert not kernels_run_on(torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels_run_on(torch.device("cpu"))


@pytest.mark.parametrize("threads,staging", [(1, 64), (2, 80), (3, 4096)])
def test_batching_and_threads_do_not_change_the_result(tmp_path, monkeypatch, threads, staging):
    tensors, sources, fused = expert_checkpoint(experts=4, ffn=3, hidden=6)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    outs = {name: torch.full((full.numel() // 3 + 2,), -1.0) for name, full in fused.items()}
    targets = [Target(n, sources[n], tuple(fused[n].shape), out, start=fused[n].numel() // 3)
               for n, out in outs.items()]
    launches = []
    real_pack = reader_module.pack_slices
    monkeypatch.setattr(reader_module, "pack_slices", lambda dst, slices: launches.append(len(slices)) or
                        real_pack(dst, slices))
    report = load_into(targets, tmp_path / "m.safetensors", staging_bytes=staging, threads=threads)
    # the window kernel wrote everything: one launch per target and staging buffer
    batches = -(-report.bytes_read // staging)
    assert len(launches) >= (batches if staging < 4096 else len(targets)) and sum(launches) >= len(launches)
    for name, out in outs.items():
        n = fused[name].numel()
        count = min(out.numel(), n - n // 3)
        assert torch.equal(bits(out[:count]), bits(fused[name].reshape(-1)[n // 3:n // 3 + count]))
        assert not bits(out[count:]).any()
    assert report.bytes_read == sum(min(o.numel(), fused[n].numel() - fused[n].numel() // 3) * 4
                                    for n, o in outs.items())


CASTS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
         (torch.int8, torch.int8), (torch.float64, torch.float16), (torch.uint8, torch.int32)]


@settings(deadline=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(experts=st.integers(1, 4), ffn=st.integers(1, 5), hidden=st.integers(1, 6), world=st.integers(1, 8),
       cast=st.sampled_from(CASTS), staging=st.integers(64, 400), threads=st.integers(1, 3), data=st.data())
def test_load_into_matches_torch_for_any_batching(tmp_path_factory, experts, ffn, hidden, world, cast, staging, threads,
                                                  data):
    """Random fused shapes, windows, dtype casts, staging sizes (splitting parts at odd places)."""
    src_dtype, dst_dtype = cast
    rank = data.draw(st.integers(0, world - 1))
    folder = tmp_path_factory.mktemp("ckpt")
    tensors = {}
    for e in range(experts):
        for w in ("w1", "w3"):
            t = bits_tensor((ffn, hidden), src_dtype, e, hash(w) % 100)
            tensors[f"{e}.{w}"] = t if not src_dtype.is_floating_point else torch.randn(t.shape).to(src_dtype)
    save_file(tensors, str(folder / "m.safetensors"))
    cat_dim = data.draw(st.sampled_from([0, 1, -1]))
    source = Stack(tuple(Concat((Key(f"{e}.w1"), Key(f"{e}.w3")), cat_dim) for e in range(experts)),
                   data.draw(st.sampled_from([0, 1, 2, -1])))
    full = torch.stack([torch.cat([tensors[f"{e}.w1"], tensors[f"{e}.w3"]], cat_dim) for e in range(experts)],
                       source.dim)
    sl = zero3_slice(full.numel(), world)
    out = torch.full((sl.partition_numel,), 9, dtype=dst_dtype)
    report = load_into([Target("fused", source, tuple(full.shape), out, start=sl.rank_start(rank))],
                       folder / "m.safetensors", staging_bytes=staging, threads=threads)
    valid = sl.valid_numel(rank)
    expected = full.reshape(-1)[sl.rank_start(rank):sl.rank_start(rank) + valid].to(dst_dtype)
    assert torch.equal(bits(out[:valid]), bits(expected)) and not bits(out[valid:]).any()
    assert report.bytes_read == valid * src_dtype.itemsize


def test_torch_copy_path_for_devices_without_kernels(tmp_path, monkeypatch):
    tensors, sources, fused = expert_checkpoint()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    monkeypatch.setattr(reader_module, "kernels_run_on", lambda device: False)
    out = torch.full((50,), -1.0, dtype=torch.bfloat16)
    load_into([Target("g", sources["gate_up"], tuple(fused["gate_up"].shape), out, start=100, count=20)],
              tmp_path / "m.safetensors", staging_bytes=64)
    assert torch.equal(bits(out[:20]), bits(fused["gate_up"].reshape(-1)[100:120].to(torch.bfloat16)))
    assert not bits(out[20:]).any()


def test_read_failure_midway_says_what_was_written(tmp_path, monkeypatch):
    names = ["a", "b", "big", "c"]
    tensors = {n: bits_tensor((40 if n == "big" else 6,), torch.float32, 2, i) for i, n in enumerate(names)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    outs = {n: torch.full((t.numel() + 1,), 7.0) for n, t in tensors.items()}
    big = ckpt.info("big")
    real_read = checkpoint_module.read_into

    def failing_read(fd, view, offset, path):
        if big.offset + 64 <= offset < big.offset + big.nbytes:  # big's second staging buffer
            raise OSError(5, "Input/output error", str(path))
        real_read(fd, view, offset, path)

    monkeypatch.setattr(reader_module, "read_into", failing_read)
    targets = [Target(n, Key(n), (t.numel(),), outs[n]) for n, t in tensors.items()]
    order = sorted(names, key=lambda n: ckpt.info(n).offset)
    with pytest.raises(CheckpointError, match=r"Input/output error.*written in full: .*written in part: 'big' "
                                              r"\(elements \[0, 16\).*the other \d targets are as they were") as err:
        load_into(targets, ckpt, staging_bytes=64, threads=2)
    before_big = order[:order.index("big")]
    assert before_big and f"written in full: {before_big} ({len(before_big)} targets)" in str(err.value)
    for n in names:
        if n in before_big:  # written in full (with its padding) before the failure
            assert torch.equal(bits(outs[n][:-1]), bits(tensors[n])) and outs[n][-1] == 0
        elif n == "big":
            assert torch.equal(bits(outs[n][:16]), bits(tensors[n][:16])) and (outs[n][16:] == 7.0).all()
        else:
            assert (outs[n] == 7.0).all(), n


def test_unaligned_tensors_from_other_writers(tmp_path):
    """safetensors itself stores wide dtypes first, so offsets are aligned; other writers need not:
    a float32 tensor right after 3 bfloat16 values starts 6 bytes in."""
    a, b = bits_tensor((3,), torch.bfloat16, 4, 0), torch.arange(5, dtype=torch.float32) - 2.5
    header = {"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [6, 26]}}
    path = write_raw(tmp_path / "odd.safetensors", header, a.view(torch.uint8).numpy().tobytes()
                     + b.view(torch.uint8).numpy().tobytes())
    outs = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float32),
            torch.zeros(5, dtype=torch.float64)]
    report = load_into([Target("a", Key("a"), (3,), outs[0]), Target("b", Key("b"), (5,), outs[1], start=1),
                        Target("b64", Key("b"), (5,), outs[2])], path)
    assert torch.equal(bits(outs[0]), bits(a))
    assert torch.equal(outs[1], b[1:]) and torch.equal(outs[2], b.double())
    assert report.bytes_read == 26  # a's bytes and b's, each once (b's two windows share one read)


def test_file_truncated_after_opening_is_an_error_and_writes_nothing(tmp_path):
    save_file({"a": torch.arange(10.0), "b": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    ckpt = Checkpoint(tmp_path / "m.safetensors")
    os.truncate(tmp_path / "m.safetensors", ckpt.info("a").offset + 8)
    outs = [torch.full((10,), 5.0), torch.full((3,), 5.0)]
    with pytest.raises(CheckpointError, match=r"m.safetensors.*truncated after it was opened.*nothing was written"):
        load_into([Target("a", Key("a"), (10,), outs[0]), Target("b", Key("b"), (3,), outs[1])], ckpt)
    assert all((o == 5.0).all() for o in outs)


def test_all_padding_window_is_zeroed_without_reading(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    out = torch.full((1,), 3.0)
    report = load_into([Target("a", Key("a"), (2,), out, start=7)], tmp_path / "m.safetensors")
    assert out.item() == 0.0 and report.bytes_read == 0


def test_progress_bar_counts_bytes_and_explicit_group(tmp_path, fake_world, capsys, monkeypatch):
    tensors = net_checkpoint()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    monkeypatch.delenv("ZTRITON_PROGRESS", raising=False)
    with fake_world(3, 0):
        module = partition(Net(), "ztriton")
        load_checkpoint(module, tmp_path / "m.safetensors")
    assert "Loading checkpoint" not in capsys.readouterr().err  # stderr is no terminal under pytest: no bar
    monkeypatch.setenv("ZTRITON_PROGRESS", "1")  # a log file that wants it anyway
    with fake_world(3, 0):
        module = partition(Net(), "ztriton")
        report = load_checkpoint(module, tmp_path / "m.safetensors", torch.distributed.group.WORLD)
    assert "Loading checkpoint (ztriton)" in capsys.readouterr().err  # rank 0, progress on by default
    assert report.bytes_read == partition_bytes(NET_PARAMS, 4, 3, 0) + tensors["steps"].nbytes
    params = dict(module.named_parameters())
    for name in NET_PARAMS:
        assert_partition(params[name], tensors[name], 3, 0, name)
    with fake_world(3, 1):
        module = partition(Net(), "ztriton")
        load_checkpoint(module, tmp_path / "m.safetensors")
    assert "Loading checkpoint" not in capsys.readouterr().err  # other ranks stay quiet


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_large_checkpoint_into_partitions(tmp_path):
    """A ~300 MiB fused-expert checkpoint into CUDA partitions (bf16 from fp32, and fp32 as is)."""
    experts, ffn, hidden = 8, 1152, 4096
    tensors, sources, fused = expert_checkpoint(experts, ffn, hidden)
    tensors = {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
               for i, (n, t) in enumerate(tensors.items())}
    fused = {"gate_up": torch.stack([torch.cat([tensors[f"experts.{e}.w1.weight"], tensors[f"experts.{e}.w3.weight"]])
                                     for e in range(experts)]),
             "down": torch.stack([tensors[f"experts.{e}.w2.weight"] for e in range(experts)]),
             "norm": tensors["norm.weight"]}
    index = save_sharded(tensors, tmp_path, shards=4)
    ckpt = Checkpoint(index)
    for dtype in (torch.bfloat16, torch.float32):
        for world, rank in [(1, 0), (8, 0), (8, 7), (3, 2)]:
            outs, targets = {}, []
            for name, full in fused.items():
                sl = zero3_slice(full.numel(), world)
                outs[name] = torch.full((sl.partition_numel,), 3.0, dtype=dtype, device="cuda")
                targets.append(Target(name, sources[name], tuple(full.shape), outs[name], start=sl.rank_start(rank)))
            report = load_into(targets, ckpt, staging_bytes=16 << 20)
            for name, full in fused.items():
                sl = zero3_slice(full.numel(), world)
                start, valid = sl.rank_start(rank), sl.valid_numel(rank)
                expected = full.reshape(-1)[start:start + valid].cuda().to(dtype)
                assert torch.equal(bits(outs[name][:valid]), bits(expected)), (name, dtype, world, rank)
                assert not bits(outs[name][valid:]).any()
            assert report.bytes_read == partition_bytes({n: f.shape for n, f in fused.items()}, 4, world, rank)


@pytest.mark.gpu
def test_gpu_load_checkpoint_into_ztriton_partitions(tmp_path, fake_world):
    tensors, sources, fused = expert_checkpoint(experts=4, ffn=256, hidden=512)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with fake_world(3, 2):
        with torch.device("cuda"):
            module = Experts(4, 256, 512).to(torch.bfloat16)
        partition(module, "ztriton")
        report = load_checkpoint(module, tmp_path / "m.safetensors", sources=sources, progress=False)
    params = dict(module.named_parameters())
    for name, full in fused.items():
        assert params[name].ds_tensor.is_cuda
        assert_partition(params[name], full.cuda().to(torch.bfloat16), 3, 2, name)
    assert report.bytes_read == partition_bytes({n: f.shape for n, f in fused.items()}, 4, 3, 2)
