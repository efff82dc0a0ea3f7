"""Granite and Granite-MoE: Llama's block with Granite's multipliers (x = embed * embedding_mult;
h = x + residual_mult * sublayer(..); logits = output(h) / logits_scaling; the softmax scale
attention_multiplier); Granite-MoE's MLP a mixture of experts (softmax over the top-k logits)."""

from __future__ import annotations

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


def moe_from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """Granite-MoE: a softmax over the top-k logits, the same as renormalizing the top-k of all."""
    hf_moe(args, config, norm_topk=True)
    from_hf(args, config)


FAMILY = Family(
    arch="granite",
    model_types=("granite",),
    gguf_permuted_qk=True,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
MOE_FAMILY = Family(
    arch="granitemoe",
    model_types=("granitemoe",),
    moe_norm_topk=True,
    gguf_permuted_qk=True,
    hf_names={"moe_router": "block_sparse_moe.router.layer.weight"},
    hf_experts="granite",
    from_gguf=from_gguf,
    from_hf=moe_from_hf,
)
