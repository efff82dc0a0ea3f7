"""Qwen3-MoE: Qwen3's block, the MLP a mixture of experts (model/layers/moe.py); llama.cpp's
qwen3moe normalizes the top-k weights (build_moe_ffn norm_w) and makes every layer sparse."""

from __future__ import annotations

from model.arch import qwen3
from model.arch.family import Family, hf_moe

FAMILY = Family(
    arch="qwen3moe",
    model_types=("qwen3_moe",),
    block=qwen3.BLOCK,
    moe_norm_topk=True,
    from_hf=hf_moe,
)
