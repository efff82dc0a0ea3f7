"""Llama (and Mistral's HF configs; llama.cpp converts both to `llama`): the default block.
Mixtral is Llama's block with a mixture of experts in every layer (llama.cpp's `llama` arch with
expert_count, its experts' top-k weights renormalized: build_moe_ffn's norm_w)."""

from __future__ import annotations

from typing import Any

from model.arch.args import LLAMA, ModelArgs
from model.arch.family import Family, hf_moe


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """MixtralConfig: num_local_experts experts intermediate_size wide, the top-k softmax
    weights renormalized (MixtralSparseMoeBlock)."""
    if config.get("num_local_experts"):
        hf_moe(args, config, norm_topk=True)


FAMILY = Family(
    arch="llama",
    model_types=("llama", "mistral", "mixtral"),
    block=LLAMA,
    gguf_permuted_qk=True,
    moe_norm_topk=True,
    moe_optional=True,
    hf_names={"moe_router": "block_sparse_moe.gate.weight"},
    hf_experts="mixtral",
    from_hf=from_hf,
)
