"""Granite and Granite-MoE: Llama's block with Granite's multipliers (x = embed * embedding_mult;
h = x + residual_mult * sublayer(..); logits = output(h) / logits_scaling; the softmax scale
attention_multiplier); Granite-MoE's MLP a mixture of experts (softmax over the top-k logits);
GraniteMoeShared's adds a shared expert (shared_mlp, ungated) that every row takes: llama.cpp's
converter writes it as `granitemoe` with expert_shared_feed_forward_length and ffn_*_shexp."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.arch.args import ModelArgs
from model.arch.family import Family, GGUFMeta, hf_moe


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    """llama.cpp's granite keys: 0 (absent) means not scaled."""
    args.attn_scale = float(meta.get("attention.scale", 0.0)) or None
    args.embed_mult = float(meta.get("embedding_scale", 0.0)) or 1.0
    args.residual_mult = float(meta.get("residual_scale", 0.0)) or 1.0
    args.logits_scaling = float(meta.get("logit_scale", 0.0)) or 1.0


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """GraniteConfig's multipliers: the softmax scale is attention_multiplier, not
    head_dim ** -0.5."""
    args.attn_scale = float(config.get("attention_multiplier", 1.0))
    args.embed_mult = float(config.get("embedding_multiplier", 1.0))
    args.residual_mult = float(config.get("residual_multiplier", 1.0))
    args.logits_scaling = float(config.get("logits_scaling", 1.0))


def moe_from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    from_gguf(args, meta)
    assert args.moe is not None
    shared = int(meta.get("expert_shared_feed_forward_length", 0))
    args.moe = replace(args.moe, shared_dim=shared)


def moe_from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """Granite-MoE: a softmax over the top-k logits, the same as renormalizing the top-k of all;
    GraniteMoeShared: a shared expert shared_intermediate_size wide (0: none)."""
    hf_moe(args, config, norm_topk=True)
    from_hf(args, config)
    assert args.moe is not None
    args.moe = replace(args.moe, shared_dim=int(config.get("shared_intermediate_size") or 0))


FAMILY = Family(
    arch="granite",
    model_types=("granite",),
    gguf_permuted_qk=True,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
MOE_FAMILY = Family(
    arch="granitemoe",
    model_types=("granitemoe", "granitemoeshared"),
    moe_norm_topk=True,
    gguf_permuted_qk=True,
    hf_names={
        "moe_router": "block_sparse_moe.router.layer.weight",
        "w2_shexp": "shared_mlp.output_linear.weight",
    },
    hf_fused=("shared_mlp.input_linear",),  # GraniteMoeShared's shared expert: gate | up
    hf_experts="granite",
    from_gguf=moe_from_gguf,
    from_hf=moe_from_hf,
)
