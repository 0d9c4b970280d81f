"""Tiny transformers models and their checkpoints for the from_pretrained tests (CPU-sized, odd sizes).

Each config makes a 2-layer model with hidden size 32 whose tensors do not divide evenly by 3 or 8 (so the last
rank's partition has padding and partitions start mid-row); the MoE ones have 4 experts stored per expert by
``save_pretrained`` (transformers 5 fuses them at load: Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3``,
Qwen2-MoE's and DeepSeek-V3's ``mlp.experts.E.gate_proj/up_proj/down_proj``).

:func:`save_checkpoint` gives every parameter and persistent buffer fresh random values (norm weights and
DeepSeek's router bias included, which would otherwise be constants), so a misplaced slice shows in the bits.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

DTYPE = torch.bfloat16

LLAMA = dict(vocab_size=67, hidden_size=32, head_dim=8, intermediate_size=22, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False,
             attention_bias=True)
MIXTRAL = dict(vocab_size=61, hidden_size=32, head_dim=8, intermediate_size=13, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=16, tie_word_embeddings=False)
QWEN2_MOE = dict(vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=11,
                 shared_expert_intermediate_size=14, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, decoder_sparse_step=1,
                 mlp_only_layers=[], tie_word_embeddings=False)
# first_k_dense_replace=1: layer 0 is a dense MLP, layer 1 routed experts (+ one shared expert) with MLA attention.
DEEPSEEK_V3 = dict(vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=11, n_routed_experts=4,
                   n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
                   kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                   max_position_embeddings=16, tie_word_embeddings=False)


def _configs() -> dict[str, tuple[Callable, dict[str, Any]]]:
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    return {"llama": (LlamaConfig, LLAMA), "mixtral": (MixtralConfig, MIXTRAL),
            "qwen2_moe": (Qwen2MoeConfig, QWEN2_MOE), "deepseek_v3": (DeepseekV3Config, DEEPSEEK_V3)}


# A hidden size prime to 2 and 3 makes most numels so, and a split by 2 or 3 then pads the last rank's partitions
# (hidden 32 makes every tensor's numel even). Llama needs the heads to divide it; the forward of such a Mixtral fails
# in grouped_mm on strides that are not 16-byte multiples, so these are for loading only.
ODD_HIDDEN = {"mixtral": dict(hidden_size=35),
              "llama": dict(hidden_size=35, num_attention_heads=5, num_key_value_heads=1)}

MODELS = ("llama", "mixtral", "qwen2_moe", "deepseek_v3")
MOE_MODELS = ("mixtral", "qwen2_moe", "deepseek_v3")


def config(name: str, **overrides):
    config_class, kwargs = _configs()[name]
    return config_class(**{**kwargs, **overrides})


def save_checkpoint(name: str, directory: Path, max_shard_size: str | None = None, seed: int = 99,
                    **overrides) -> Path:
    """Save a tiny ``name`` model (bf16, random values everywhere) with ``save_pretrained``; return ``directory``.

    ``max_shard_size`` (e.g. ``"20KB"``) makes a sharded checkpoint with its index, as the hub has them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config(name, **overrides), dtype=DTYPE)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in list(model.parameters()) + [b for _, b in _persistent_buffers(model)]:
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def _persistent_buffers(model: torch.nn.Module):
    persistent = set(model.state_dict())
    return [(n, b) for n, b in model.named_buffers() if n in persistent]


def safetensors_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def edit_checkpoint(source: Path, destination: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy the checkpoint in ``source`` to ``destination`` as one file (config included) after ``edit`` changed
    its tensors in place (drop one, reshape one, add one)."""
    tensors: dict[str, torch.Tensor] = {}
    metadata = None
    for path in safetensors_files(source):
        tensors.update(load_file(path))
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
    edit(tensors)
    destination.mkdir(parents=True, exist_ok=True)
    save_file(tensors, destination / "model.safetensors", metadata=metadata)
    for extra in ("config.json", "generation_config.json"):
        if (source / extra).exists():
            (destination / extra).write_text((source / extra).read_text())
    return destination


def is_sharded(directory: Path) -> bool:
    index = directory / "model.safetensors.index.json"
    return index.exists() and len(set(json.loads(index.read_text())["weight_map"].values())) > 1
