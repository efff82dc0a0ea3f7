"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block (q/k/v biases), the MLP a mixture of
experts plus a shared expert that every row takes, its output times sigmoid(shared_gate . x)
(transformers' Qwen2MoeSparseMoeBlock, llama.cpp's qwen2moe). llama.cpp does not renormalize
the top-k weights (build_moe_ffn norm_w false); the HF config says (norm_topk_prob)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.arch.args import ModelArgs
from model.arch.family import Family, GGUFMeta, hf_moe


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    """llama.cpp's qwen2moe defaults where a (Qwen1.5-MoE) file lacks the sizes: experts
    feed_forward_length / expert_used_count wide, the shared one feed_forward_length."""
    moe = args.moe
    assert moe is not None
    expert = int(meta.get("expert_feed_forward_length", 0)) or args.hidden_dim // moe.n_used
    shared = int(meta.get("expert_shared_feed_forward_length", 0)) or args.hidden_dim
    args.moe = replace(moe, expert_dim=expert, shared_dim=shared, shared_gate=True)


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """Qwen2MoeConfig: experts moe_intermediate_size wide, the shared one
    shared_expert_intermediate_size (dense layers: intermediate_size)."""
    hf_moe(args, config, expert_dim_key="moe_intermediate_size")
    assert args.moe is not None
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    args.moe = replace(args.moe, shared_dim=shared, shared_gate=shared > 0)


FAMILY = Family(
    arch="qwen2moe",
    model_types=("qwen2_moe",),
    qkv_bias=True,
    moe_norm_topk=False,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
