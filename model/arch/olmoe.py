"""OLMoE: q and k RMSNorms over the whole projection (n_heads * head_dim), not one head; the MLP a
mixture of experts whose top-k weights llama.cpp's olmoe does not normalize."""

from __future__ import annotations

from model.arch.args import BlockSpec
from model.arch.family import Family, hf_moe

BLOCK = BlockSpec(qk_norm=True, qk_norm_full=True)
FAMILY = Family(
    arch="olmoe", model_types=("olmoe",), block=BLOCK, moe_norm_topk=False, from_hf=hf_moe
)
