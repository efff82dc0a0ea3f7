"""Qwen3-MoE: Qwen3's block, the MLP a mixture of experts (model/layers/moe.py); llama.cpp's
qwen3moe normalizes the top-k weights (build_moe_ffn norm_w) and makes every layer sparse."""

from __future__ import annotations

from typing import Any

from model.arch import qwen3
from model.arch.args import ModelArgs
from model.arch.family import Family, hf_moe


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """Qwen3MoeConfig: each expert moe_intermediate_size wide (intermediate_size is the dense
    layers' width)."""
    hf_moe(args, config, expert_dim_key="moe_intermediate_size")


FAMILY = Family(
    arch="qwen3moe",
    model_types=("qwen3_moe",),
    block=qwen3.BLOCK,
    moe_norm_topk=True,
    from_hf=from_hf,
)
