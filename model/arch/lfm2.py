"""LFM2: most layers a gated short convolution (model/layers/shortconv.py: two linears around a
depthwise conv whose last L - 1 inputs are the sequence's state), the others attention with
Qwen3's q/k norms per head; every layer a SwiGLU MLP.

GGUF (llama.cpp's "lfm2", LFM2Model): attention.head_count_kv 0 marks a short-conv layer,
shortconv.l_cache its kernel length, shortconv.conv.weight [dim, L]; the final norm is
token_embd_norm (model/load/gguf.py). HF (Lfm2Config): layer_types "conv" / "full_attention" (or
full_attn_idxs), the MLP width as Lfm2MLP adjusts it, embeddings tied unless it says otherwise.

LFM2-MoE (LFM2-8B-A1B; llama.cpp's "lfm2moe", HF "lfm2_moe"): the same layers, the first
leading_dense_block_count / num_dense_layers with a dense MLP (intermediate_size, not adjusted),
the others a mixture of experts with sigmoid gating: chosen on sigmoid(router x) + expert_bias
(exp_probs_b), weighted by the sigmoid scores renormalized, times routed_scaling_factor
(model.arch.MoEArgs). HF stores each expert's w1 / w3 / w2 (feed_forward.experts.{e}.w1).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch

from kvcache.rope import RopeConfig
from model.arch import qwen3
from model.arch.args import Mixer, ModelArgs, MoEArgs
from model.arch.family import Family, GGUFMeta, check_hf_silu, gguf_per_layer, gguf_uniform
from model.arch.weights import layer_weights

GGUF_NAMES = {
    "shortconv_in": "shortconv.in_proj.weight",
    "shortconv_conv": "shortconv.conv.weight",
    "shortconv_out": "shortconv.out_proj.weight",
}
_HF_NAMES = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.out_proj.weight",
    "q_norm": "self_attn.q_layernorm.weight",
    "k_norm": "self_attn.k_layernorm.weight",
    "attn_norm": "operator_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "w1": "feed_forward.w1.weight",
    "w3": "feed_forward.w3.weight",
    "w2": "feed_forward.w2.weight",
    "shortconv_in": "conv.in_proj.weight",
    "shortconv_conv": "conv.conv.weight",
    "shortconv_out": "conv.out_proj.weight",
    "moe_router": "feed_forward.gate.weight",
    "moe_sel_b": "feed_forward.expert_bias",
    "w1_exps": "feed_forward.experts.{}.w1.weight",  # one per expert: stacked (model/load/hf.py)
    "w3_exps": "feed_forward.experts.{}.w3.weight",
    "w2_exps": "feed_forward.experts.{}.w2.weight",
}
_LAYER_KINDS: dict[str, Mixer] = {"conv": "shortconv", "full_attention": "attn"}


def gguf_args(meta: GGUFMeta, vocab_size: int, arch: str = "lfm2") -> ModelArgs:
    n_layers = int(meta.get("block_count"))
    dim = int(meta.get("embedding_length"))
    kv = gguf_per_layer(meta, "attention.head_count_kv", n_layers)
    mixers: list[Mixer] = ["attn" if k else "shortconv" for k in kv]
    heads = gguf_per_layer(meta, "attention.head_count", n_layers)
    attn_heads = [h for h, m in zip(heads, mixers, strict=True) if m == "attn"]
    n_heads = gguf_uniform(meta, attn_heads, "attention.head_count")
    head_dim = int(meta.get("attention.key_length", dim // n_heads if n_heads else 0))
    ff = gguf_per_layer(meta, "feed_forward_length", n_layers)
    args = ModelArgs(
        arch=arch,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=gguf_uniform(meta, kv, "attention.head_count_kv"),
        head_dim=head_dim,
        hidden_dim=gguf_uniform(meta, ff, "feed_forward_length"),
        norm_eps=float(meta.get("attention.layer_norm_rms_epsilon")),
        rope=RopeConfig(
            theta=float(meta.get("rope.freq_base", 10000.0)),
            dim=int(meta.get("rope.dimension_count", head_dim)),
            layout="neox",  # llama.cpp's LLM_ARCH_LFM2 is LLAMA_ROPE_TYPE_NEOX: not permuted
        ),
        n_ctx_train=int(meta.get("context_length", 2048)),
        block=qwen3.BLOCK,
        mixers=tuple(mixers),
        short_conv=int(meta.get("shortconv.l_cache")),
    )
    if args.arch == "lfm2moe":  # llama.cpp's LLM_ARCH_LFM2MOE
        gating = int(meta.get("expert_gating_func", 2))
        if gating != 2:  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise ValueError(f"expert_gating_func {gating} (LFM2-MoE's is 2, sigmoid)")
        args.moe = MoEArgs(
            n_experts=int(meta.get("expert_count")),
            n_used=int(meta.get("expert_used_count")),
            expert_dim=int(meta.get("expert_feed_forward_length")),
            # llama.cpp's lfm2moe graph renormalizes and does not scale, whatever the file says
            norm_topk_prob=True,
            gating="sigmoid",
            selection_bias=meta.has(f"blk.{n_layers - 1}.exp_probs_b.bias"),
        )
        dense = int(meta.get("leading_dense_block_count", 0))
        args.moe_layers = tuple(i >= dense for i in range(n_layers))
    return args


def moe_gguf_args(meta: GGUFMeta, vocab_size: int) -> ModelArgs:
    return gguf_args(meta, vocab_size, "lfm2moe")


def hf_args(config: dict[str, Any]) -> ModelArgs:
    check_hf_silu(config)
    if config.get("conv_bias"):
        raise ValueError("conv_bias is not supported (llama.cpp's lfm2 has no conv biases)")
    dim = int(config["hidden_size"])
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        attn = config.get("full_attn_idxs")
        attn = set(range(n)) if attn is None else {int(i) for i in attn}
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    if len(types) != n or not set(types) <= set(_LAYER_KINDS):
        raise ValueError(f"layer_types {types} for {n} layers (conv / full_attention)")
    n_heads = int(config["num_attention_heads"])
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {params['rope_type']!r} is not supported")
    theta = float(config.get("rope_theta", params.get("rope_theta", 1000000.0)))
    moe = config["model_type"] == "lfm2_moe"
    args = ModelArgs(
        arch=str(config["model_type"]),
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=n,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=dim // n_heads,
        hidden_dim=int(config["intermediate_size"]) if moe else _hf_ff_dim(config),
        norm_eps=float(config.get("norm_eps", 1e-5)),
        rope=RopeConfig(theta, dim // n_heads, "neox"),
        n_ctx_train=int(config.get("max_position_embeddings", 0)),
        block=qwen3.BLOCK,
        mixers=tuple(_LAYER_KINDS[t] for t in types),
        short_conv=int(config.get("conv_L_cache", 3)),
    )
    if moe:  # transformers' Lfm2MoeTopKRouter
        args.moe = MoEArgs(
            n_experts=int(config["num_experts"]),
            n_used=int(config["num_experts_per_tok"]),
            expert_dim=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            gating="sigmoid",
            selection_bias=bool(config.get("use_expert_bias", True)),
            weights_scale=float(config.get("routed_scaling_factor", 1.0)),
        )
        dense = int(config.get("num_dense_layers", 2))
        args.moe_layers = tuple(i >= dense for i in range(n))
    return args


def _hf_ff_dim(config: dict[str, Any]) -> int:
    """transformers' Lfm2MLP: block_ff_dim (or intermediate_size), with auto-adjust 2/3 of it,
    then times the multiplier rounded up to block_multiple_of (only where a multiplier is set:
    llama.cpp's converter rounds either way, and writes its width as feed_forward_length)."""
    ff = int(config.get("block_ff_dim") or config["intermediate_size"])
    if config.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        mult = config.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            of = int(config.get("block_multiple_of", 256))
            ff = of * ((int(float(mult) * ff) + of - 1) // of)
    return ff


def hf_tensors(args: ModelArgs, present: Collection[str]) -> dict[str, str]:
    names = {
        "tok_embeddings": "model.embed_tokens.weight",
        "norm": "model.embedding_norm.weight",  # NOTE: LFM2's final norm, by this name
        "output": "lm_head.weight",
    }
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{_HF_NAMES[ours]}"
    return names


def hf_convert(kind: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    if kind == "shortconv_conv":
        return w.reshape(w.shape[0], w.shape[-1])  # [channels, 1, K]
    return w


FAMILY = Family(
    arch="lfm2",
    model_types=("lfm2",),
    block=qwen3.BLOCK,
    recurrent=True,
    gguf_names=GGUF_NAMES,
    hf_tied=True,  # transformers' Lfm2Config; its released configs say tie_embedding
    gguf_args=gguf_args,
    hf_args=hf_args,
    hf_tensors=hf_tensors,
    hf_convert=hf_convert,
)
MOE_FAMILY = replace(
    FAMILY,
    arch="lfm2moe",
    model_types=("lfm2_moe",),
    gguf_names=GGUF_NAMES | {"moe_sel_b": "exp_probs_b.bias"},
    gguf_args=moe_gguf_args,
)
