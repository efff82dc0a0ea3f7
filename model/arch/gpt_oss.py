"""gpt-oss (llama.cpp's openai-moe, transformers' GptOss): Llama's block with biases on q/k/v/o,
attention sinks, every other layer sliding by 128 tokens, YaRN; the MLP a mixture of experts with
biases on the router and the experts and a clamped SwiGLU (MoEArgs.swiglu_limit, swiglu_alpha)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.arch.args import BlockSpec, ModelArgs, MoEArgs, periodic_windows
from model.arch.family import Family, GGUFMeta, hf_layer_windows

BLOCK = BlockSpec(activation="swiglu_oai")
SWA_PERIOD = 2  # as Gemma 2: llama.cpp's openai-moe set_swa_pattern(2), HF layer_types


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    """Layers 0, 2, ... slide; the SwiGLU's alpha and limit are llama.cpp's constants
    (MoEArgs' defaults), not in the file."""
    window = int(meta.get("attention.sliding_window"))
    args.windows = periodic_windows(args.n_layers, window, SWA_PERIOD)
    args.qkv_bias = args.out_bias = args.attn_sinks = True
    assert args.moe is not None
    args.moe = replace(args.moe, bias=True)


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """GptOssConfig: layer_types slide by sliding_window (default: the even layers), biases
    on q/k/v/o (attention_bias), the router and the experts."""
    if config.get("quantization_config"):
        kind = config["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"quantization_config {kind!r}: a quantized gpt-oss folder is not read (its GGUF is)"
        )
    args.windows = hf_layer_windows(
        config, args.n_layers, int(config["sliding_window"]), SWA_PERIOD
    )
    args.attn_sinks = True
    args.out_bias = args.qkv_bias
    args.moe = MoEArgs(
        n_experts=int(config["num_local_experts"]),
        n_used=int(config["num_experts_per_tok"]),
        expert_dim=int(config["intermediate_size"]),
        norm_topk_prob=True,  # softmax over the top-k logits
        bias=True,
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )


FAMILY = Family(
    arch="gpt-oss",
    model_types=("gpt_oss",),
    block=BLOCK,
    sliding=True,
    moe_norm_topk=True,
    # the pre-MLP norm is llama.cpp's attn_post_norm (HF's post_attention_layernorm, Llama's
    # meaning)
    gguf_names={"ffn_norm": "post_attention_norm.weight"},
    hf_names={
        "moe_router": "mlp.router.weight",
        "moe_router_b": "mlp.router.bias",
        "sinks": "self_attn.sinks",
    },
    hf_experts="gpt_oss",
    from_gguf=from_gguf,
    from_hf=from_hf,
)
