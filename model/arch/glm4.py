"""GLM-4 (0414): Llama's pre-norms and Gemma's post norms (plain w), q/k/v biases (the config's
attention_bias), RoPE on the first half of each head in interleaved pairs (GLM's rotate_half
pairs x[2i], x[2i + 1]; llama.cpp's converter does not permute them), gate|up fused in the files
(llama.cpp's ffn_up, HF's mlp.gate_up_proj)."""

from __future__ import annotations

from model.arch.args import BlockSpec
from model.arch.family import Family

BLOCK = BlockSpec(post_norms=True)
FAMILY = Family(
    arch="glm4",
    model_types=("glm4",),
    block=BLOCK,
    rope_layout="interleaved",
    gguf_fused=frozenset(("w1", "w3")),
    # post_attention_layernorm is the pre-MLP norm (Llama's meaning), then two post norms
    hf_names={
        "post_attn_norm": "post_self_attn_layernorm.weight",
        "post_ffn_norm": "post_mlp_layernorm.weight",
    },
    hf_fused=("mlp.gate_up_proj",),
)
