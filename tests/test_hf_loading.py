"""``from_pretrained`` under ZeRO-3 with ``"partition_backend": "triton"``: shard-on-read, nothing gathered.

Tiny Llama, Mixtral, Qwen2-MoE and DeepSeek-V3 models (``hf_models``) are saved with ``save_pretrained``
(one file, and sharded with an index) and loaded under transformers' ZeRO-3 (``HfDeepSpeedConfig``) on
simulated ranks (torch's fake process group: collectives move nothing, so every value a rank holds after the
load is one it read itself). The oracle is plain ``from_pretrained`` without DeepSpeed: rank r's partition
holds flat elements ``[r * ps, min((r + 1) * ps, numel))`` of the param (``ps = ceil(numel / W)``), in the
partition's dtype. Key off (transformers' own ZeRO-3 path: rank 0 reads, gathers, re-partitions) gives the
same partitions where it is defined without real collectives: a world of one, and rank 0 of a fake world.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import deepspeed
import ztriton  # noqa: F401 - the DeepSpeed hooks of the key (zero.Init)
import hf_models
from ds_reference import bits, gloo_safe_gathers
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.core_model_loading import Concatenate, Transpose, WeightConverter
from transformers.integrations import deepspeed as hf_deepspeed
from transformers.modeling_utils import PreTrainedModel
from ztriton import loading
from ztriton.integrations import transformers as hf_integration
from ztriton.integrations.transformers.conversion import derive_sources
from ztriton.loading import Concat, Key, Stack

DTYPE = hf_models.DTYPE


@pytest.fixture(scope="module", autouse=True)
def _installed():
    """The hooks are in for these tests, and afterwards as they were before (``import ztriton`` installs them as soon
    as transformers' modeling_utils is imported, so later test modules may count on them)."""
    was_installed = hf_integration.installed()
    assert hf_integration.install(), hf_integration.unsupported_reason()
    yield
    if not was_installed:
        hf_integration.uninstall()


# ---------------------------------------------------------------------------------------------- helpers


def ds_config(backend: str) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **gloo_safe_gathers()}, "bf16": {"enabled": True},
            "partition_backend": backend}


@contextlib.contextmanager
def hf_zero3(backend: str) -> Iterator[None]:
    """transformers sees ZeRO-3 with the key set to ``backend`` for the duration, and nothing afterwards."""
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        holder = hf_deepspeed.HfDeepSpeedConfig(ds_config(backend))
    else:  # HfDeepSpeedConfig is accelerate's: register what transformers reads of it (.config, .is_zero3())
        holder = type("Zero3Config", (), {"config": ds_config(backend), "is_zero3": lambda self: True})()
        hf_deepspeed.set_hf_deepspeed_config(holder)
    try:
        yield
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
        del holder


class Collectives:
    """Counts ``GatheredParameters`` contexts (and how many params each gathers) and every all-gather and
    broadcast, at torch.distributed and at DeepSpeed's communication backend (which keeps its own references)."""

    def __init__(self):
        self.gathered: list[int] = []
        self.calls: list[str] = []

    @contextlib.contextmanager
    def counting(self) -> Iterator["Collectives"]:
        undo = []
        original = deepspeed.zero.GatheredParameters
        counter = self

        class CountingGatheredParameters(original):
            def __init__(self, params, *args, **kwargs):
                counter.gathered.append(len(params) if isinstance(params, (list, tuple)) else 1)
                super().__init__(params, *args, **kwargs)

        deepspeed.zero.GatheredParameters = CountingGatheredParameters
        undo.append(lambda: setattr(deepspeed.zero, "GatheredParameters", original))
        backend = deepspeed.comm.comm.cdb
        owners = [(torch.distributed, False)] + ([(backend, True)] if backend is not None else [])
        for owner, on_instance in owners:
            for name in dir(owner):
                if ("gather" in name or "broadcast" in name) and not name.startswith(("__", "has_", "get_", "is_")) \
                        and callable(getattr(owner, name, None)):
                    self._wrap(owner, name, on_instance, undo)
        try:
            yield self
        finally:
            for step in reversed(undo):
                step()

    def _wrap(self, owner, name: str, on_instance: bool, undo: list) -> None:
        function = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return function(*args, **kwargs)

        own = not on_instance or name in vars(owner)  # else a class method, shadowed on the instance for a while
        setattr(owner, name, counted)
        undo.append((lambda: setattr(owner, name, function)) if own else (lambda: delattr(owner, name)))


def load(path: Path, backend: str | None, **kwargs) -> tuple[torch.nn.Module, dict, Collectives, list]:
    """``from_pretrained(path)`` under ZeRO-3 with the key set to ``backend`` (None: no DeepSpeed) in the
    current world; returns the model, its loading info, the collectives seen and ztriton's load reports."""
    reports, collectives = [], Collectives()
    original = loading.load_into

    def recording(*args, **kw):
        report = original(*args, **kw)
        reports.append(report)
        return report

    loading.load_into = recording
    try:
        context = hf_zero3(backend) if backend is not None else contextlib.nullcontext()
        with context, collectives.counting():
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE, output_loading_info=True,
                                                               **kwargs)
    finally:
        loading.load_into = original
    return model, info, collectives, reports


def plain(path: Path, **kwargs) -> dict[str, torch.Tensor]:
    """Params and persistent buffers of plain ``from_pretrained`` (no DeepSpeed), by state-dict name."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE, **kwargs)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def like(want: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``want`` on ``tensor``'s device, in its dtype: the reference is read on the CPU, while ZeRO-3 puts partitions
    and buffers on the accelerator's device (CUDA on the GPU machine), and torch.equal needs one device."""
    return want.to(device=tensor.device, dtype=tensor.dtype)


def valid_window(param, world_size: int, rank: int) -> tuple[int, int]:
    psize = param.ds_tensor.ds_numel
    assert psize == math.ceil(param.ds_numel / world_size)
    start = rank * psize
    return start, max(0, min(start + psize, param.ds_numel) - start)


def check_partitions(model, want: dict[str, torch.Tensor], world_size: int, rank: int, skip: frozenset = frozenset()
                     ) -> None:
    """Every param's partition (valid prefix) holds this rank's slice of ``want``, bit for bit; padding is zero;
    persistent buffers equal ``want`` whole. Tensors named in ``skip`` are not compared."""
    params = dict(model.named_parameters())
    assert params, "no parameters"
    for name, param in params.items():
        if name in skip:
            continue
        start, count = valid_window(param, world_size, rank)
        expected = bits(like(want[name], param.ds_tensor))[start:start + count]
        assert torch.equal(bits(param.ds_tensor)[:count], expected), f"{name}: rank {rank} of {world_size}"
        assert not bits(param.ds_tensor)[count:].any(), f"{name}: padding is not zero"
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in persistent and name not in skip:
            assert torch.equal(bits(buffer), bits(like(want[name], buffer))), name


def same_partitions(a, b, world_size: int, rank: int) -> None:
    """Two ZeRO-3 models hold the same bits in every partition's valid prefix."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(pa) == list(pb)
    for name in pa:
        _, count = valid_window(pa[name], world_size, rank)
        assert torch.equal(bits(pa[name].ds_tensor)[:count], bits(pb[name].ds_tensor)[:count]), name


def bytes_bound(model, checkpoint_dir: Path, world_size: int, rank: int) -> int:
    """Bytes of this rank's partitions in the checkpoint's dtype, plus the whole of each persistent buffer."""
    checkpoint = loading.Checkpoint(checkpoint_dir)
    sizes = {key: checkpoint.info(key).dtype.itemsize for key in checkpoint.keys()}
    itemsize = max(sizes.values())  # the widest checkpoint dtype: a bound, whatever the param's source
    total = 0
    for param in model.parameters():
        total += valid_window(param, world_size, rank)[1] * itemsize
    persistent = set(model.state_dict())
    total += sum(b.numel() * itemsize for n, b in model.named_buffers() if n in persistent)
    return total


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(model, "single" | "sharded") -> checkpoint directory (the same values in both layouts)."""
    out = {}
    for name in hf_models.MODELS:
        root = tmp_path_factory.mktemp(name)
        out[name, "single"] = hf_models.save_checkpoint(name, root / "single")
        out[name, "sharded"] = hf_models.save_checkpoint(name, root / "sharded", max_shard_size="20KB")
        assert hf_models.is_sharded(out[name, "sharded"]) and not hf_models.is_sharded(out[name, "single"])
    return out


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, dict[str, torch.Tensor]]:
    return {name: plain(checkpoints[name, "single"]) for name in hf_models.MODELS}


# ---------------------------------------------------------------------------------------------- sources


def build(source, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """What ``source`` says, with torch (the test's own reading of Key / Stack / Concat)."""
    if isinstance(source, Key):
        return tensors[source.name]
    parts = [build(part, tensors) for part in source.parts]
    return torch.stack(parts, source.dim) if isinstance(source, Stack) else torch.cat(parts, source.dim)


@pytest.mark.parametrize("name", hf_models.MOE_MODELS)
def test_sources_from_transformers_mapping_rebuild_the_fused_params(name, checkpoints, references):
    """Every param's source, derived from the conversion mapping transformers builds for the model, rebuilds
    (with torch.stack / torch.cat over the saved tensors) exactly what plain from_pretrained loads."""
    from safetensors.torch import load_file
    from transformers.conversion_mapping import get_model_conversion_mapping

    directory = checkpoints[name, "sharded"]
    saved = {k: v for path in hf_models.safetensors_files(directory) for k, v in load_file(path).items()}
    model = AutoModelForCausalLM.from_config(hf_models.config(name), dtype=DTYPE)
    derived = derive_sources(model.state_dict().keys(), saved.keys(), get_model_conversion_mapping(model),
                             model.base_model_prefix)
    assert not derived.fallback and not derived.unexpected
    assert sorted(derived.sources) == sorted(references[name])
    for key, source in derived.sources.items():
        # in the model's dtype, as the loader writes it: DeepSeek-V3's router bias is an fp32 buffer that
        # transformers 5.17's from_config casts to bf16 (so its checkpoint stores bf16) and 5.24's keeps fp32
        assert torch.equal(bits(like(build(source, saved), references[name][key])), bits(references[name][key])), key
    fused = {k: s for k, s in derived.sources.items() if k.endswith("gate_up_proj")}
    assert len(fused) == (1 if name == "deepseek_v3" else 2)  # DeepSeek's layer 0 is dense
    for source in fused.values():  # transformers' order: concat(stack_E(gate_E), stack_E(up_E), dim=1)
        assert isinstance(source, Concat) and source.dim == 1 and len(source.parts) == 2
        assert all(isinstance(p, Stack) and p.dim == 0 and len(p.parts) == 4 for p in source.parts)
        gate, up = ([k.name for k in p.parts] for p in source.parts)
        assert [k.rsplit(".", 3)[1] for k in gate] == ["0", "1", "2", "3"]  # experts in numeric order
        assert gate[0].endswith(("experts.0.w1.weight", "experts.0.gate_proj.weight"))
        assert up[0].endswith(("experts.0.w3.weight", "experts.0.up_proj.weight"))


def test_a_conversion_that_is_not_a_rearrangement_falls_back_with_one_log_line(caplog):
    converter = WeightConverter(source_patterns="o_proj_t.weight", target_patterns="o_proj.weight",
                                operations=[Transpose(0, 1)])
    with caplog.at_level(logging.INFO, logger="ztriton"):
        derived = derive_sources(["model.layers.0.self_attn.o_proj.weight", "model.norm.weight"],
                                 ["model.layers.0.self_attn.o_proj_t.weight", "model.norm.weight", "extra.weight"],
                                 [converter], "model")
    assert derived.fallback == {"model.layers.0.self_attn.o_proj.weight": ["model.layers.0.self_attn.o_proj_t.weight"]}
    assert derived.sources == {"model.norm.weight": Key("model.norm.weight")}
    assert derived.unexpected == {"extra.weight"}
    lines = [r.getMessage() for r in caplog.records if "own ZeRO-3 path" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.0.self_attn.o_proj.weight" in lines[0] and "Transpose" in lines[0]


# ---------------------------------------------------------------------------------------------- from_pretrained

# (layout, world size, rank): a world of one, a split by 3 (uneven: padding on the last rank), a split by 8.
WORLDS = [("single", 1, 0), ("single", 3, 0), ("single", 3, 2), ("sharded", 8, 0), ("sharded", 8, 7)]


@pytest.mark.parametrize("name", hf_models.MODELS)
def test_key_on_partitions_are_the_ranks_slices_with_nothing_gathered(name, checkpoints, references, fake_world):
    for layout, world_size, rank in WORLDS:
        with fake_world(world_size, rank):
            model, info, seen, reports = load(checkpoints[name, layout], "triton")
            bound = bytes_bound(model, checkpoints[name, layout], world_size, rank)
        where = f"{name} {layout} rank {rank} of {world_size}"
        check_partitions(model, references[name], world_size, rank)
        assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                        "error_msgs": []}, where
        assert seen.gathered == [] and seen.calls == [], f"{where}: {seen.gathered} {seen.calls}"
        assert len(reports) == 1 and 0 < reports[0].bytes_read <= bound, (where, reports, bound)
        if world_size > 1:  # a rank reads about its share, far less than the checkpoint
            total = sum(p.stat().st_size for p in hf_models.safetensors_files(checkpoints[name, layout]))
            assert reports[0].bytes_read < total / 2, (where, reports[0].bytes_read, total)


@pytest.mark.parametrize("experts, launched", [(4, False), (16, True)])
def test_fused_expert_jobs_of_more_than_16_pieces_launch_the_kernels(experts, launched, tmp_path, fake_world):
    """The route is the job's (issue 34): a Mixtral of 16 experts loads its fused expert tensors as jobs of 32 and 16
    spans at W = 1 (gate_up: a stack of 16 concats of two), so the kernels launch (counted under the interpreter);
    one of 4 experts loads by torch's copies only. The partitions are the checkpoint's either way."""
    from ztriton.kernels import state

    path = hf_models.save_checkpoint("mixtral", tmp_path / "mixtral", num_local_experts=experts)
    want = plain(path)
    with fake_world(1, 0):
        before = state.launches()
        model, info, seen, reports = load(path, "triton")
        launches = state.launches() - before
    assert (launches > 0) == launched, (experts, launches)
    assert len(reports) == 1 and not seen.gathered
    check_partitions(model, want, 1, 0)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_key_on_equals_key_off_where_key_off_is_defined(name, checkpoints, fake_world):
    for world_size in (1, 3):
        models = {}
        for backend in ("torch", "triton"):
            with fake_world(world_size, 0):
                models[backend], info, seen, reports = load(checkpoints[name, "single"], backend)
            if backend == "torch":  # transformers' own path: gathers (this also shows the counter sees them)
                assert seen.gathered and "broadcast" in seen.calls and not reports
            else:
                assert not seen.gathered and not seen.calls and len(reports) == 1
        same_partitions(models["torch"], models["triton"], world_size, 0)


def _drop(keys: list[str]):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for key in keys:
            del tensors[key]
    return edit


def test_missing_keys_are_initialised_one_param_at_a_time_as_key_off(checkpoints, tmp_path, fake_world):
    """A Linear weight, a norm and both fused expert params of one layer (one module, two params: the order of
    their random draws matters) are missing: each is gathered alone, and the values are key off's."""
    experts = [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")]
    dropped = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"] + experts
    directory = hf_models.edit_checkpoint(checkpoints["mixtral", "single"], tmp_path / "missing", _drop(dropped))
    missing = {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
               "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    for world_size in (1, 3):
        models = {}
        for backend in ("torch", "triton"):
            torch.manual_seed(2024)
            with fake_world(world_size, 0):
                models[backend], info, seen, _ = load(directory, backend)
            assert info["missing_keys"] == missing, (backend, info)
            if backend == "triton":
                assert seen.gathered == [1] * len(missing), seen.gathered
        same_partitions(models["torch"], models["triton"], world_size, 0)
        params = dict(models["triton"].named_parameters())
        norm = params["model.norm.weight"]
        count = valid_window(norm, world_size, 0)[1]
        assert torch.equal(norm.ds_tensor[:count].float(), torch.ones(count, device=norm.ds_tensor.device))
        down = params["model.layers.1.mlp.experts.down_proj"].ds_tensor.float()
        assert 0 < down.std() < 0.1  # normal_(std=initializer_range), not left uninitialised


def test_shape_mismatch_fails_before_anything_is_read(checkpoints, tmp_path, fake_world, references):
    def reshape(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:21].clone()

    directory = hf_models.edit_checkpoint(checkpoints["llama", "single"], tmp_path / "mismatch", reshape)
    with fake_world(3, 1):
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\[21, 32\].*\[22, 32\]"
                                             r".*ignore_mismatched_sizes") as error:
            load(directory, "triton")
        assert "nothing was loaded" in str(error.value)
        model, info, seen, reports = load(directory, "triton", ignore_mismatched_sizes=True)
    # as plain from_pretrained reports it; the param is initialised (one gather), everything else loaded
    _, plain_info = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPE, output_loading_info=True,
                                                         ignore_mismatched_sizes=True)
    assert info["mismatched_keys"] == plain_info["mismatched_keys"] == {
        ("model.layers.1.mlp.up_proj.weight", (21, 32), (22, 32))}
    assert seen.gathered == [1] and len(reports) == 1
    want = references["llama"]
    mismatched = dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"]
    for name, param in model.named_parameters():
        if param is not mismatched:  # initialised, not loaded: the checkpoint's is the wrong shape
            start, count = valid_window(param, 3, 1)
            expected = bits(like(want[name], param.ds_tensor))[start:start + count]
            assert torch.equal(bits(param.ds_tensor)[:count], expected), name


def test_unexpected_keys_and_ignore_lists_as_transformers_reports_them(checkpoints, tmp_path, fake_world):
    """DeepSeek-V3 ignores ``model.layers.61.*`` (its multi-token-prediction layer); anything else unknown is
    reported. Its router bias is a persistent fp32 buffer, read whole from the checkpoint on every rank."""
    def add(tensors):
        tensors["model.layers.61.eh_proj.weight"] = torch.ones(2, 2, dtype=DTYPE)
        tensors["model.bogus.weight"] = torch.ones(3, dtype=DTYPE)

    directory = hf_models.edit_checkpoint(checkpoints["deepseek_v3", "single"], tmp_path / "extra", add)
    _, plain_info = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPE, output_loading_info=True)
    with fake_world(8, 5):
        model, info, seen, _ = load(directory, "triton")
    assert info["unexpected_keys"] == plain_info["unexpected_keys"] == {"model.bogus.weight"}
    assert not seen.gathered and not seen.calls
    check_partitions(model, plain(directory), 8, 5)


def test_an_unmapped_conversion_goes_through_transformers_own_path_for_that_param_only(
        checkpoints, tmp_path, fake_world, references, monkeypatch, caplog):
    """A checkpoint storing one weight transposed, with a ``Transpose`` conversion registered for the model:
    that param alone is loaded by transformers' ZeRO-3 code (one gather of one param), the rest shard-on-read."""
    from transformers import conversion_mapping

    stored = "model.layers.0.self_attn.o_proj_t.weight"

    def transpose(tensors):
        tensors[stored] = tensors.pop("model.layers.0.self_attn.o_proj.weight").t().contiguous()

    directory = hf_models.edit_checkpoint(checkpoints["llama", "single"], tmp_path / "transposed", transpose)
    conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds transformers' registry
    monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, "LlamaForCausalLM", [
        WeightConverter(source_patterns="self_attn.o_proj_t.weight", target_patterns="self_attn.o_proj.weight",
                        operations=[Transpose(0, 1)])])
    assert torch.equal(bits(plain(directory)["model.layers.0.self_attn.o_proj.weight"]),
                       bits(references["llama"]["model.layers.0.self_attn.o_proj.weight"]))
    with fake_world(3, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        model, info, seen, reports = load(directory, "triton")
    check_partitions(model, references["llama"], 3, 0)
    assert info["missing_keys"] == set() and seen.gathered == [1]
    assert "model.layers.0.self_attn.o_proj.weight" not in reports[0].loaded and len(reports[0].loaded) == 28
    assert any("o_proj.weight" in r.getMessage() and "Transpose" in r.getMessage() for r in caplog.records)


class _ConcatenateOne(Concatenate):
    """``Concatenate`` of one tensor (an identity) under another type: transformers runs it, ztriton maps only the
    exact types."""


def test_an_unmapped_conversion_of_a_buffer_is_read_on_every_rank(checkpoints, tmp_path, fake_world, references,
                                                                  monkeypatch):
    """DeepSeek-V3's router bias (a persistent fp32 buffer) stored under another name with an unmapped conversion:
    transformers' own path loads it, and every rank reads its checkpoint tensor (transformers 5.17 copies it on every
    rank, 5.24 broadcasts rank 0's), so that no rank hands transformers a meta tensor to copy."""
    from transformers import conversion_mapping

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"

    def rename(tensors):
        tensors[bias + "_stored"] = tensors.pop(bias)

    directory = hf_models.edit_checkpoint(checkpoints["deepseek_v3", "single"], tmp_path / "bias", rename)
    mapping = conversion_mapping.get_checkpoint_conversion_mapping("deepseek_v3")  # a copy, with the expert fusions
    monkeypatch.setitem(conversion_mapping._checkpoint_conversion_mapping_cache, "DeepseekV3ForCausalLM", mapping + [
        WeightConverter(source_patterns="mlp.gate.e_score_correction_bias_stored",
                        target_patterns="mlp.gate.e_score_correction_bias", operations=[_ConcatenateOne(0)])])
    for rank in (0, 5):
        with fake_world(8, rank):
            model, info, seen, reports = load(directory, "triton")
        assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), (rank, info)
        assert not seen.gathered and set(seen.calls) <= {"broadcast"}, (rank, seen.gathered, seen.calls)
        assert bias not in reports[0].loaded and len(reports[0].loaded) == len(references["deepseek_v3"]) - 1
        # 5.24 broadcasts rank 0's value to the other ranks, which a fake world does not move: there the value of a
        # rank but 0 is not the loader's to check
        broadcast = rank != 0 and "broadcast" in seen.calls
        check_partitions(model, references["deepseek_v3"], 8, rank, skip=frozenset({bias} if broadcast else ()))


def test_tied_embeddings_are_loaded_once_and_tied(tmp_path, fake_world):
    directory = hf_models.save_checkpoint("llama", tmp_path / "tied", tie_word_embeddings=True)
    want = plain(directory)
    with fake_world(3, 2):
        model, info, seen, reports = load(directory, "triton")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert info["missing_keys"] == set() and not seen.gathered and not seen.calls
    check_partitions(model, want, 3, 2)
    assert "lm_head.weight" not in reports[0].loaded


def test_key_off_is_transformers_own_code(checkpoints, fake_world):
    with fake_world(1, 0):
        _, info, seen, reports = load(checkpoints["qwen2_moe", "sharded"], "torch")
    assert reports == [] and seen.gathered and info["missing_keys"] == set()


_AUTO_INSTALL_PROBE = """
{first}
from transformers.modeling_utils import PreTrainedModel
from ztriton.integrations import transformers as hf_integration
names = ("_load_pretrained_model", "_initialize_missing_keys")
def ours():
    functions = [PreTrainedModel.__dict__[n] for n in names]
    functions = [getattr(f, "__func__", f) for f in functions]
    return [f.__code__.co_filename.endswith("ztriton/integrations/hooks.py") for f in functions]
print("probe:", hf_integration.installed(), ours(), hf_integration.install(), ours())
hf_integration.uninstall()
print("probe:", hf_integration.installed(), ours())
"""


@pytest.mark.parametrize("first", ["import ztriton", "import transformers.modeling_utils; import ztriton"])
def test_import_ztriton_installs_the_hooks_whichever_is_imported_first(first):
    """``import ztriton`` puts the hooks in as soon as transformers' modeling_utils is (or was) imported, without an
    explicit install(); install() then changes nothing and uninstall() puts transformers' own methods back."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ZTRITON_AUTOLOAD": "0"}  # the start-up hook would import ztriton before `first` does
    done = subprocess.run([sys.executable, "-c", _AUTO_INSTALL_PROBE.format(first=first)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("probe:")]
    assert lines == ["probe: True [True, True] True [True, True]", "probe: False [False, False]"], \
        done.stdout + done.stderr


@pytest.fixture
def uninstalled(monkeypatch):
    """The hooks out for the test, with a fresh record of where ztriton stands aside and of the lines said; put
    back afterwards (the monkeypatches undone first)."""
    from ztriton.integrations import standaside
    from ztriton.integrations.deepspeed import report

    hf_integration.uninstall()
    monkeypatch.setattr(standaside, "REASONS", {})
    monkeypatch.setattr(report, "_said", set())
    originals = {n: PreTrainedModel.__dict__[n] for n in ("_load_pretrained_model", "_initialize_missing_keys")}
    yield originals
    monkeypatch.undo()
    assert hf_integration.install(), hf_integration.unsupported_reason()


def _stand_aside_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ztriton" and r.levelno >= logging.WARNING and "no effect on transformers" in r.getMessage()]


def test_unknown_internals_stand_aside_silently_and_say_so_once_where_a_config_has_the_key(uninstalled, monkeypatch,
                                                                                            caplog, fake_world):
    """A transformers whose rename_source_key is not the one known: install() replaces nothing and says nothing
    (it runs at import); a DeepSpeed config with the key says it once, on rank 0 only; one without says nothing."""
    import transformers
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import core_model_loading

    from ztriton.integrations import standaside

    monkeypatch.setattr(core_model_loading, "rename_source_key", lambda source_key, renamings: (source_key, None))
    with caplog.at_level(logging.INFO):
        assert hf_integration.install() is False
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    assert not hf_integration.installed()
    assert {n: PreTrainedModel.__dict__[n] for n in uninstalled} == uninstalled
    assert "rename_source_key" in standaside.REASONS["transformers"]
    with caplog.at_level(logging.INFO, logger="ztriton"):
        with fake_world(2, 1):
            DeepSpeedConfig(ds_config("triton"))
        assert _stand_aside_lines(caplog) == []  # rank 1
        with fake_world(2, 0):
            DeepSpeedConfig(ds_config("torch"))
            assert _stand_aside_lines(caplog) == []
            DeepSpeedConfig(ds_config("triton"))
            DeepSpeedConfig(ds_config("triton"))
    lines = _stand_aside_lines(caplog)
    assert len(lines) == 1 and "rename_source_key" in lines[0] and f"transformers {transformers.__version__}" in \
        lines[0], lines


def test_install_is_all_or_none(uninstalled, monkeypatch):
    """A wrap that fails after another went in: install() puts the first back, replaces nothing, stands aside."""
    from ztriton.integrations import standaside

    wrap = hf_integration.wrap

    def failing_second(owner, name, wrapper, originals):
        if name == "_initialize_missing_keys":
            raise RuntimeError("cannot wrap _initialize_missing_keys")
        wrap(owner, name, wrapper, originals)

    monkeypatch.setattr(hf_integration, "wrap", failing_second)
    assert hf_integration.install() is False
    assert not hf_integration.installed()
    assert {n: PreTrainedModel.__dict__[n] for n in uninstalled} == uninstalled
    assert "cannot wrap _initialize_missing_keys" in standaside.REASONS["transformers"]
    monkeypatch.setattr(hf_integration, "wrap", wrap)
    assert hf_integration.install() and "transformers" not in standaside.REASONS


def _unchanged_key(source_key, weight_renamings, weight_converters, base_model_prefix, meta_state_dict,
                   reverse=False):
    return source_key, None


def _concatenate_backwards(self, input_dict, source_patterns, target_patterns, **kwargs):
    parts = [input_dict.pop(p) for p in reversed(source_patterns) if p in input_dict]
    return {target_patterns[0]: torch.cat(parts, dim=self.dim)}


def _normal_ignoring_the_flag(tensor, mean=0.0, std=1.0, generator=None):
    return tensor.normal_(mean, std, generator=generator)


# (module, attribute, replacement, what the reason names): behaviours the patch relies on, each changed alone.
CHANGED_BEHAVIOURS = [
    ("transformers.core_model_loading", "rename_source_key", _unchanged_key, "renames a per-expert key otherwise"),
    ("transformers.core_model_loading", "dot_natural_key", str, "dot_natural_key"),
    ("transformers.core_model_loading:Concatenate", "convert", _concatenate_backwards, "MergeModulelist(0) then"),
    ("transformers.initialization", "normal_", _normal_ignoring_the_flag, "does not skip a flagged tensor"),
]


@pytest.mark.parametrize("owner, name, replacement, named", CHANGED_BEHAVIOURS,
                         ids=[f"{o.rsplit('.', 1)[-1]}.{n}" for o, n, _, _ in CHANGED_BEHAVIOURS])
def test_a_changed_behaviour_is_unknown(owner, name, replacement, named, monkeypatch):
    """The behaviour checks run transformers' own code on tiny inputs: a transformers whose key matching, conversion
    ops or init flag act otherwise than the ones read is not patched, and the reason says which."""
    import importlib

    from ztriton.integrations.transformers import internals

    module, _, attribute = owner.partition(":")
    target = importlib.import_module(module)
    monkeypatch.setattr(getattr(target, attribute) if attribute else target, name, replacement)
    found = internals.detect()
    assert isinstance(found, str) and named in found, found


class _CustomLlama(LlamaForCausalLM):
    """A model class outside transformers (custom code in 5.24's and 5.25's sense, not in 5.12.1's)."""


def test_the_custom_code_flag_is_the_one_initialize_weights_hands_on(monkeypatch):
    """The adapter picked for the installed transformers gives the flag its own initialize_weights passes to
    _initialize_weights, for a model class defined outside transformers and one inside."""
    from ztriton.integrations.transformers import internals

    found = internals.detect()
    assert not isinstance(found, str), found
    for model_class in (_CustomLlama, LlamaForCausalLM):
        model = model_class(hf_models.config("llama"))
        passed = []
        monkeypatch.setattr(model_class, "_initialize_weights",
                            lambda self, module, flag=False: passed.append(flag), raising=False)
        model.initialize_weights()
        monkeypatch.undo()
        assert passed and set(passed) == {found.custom_code(model)}, (model_class, passed)


def test_the_adapters_follow_what_transformers_has(monkeypatch):
    """is_custom_code with its parameter name picks model.is_custom_code; without both, is_remote_code; a mix is
    unknown. A LoadStateDictInfo field outside the ones known is unknown too."""
    import dataclasses

    from transformers.utils import loading_report

    from ztriton.integrations.transformers import internals

    def initialize(name):
        namespace: dict = {}
        exec(f"def _initialize_weights(self, module, {name}=False): pass", namespace)
        return namespace["_initialize_weights"]

    has_custom = "is_custom_code" in vars(PreTrainedModel)
    cases = [("is_custom_code", True, internals._is_custom_code), ("is_remote_code", False, internals._is_remote_code),
             ("is_remote_code", True, None), ("is_custom_code", False, None)]
    for parameter, custom, want in cases:
        monkeypatch.setattr(PreTrainedModel, "_initialize_weights", initialize(parameter))
        if custom and not has_custom:
            monkeypatch.setattr(PreTrainedModel, "is_custom_code", classmethod(lambda cls: False), raising=False)
        elif not custom and has_custom:
            monkeypatch.delattr(PreTrainedModel, "is_custom_code")
        found = internals.detect()
        if want is None:
            assert isinstance(found, str) and "_initialize_weights" in found, (parameter, custom, found)
        else:
            assert not isinstance(found, str) and found.custom_code is want, (parameter, custom, found)
        monkeypatch.undo()

    info = internals.detect()
    fields = {f.name for f in dataclasses.fields(loading_report.LoadStateDictInfo)}
    assert set(info.report_extras) == fields - internals.REPORT_FIELDS
    made = info.loading_info(missing_keys={"a"}, unexpected_keys=set(), mismatched_keys=set(), error_msgs=[],
                             conversion_errors={})
    assert isinstance(made, loading_report.LoadStateDictInfo) and made.missing_and_mismatched() == {"a"}
    extended = dataclasses.make_dataclass("LoadStateDictInfo", [("pipeline_owner", dict, dataclasses.field(
        default_factory=dict))], bases=(loading_report.LoadStateDictInfo,))
    monkeypatch.setattr(loading_report, "LoadStateDictInfo", extended)
    found = internals.detect()
    assert isinstance(found, str) and "pipeline_owner" in found, found


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_mixtral_on_the_gpu_key_on_equals_key_off(tmp_path, fake_world):
    """On a CUDA device (DeepSpeed's CUDA accelerator; the coordinator runs this on the H200, transformers 5.17):
    Mixtral-tiny from per-expert files, key on vs key off in a world of one and rank 0 of 8, and key on against
    plain from_pretrained on rank 7 of 8."""
    directory = hf_models.save_checkpoint("mixtral", tmp_path / "mixtral", max_shard_size="20KB")
    want = plain(directory)
    for world_size in (1, 8):
        models = {}
        for backend in ("torch", "triton"):
            with fake_world(world_size, 0):
                models[backend], _, seen, reports = load(directory, backend)
            assert (not seen.gathered and len(reports) == 1) if backend == "triton" else seen.gathered
        assert next(models["triton"].parameters()).ds_tensor.device.type == "cuda"
        same_partitions(models["torch"], models["triton"], world_size, 0)
        check_partitions(models["triton"], {k: v.cuda() for k, v in want.items()}, world_size, 0)
    with fake_world(8, 7):
        model, _, seen, _ = load(directory, "triton")
    check_partitions(model, {k: v.cuda() for k, v in want.items()}, 8, 7)
    assert not seen.gathered and not seen.calls


# ---------------------------------------------------------------------------------------------- a real world


def _from_pretrained_on_gloo_rank(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    """One rank of a gloo world: each checkpoint loaded with the key off and on (module level: it is pickled).

    Returns, per (model, backend): every param's whole partition (padding included) and persistent buffer, copied
    to the host, what transformers reported, the number of ztriton load reports and the GatheredParameters seen."""
    assert hf_integration.install(), hf_integration.unsupported_reason()
    out = {}
    for name, path in paths.items():
        for backend in ("torch", "triton"):
            model, info, seen, reports = load(Path(path), backend)
            persistent = set(model.state_dict())
            out[name, backend] = {
                "partitions": {n: p.ds_tensor.detach().cpu().clone() for n, p in model.named_parameters()},
                "numels": {n: p.ds_numel for n, p in model.named_parameters()},
                "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n in persistent},
                "info": {k: sorted(map(str, v)) for k, v in info.items()},
                "reports": len(reports), "gathered": list(seen.gathered)}
            del model
    return out


# (world size, models): uneven splits (the last rank's partitions padded) of a fused-expert Mixtral and a Llama.
GLOO_WORLDS = [(2, ("mixtral", "llama")), (3, ("mixtral", "llama"))]


@pytest.fixture(scope="module")
def odd_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """name -> (checkpoint directory, plain from_pretrained's tensors) of Mixtral and Llama with an odd hidden size."""
    out = {}
    for name, overrides in hf_models.ODD_HIDDEN.items():
        directory = hf_models.save_checkpoint(name, tmp_path_factory.mktemp(f"odd-{name}"), **overrides)
        out[name] = directory, plain(directory)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size, names", GLOO_WORLDS, ids=[f"W{w}-{'-'.join(n)}" for w, n in GLOO_WORLDS])
def test_key_on_on_every_rank_of_a_gloo_world_is_the_slice_and_key_off(world_size, names, odd_checkpoints,
                                                                       gloo_world):
    """Issue 13 on real collectives: on every rank, key on's partition is bit for bit the rank's slice of plain
    from_pretrained (padding zero) and key off's partition (transformers' own path, whose values travel by
    broadcast from rank 0, so it is defined on every rank here), with no GatheredParameters."""
    paths = {name: str(odd_checkpoints[name][0]) for name in names}
    results = gloo_world(_from_pretrained_on_gloo_rank, world_size, paths, timeout=240.0)
    padded = 0
    for rank, result in enumerate(results):
        for name in names:
            off, on = result[name, "torch"], result[name, "triton"]
            where = f"{name} rank {rank} of {world_size}"
            want = odd_checkpoints[name][1]
            assert on["reports"] == 1 and on["gathered"] == [], (where, on["reports"], on["gathered"])
            assert off["reports"] == 0 and off["gathered"], (where, off["gathered"])  # transformers' path ran
            assert on["info"] == off["info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [],
                                                 "error_msgs": []}, where
            assert sorted(on["partitions"]) == sorted(off["partitions"]) == sorted(
                n for n in want if n in on["numels"])
            for param, partition in on["partitions"].items():
                numel = on["numels"][param]
                assert numel == want[param].numel() == off["numels"][param], (where, param)
                size = math.ceil(numel / world_size)
                start = rank * size
                count = max(0, min(start + size, numel) - start)
                assert partition.numel() == off["partitions"][param].numel() == size, (where, param)
                expected = bits(want[param].to(partition.dtype)).reshape(-1)[start:start + count]
                assert torch.equal(bits(partition)[:count], expected), f"{where}: {param} is not the rank's slice"
                assert torch.equal(bits(off["partitions"][param])[:count], expected), \
                    f"{where}: {param}: key off (DeepSpeed's own gathers) is not the rank's slice"
                assert torch.equal(bits(partition)[:count], bits(off["partitions"][param])[:count]), \
                    f"{where}: {param} differs from key off"
                assert not bits(partition)[count:].any(), f"{where}: {param}'s padding is not zero"
                padded += rank == world_size - 1 and count < size
            for buffer, value in on["buffers"].items():
                assert torch.equal(bits(value), bits(want[buffer].to(value.dtype))), (where, buffer)
                assert torch.equal(bits(value), bits(off["buffers"][buffer])), (where, buffer)
    assert padded >= 4 * len(names), "odd-sized params (padded partitions on the last rank) were meant to be covered"
