"""transformers' ``from_pretrained`` under ZeRO-3 (``HfDeepSpeedConfig``) with ``"partition_backend"`` on and off.

Tiny models are built from a config, given distinct random weights and saved with ``save_pretrained``;
``from_pretrained`` then loads them under ``zero.Init`` (transformers enters it itself when an
``HfDeepSpeedConfig`` of stage 3 is alive). With the key ("triton") and without it ("torch") every
parameter must come out with the same ZeRO-3 attributes and, bit for bit, the same partition, and that
partition must be this rank's slice of the saved checkpoint: rank r owns flat elements
``[r * psize, r * psize + psize)`` of the row-major flattening, ``psize = ceil(numel / W)`` (the part past
the end of the last rank's slice is padding that DeepSpeed leaves uninitialised, so it is not compared).

How the values get there: transformers builds the model under ``no_init_weights`` (params hold whatever
``torch.empty`` gave). Key off, it then gathers each module's params, lets global rank 0 copy the checkpoint in,
and re-partitions with a broadcast from rank 0; key on, ztriton's shard-on-read reads each rank's slices and
gathers nothing (every load asserts which of the two ran: :func:`check_ran`). So, for key off:

* in a world of one, and on rank 0 of a simulated world (torch's fake process group), each partition is
  read straight from the checkpoint: values are checked there;
* on any other simulated rank the broadcast moves nothing and the partition keeps uninitialised memory,
  so only the ZeRO-3 attributes are compared (bits would be noise);
* a real gloo world of two and of three processes checks the values on every rank, padding included (odd
  numels).

The Mixtral case has fused 3-D expert params, the largest tensors of the model (checked), and sets
``"ztriton": {"sharded_init_bytes": <the smallest expert param>}`` so that exactly the expert params are
placeholders of the key's exact sharded init (each rank replays its own slice; under ``no_init_weights``
nothing is drawn); that is asserted from the DEBUG lines of logger ``"ztriton"``.

The Zamba case: an fp32 param built inside a bf16 ``zero.Init`` (Zamba's ``A_log``) ends up bf16 with
DeepSpeed's own partitioning; the key must do the same (it once failed there: a pack from fp32 into bf16).

Values that ztriton writes at ``zero.Init`` time are never observable here (the load overwrites every
partition from the checkpoint); what these tests see is where ztriton put the partitions (offsets and aliasing
in its per-rank buffers, attributes, dtype), that DeepSpeed's gather and re-partition work on them, and
which params were initialised shard by shard.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import deepspeed  # noqa: F401 - imported before transformers' integration so that ztriton's hooks are in place
import ztriton  # noqa: F401 - installs the "partition_backend" hooks
from ds_reference import bits, gloo_safe_gathers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, ZambaConfig
from transformers.integrations import deepspeed as hf_deepspeed

DTYPE = torch.bfloat16

# hidden_size 15 (3 heads, head_dim 4 set apart: RoPE needs it even) makes the embeddings, norms and one
# expert tensor odd-sized, so a world of two or three splits them unevenly and the last rank's partition has
# padding.
# Biases put several params in one module, i.e. several partitions in one of ztriton's per-rank buffers.
LLAMA = dict(vocab_size=67, hidden_size=15, head_dim=4, intermediate_size=22, num_hidden_layers=2,
             num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=False,
             attention_bias=True, mlp_bias=True)
# A small vocabulary so that the experts (3 x 26 x 15 and 3 x 15 x 13 elements) are the largest tensors.
MIXTRAL = dict(vocab_size=31, hidden_size=15, head_dim=4, intermediate_size=13, num_hidden_layers=2,
               num_attention_heads=3, num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2,
               max_position_embeddings=16, tie_word_embeddings=False)
# Zamba's mamba layers build A_log as log(arange(..., dtype=float32)): an fp32 param inside a bf16 zero.Init
# (transformers' prevent_arange_dtype_change keeps arange's dtype), which DeepSpeed turns into bf16. Six
# layers is the fewest that keep two hybrid layers, between which Zamba ties its shared transformer.
ZAMBA = dict(vocab_size=32, hidden_size=16, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
             attention_head_dim=8, intermediate_size=32, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2,
             n_mamba_heads=2, attn_layer_period=3, attn_layer_offset=2, max_position_embeddings=16,
             use_mamba_kernels=False)
MODELS = {"llama": (LlamaConfig, LLAMA), "mixtral": (MixtralConfig, MIXTRAL), "zamba": (ZambaConfig, ZAMBA)}

# Fused expert params of transformers >= 5 (``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``).
EXPERT_PARAM = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
# The DEBUG line listing the placeholder params of one module initialised shard by shard (exact sharded init):
# "... initialised shard by shard (MixtralExperts.gate_up_proj (3, 26, 15) torch.bfloat16 on cpu (made at ...), ...)".
SHARDED = re.compile(r"^ztriton zero\.Init: \d+ param\(s\) initialised shard by shard \(")
SHARDED_PARAM = re.compile(r"(?:shard \(|, )(?P<module>\w+)\.(?P<param>\w+) \(")


def ds_config(backend: str, sharded_init_bytes: int | None = None) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **gloo_safe_gathers()}, "bf16": {"enabled": True},
           "partition_backend": backend}
    if sharded_init_bytes is not None:
        cfg["ztriton"] = {"sharded_init_bytes": sharded_init_bytes}
    return cfg


# ---------------------------------------------------------------------------------------------- HfDeepSpeedConfig


class _Zero3ConfigWithoutAccelerate:
    """What transformers reads through its global reference to an ``HfDeepSpeedConfig``: ``.config`` (the
    dict ``zero.Init`` gets, via ``deepspeed_config()``) and ``.is_zero3()``.

    transformers' ``HfDeepSpeedConfig`` is accelerate's class (without accelerate installed it derives from
    ``object`` and its constructor fails with "object.__init__() takes exactly one argument"), and accelerate
    is not among this project's dependencies. accelerate's ``__init__`` deep-copies a dict config and reads
    the stage; this does the same, and is registered the way ``HfDeepSpeedConfig.__init__`` registers itself.
    """

    def __init__(self, config: dict[str, Any]):
        self.config = copy.deepcopy(config)
        hf_deepspeed.set_hf_deepspeed_config(self)

    def is_zero3(self) -> bool:
        return self.config.get("zero_optimization", {}).get("stage") == 3


def _accelerate_available() -> bool:
    from transformers.utils import is_accelerate_available

    return is_accelerate_available()


@contextlib.contextmanager
def hf_zero3(config: dict[str, Any]) -> Iterator[None]:
    """transformers sees ZeRO-3 with ``config`` for the duration (the object is kept alive: transformers
    holds only a weak reference), and nothing afterwards, so that other tests are not affected."""
    if _accelerate_available():
        holder = hf_deepspeed.HfDeepSpeedConfig(config)
    else:
        warnings.warn("accelerate is not installed: transformers' HfDeepSpeedConfig cannot be built, so the test "
                      "registers a stand-in holding the same config (pip install accelerate to use the real one)",
                      stacklevel=3)
        holder = _Zero3ConfigWithoutAccelerate(config)
    try:
        assert hf_deepspeed.is_deepspeed_zero3_enabled()
        assert hf_deepspeed.deepspeed_config()["partition_backend"] == config["partition_backend"]
        yield
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
        del holder
    assert not hf_deepspeed.is_deepspeed_zero3_enabled()


# ---------------------------------------------------------------------------------------------- checkpoints


def save_model(name: str, directory: Path) -> dict[str, torch.Tensor]:
    """Save a tiny ``name`` model with distinct random weights (bf16, except params the model builds in
    another dtype); return its parameters by name.

    Every parameter (norm weights included, which would otherwise all be ones) gets fresh normal values,
    so an off-by-one or misplaced slice shows in the bits.
    """
    config_class, kwargs = MODELS[name]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config_class(**kwargs), dtype=DTYPE)
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def checkpoint_params(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The saved tensors on CPU, named as the loaded model names its parameters.

    transformers 5 saves Mixtral's fused experts in the per-expert layout of the hub checkpoints
    (``block_sparse_moe.experts.E.w1/w2/w3.weight``, router ``block_sparse_moe.gate``) and fuses them when
    loading: ``gate_up_proj[E] = cat(w1, w3)``, ``down_proj[E] = w2``. Rebuilt here from the file.
    """
    saved: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        saved.update(load_file(path, device="cpu"))
    out = {}
    for name in names:
        if name in saved:
            out[name] = saved[name]
            continue
        match = EXPERT_PARAM.match(name)
        if match is not None:
            prefix = f"{match['layer']}.block_sparse_moe.experts"
            count = len({k for k in saved if k.startswith(prefix + ".") and k.endswith(".w2.weight")})
            if match["kind"] == "gate_up_proj":
                experts = [torch.cat([saved[f"{prefix}.{e}.w1.weight"], saved[f"{prefix}.{e}.w3.weight"]])
                           for e in range(count)]
            else:
                experts = [saved[f"{prefix}.{e}.w2.weight"] for e in range(count)]
            out[name] = torch.stack(experts)
            continue
        legacy = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        assert legacy in saved, f"{name} is not in the checkpoint ({sorted(saved)[:5]}...)"
        out[name] = saved[legacy]
    return out


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    params: dict[str, torch.Tensor]  # read back from the saved file


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    out = {}
    for name in MODELS:
        directory = tmp_path_factory.mktemp(name)
        source = save_model(name, directory)
        params = checkpoint_params(directory, list(source))
        for key, tensor in source.items():  # the file says what the model held: our reading of it is right
            assert tensor.shape == params[key].shape and torch.equal(bits(tensor), bits(params[key])), key
        out[name] = Checkpoint(directory, params)
    return out


def expert_threshold(params: dict[str, torch.Tensor]) -> int:
    """Bytes of the smallest expert param, after checking that the experts are the largest tensors."""
    experts = {n: t.numel() * t.element_size() for n, t in params.items() if EXPERT_PARAM.match(n)}
    others = {n: t.numel() * t.element_size() for n, t in params.items() if not EXPERT_PARAM.match(n)}
    assert experts, "no fused 3-D expert params: this test expects transformers >= 5's Mixtral"
    assert all(params[n].dim() == 3 for n in experts)
    assert min(experts.values()) > max(others.values()), (experts, max(others.items(), key=lambda kv: kv[1]))
    return min(experts.values())


# ---------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Loaded:
    """One parameter after ``from_pretrained`` under ZeRO-3 on one rank (plain data, so it pickles)."""

    ds_shape: tuple[int, ...]
    ds_numel: int
    ds_numel_aligned: int
    partition_numel: int  # ds_tensor.ds_numel
    partition_dtype: torch.dtype
    data_numel: int
    status: str
    partition: torch.Tensor  # a CPU copy of the whole ds_tensor
    full: torch.Tensor | None  # the gathered parameter (real worlds only)


@dataclass(frozen=True)
class Ran:
    """What one from_pretrained did: ztriton's shard-on-read loads (calls of ``ztriton.loading.load_into``) and
    the ``GatheredParameters`` contexts entered (transformers' own ZeRO-3 path gathers every module's params)."""

    reads: int
    gathers: int


SHARD_ON_READ = Ran(reads=1, gathers=0)  # key on: one shard-on-read load, nothing gathered


@contextlib.contextmanager
def watching() -> Iterator[list[str]]:
    """Records "read" for each shard-on-read load and "gather" for each GatheredParameters entered, meanwhile."""
    from ztriton import loading

    seen: list[str] = []
    load_into, gathered = loading.load_into, deepspeed.zero.GatheredParameters

    def reading(*args, **kwargs):
        seen.append("read")
        return load_into(*args, **kwargs)

    class Counted(gathered):
        def __init__(self, *args, **kwargs):
            seen.append("gather")
            super().__init__(*args, **kwargs)

    loading.load_into, deepspeed.zero.GatheredParameters = reading, Counted
    try:
        yield seen
    finally:
        loading.load_into, deepspeed.zero.GatheredParameters = load_into, gathered


def load(path: Path, backend: str, sharded_init_bytes: int | None = None, gather: bool = False
         ) -> tuple[dict[str, Loaded], Ran]:
    """``from_pretrained(path)`` under ZeRO-3 with ``backend``, in the current world: each param, and what ran."""
    with hf_zero3(ds_config(backend, sharded_init_bytes)), watching() as seen:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
    ran = Ran(reads=seen.count("read"), gathers=seen.count("gather"))
    full = {}
    if gather:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            full = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    return {n: Loaded(ds_shape=tuple(p.ds_shape), ds_numel=p.ds_numel, ds_numel_aligned=p.ds_numel_aligned,
                      partition_numel=p.ds_tensor.ds_numel, partition_dtype=p.ds_tensor.dtype,
                      data_numel=p.data.numel(), status=p.ds_status.name,
                      partition=p.ds_tensor.detach().to("cpu", copy=True), full=full.get(n))
            for n, p in model.named_parameters()}, ran


def check_ran(backend: str, ran: Ran) -> None:
    """Key on read shard-on-read and gathered nothing; key off was transformers' own path (it gathers)."""
    if backend == "triton":
        assert ran == SHARD_ON_READ, ran
    else:
        assert ran.reads == 0 and ran.gathers > 0, ran


def in_model_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as ZeRO-3 holds it: zero.Init makes every floating param bf16 (a no-op for bf16)."""
    return tensor.to(DTYPE)


def rank_slice(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Bits of rank ``rank``'s elements of ``tensor`` in the model dtype (possibly fewer than a partition, or none)."""
    psize = math.ceil(tensor.numel() / world_size)
    return bits(in_model_dtype(tensor))[rank * psize:rank * psize + psize]


def check_attributes(off: dict[str, Loaded], on: dict[str, Loaded], checkpoint: Checkpoint, world_size: int) -> None:
    """Same parameters, same ZeRO-3 attributes with the key on and off, and those of the checkpoint's shapes."""
    assert list(off) == list(on) and sorted(on) == sorted(checkpoint.params)
    for name, a in off.items():
        b, want = on[name], checkpoint.params[name]
        attributes = (a.ds_shape, a.ds_numel, a.ds_numel_aligned, a.partition_numel, a.partition_dtype,
                      a.data_numel, a.status)
        assert attributes == (b.ds_shape, b.ds_numel, b.ds_numel_aligned, b.partition_numel, b.partition_dtype,
                              b.data_numel, b.status), name
        assert (b.ds_shape, b.ds_numel, b.partition_numel, b.partition_dtype, b.data_numel, b.status) == \
               (tuple(want.shape), want.numel(), math.ceil(want.numel() / world_size), DTYPE, 0, "NOT_AVAILABLE"), name


def check_values(off: dict[str, Loaded], on: dict[str, Loaded], checkpoint: Checkpoint, world_size: int,
                 rank: int) -> None:
    """Bits of each partition's valid prefix: key on == key off == the checkpoint's slice for ``rank``."""
    for name, a in off.items():
        want = rank_slice(checkpoint.params[name], world_size, rank)
        valid = want.numel()
        assert torch.equal(bits(on[name].partition)[:valid], want), (name, rank, "key on")
        assert torch.equal(bits(a.partition)[:valid], want), (name, rank, "key off (DeepSpeed's own gathers)")
        if a.full is not None:  # gathered from every rank's partition
            want = bits(in_model_dtype(checkpoint.params[name]))
            assert torch.equal(bits(a.full), want), (name, rank, "key off, gathered")
            assert torch.equal(bits(on[name].full), want), (name, rank, "key on, gathered")


def sharded_params(caplog) -> list[tuple[str, str]]:
    """(module class, param name) of every placeholder param initialised shard by shard."""
    return [m.groups() for r in caplog.records if r.name == "ztriton" and SHARDED.match(r.getMessage())
            for m in SHARDED_PARAM.finditer(r.getMessage())]


# ---------------------------------------------------------------------------------------------- simulated ranks


@pytest.mark.parametrize("world_size, ranks", [(1, (0,)), (3, (0, 2))])
def test_llama_from_pretrained_key_on_matches_key_off_and_checkpoint(checkpoints, fake_world, caplog, world_size,
                                                                     ranks):
    checkpoint = checkpoints["llama"]
    for rank in ranks:
        loaded = {}
        for backend in ("torch", "triton"):
            with fake_world(world_size, rank), caplog.at_level(logging.DEBUG, logger="ztriton"):
                caplog.clear()
                loaded[backend], ran = load(checkpoint.path, backend)
            check_ran(backend, ran)
            used = [r for r in caplog.records if "zero.Init partitions through ztriton" in r.getMessage()]
            partitions = [r for r in caplog.records if r.getMessage().startswith("ztriton partition:")]
            if backend == "triton":  # the key reached the zero.Init that transformers entered
                assert len(used) == 1 and partitions, [r.getMessage() for r in caplog.records]
            else:
                assert not used and not partitions
        check_attributes(loaded["torch"], loaded["triton"], checkpoint, world_size)
        if rank == 0:  # other simulated ranks hold no values: the broadcast from rank 0 moves nothing there
            check_values(loaded["torch"], loaded["triton"], checkpoint, world_size, rank)


@pytest.mark.parametrize("world_size, ranks", [(1, (0,)), (3, (0, 2))])
def test_mixtral_from_pretrained_shards_the_experts_init_and_loads_the_same(checkpoints, fake_world, caplog,
                                                                                   world_size, ranks):
    checkpoint = checkpoints["mixtral"]
    threshold = expert_threshold(checkpoint.params)
    experts = sorted(n for n in checkpoint.params if EXPERT_PARAM.match(n))
    for rank in ranks:
        loaded = {}
        for backend in ("torch", "triton"):
            with fake_world(world_size, rank), caplog.at_level(logging.DEBUG, logger="ztriton"):
                caplog.clear()
                loaded[backend], ran = load(checkpoint.path, backend, sharded_init_bytes=threshold)
            check_ran(backend, ran)
            sharded = sharded_params(caplog)
            fallbacks = [r.getMessage() for r in caplog.records if "cannot be recorded" in r.getMessage()]
            if backend == "triton":  # every expert param, and nothing else, was a placeholder; none fell back
                assert len(sharded) == len(experts) == 2 * MIXTRAL["num_hidden_layers"], sharded
                assert sorted(p for _, p in sharded) == sorted(n.rsplit(".", 1)[1] for n in experts), sharded
                assert not fallbacks, fallbacks
            else:
                assert not sharded
        check_attributes(loaded["torch"], loaded["triton"], checkpoint, world_size)
        if rank == 0:
            check_values(loaded["torch"], loaded["triton"], checkpoint, world_size, rank)


def test_zamba_fp32_param_in_a_bf16_zero_init_loads_the_same(checkpoints, fake_world):
    """Zamba's A_log is fp32 when its module's __init__ returns; key off, DeepSpeed leaves it bf16 with the
    checkpoint's values rounded to bf16, and key on must do the same."""
    checkpoint = checkpoints["zamba"]
    assert any(t.dtype == torch.float32 for t in checkpoint.params.values()), "Zamba's A_log was meant to be fp32"
    loaded = {}
    for backend in ("torch", "triton"):
        with fake_world(1, 0):
            loaded[backend], ran = load(checkpoint.path, backend)
        check_ran(backend, ran)
    check_attributes(loaded["torch"], loaded["triton"], checkpoint, 1)
    check_values(loaded["torch"], loaded["triton"], checkpoint, 1, 0)


def test_hf_zero3_leaves_nothing_behind(checkpoints):
    """After the context transformers no longer sees ZeRO-3: a plain load gives full, non-ZeRO tensors."""
    with hf_zero3(ds_config("triton")):
        assert hf_deepspeed.is_deepspeed_zero3_enabled()
    assert not hf_deepspeed.is_deepspeed_zero3_enabled() and hf_deepspeed.deepspeed_config() is None
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"].path, dtype=DTYPE)
    for name, param in model.named_parameters():
        assert not hasattr(param, "ds_id")
        assert torch.equal(bits(param), bits(checkpoints["llama"].params[name])), name


# ---------------------------------------------------------------------------------------------- a real world


def _load_both(rank: int, world_size: int, paths: dict[str, str], thresholds: dict[str, int | None]):
    """One rank of a gloo world: each model loaded with the key off and on (module level: it is pickled)."""
    return {name: {backend: load(Path(path), backend, thresholds[name], gather=True) for backend in ("torch", "triton")}
            for name, path in paths.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_from_pretrained_key_on_matches_key_off_and_checkpoint_on_every_rank_on_gloo(checkpoints, gloo_world,
                                                                                      world_size):
    """Real collectives: rank 0's checkpoint values reach the other ranks, whose slices (with padding) are checked
    too; on every rank key on read shard-on-read and gathered nothing."""
    thresholds = {"llama": None, "mixtral": expert_threshold(checkpoints["mixtral"].params)}
    paths = {name: str(checkpoints[name].path) for name in thresholds}
    results = gloo_world(_load_both, world_size, paths, thresholds, timeout=240.0)
    padded = 0
    for rank, result in enumerate(results):
        for name in thresholds:
            (off, ran_off), (on, ran_on) = result[name]["torch"], result[name]["triton"]
            check_ran("torch", ran_off)
            check_ran("triton", ran_on)
            checkpoint = checkpoints[name]
            check_attributes(off, on, checkpoint, world_size)
            check_values(off, on, checkpoint, world_size, rank)
            padded += sum(rank == world_size - 1 and p.ds_numel % world_size != 0 for p in on.values())
    assert padded >= 4, "odd-sized params (a padded last partition) were meant to be covered"
