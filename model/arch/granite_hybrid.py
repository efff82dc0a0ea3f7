"""Granite 4.0-H and Bamba: Mamba2 mixers (model/arch/mamba2.py) with some attention layers, each
layer with a SwiGLU MLP; Granite's multipliers (model/arch/granite.py's, on this hybrid). The
mixture-of-experts Granite 4.0-H models (H-Tiny, H-Small) give every layer GraniteMoe's experts (a
softmax over the top-k router logits) plus the shared MLP as a shared expert (ungated).

GGUF (llama.cpp's "granitehybrid", convert_hf_to_gguf GraniteHybridModel): attention.head_count_kv
is a per-layer array where 0 marks a recurrent layer; rope.scaling.finetuned false means no
position encoding; logit_scale divides the logits; Q/K rows permuted by the converter; with
expert_count > 0 the experts are feed_forward_length wide (ffn_*_exps) and the shared MLP
expert_shared_feed_forward_length (ffn_*_shexp). HF
(`granitemoehybrid`, `bamba`): layer_types / layers_block_type "mamba" / "attention"
(transformers 5: linear_attention / full_attention), Bamba's attn_layer_indices; Granite's
shared_mlp.input_linear = gate || up, block_sparse_moe.input_linear [E, 2 f, d] likewise.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch

from kvcache.rope import RopeConfig
from model.arch import mamba2
from model.arch.args import LLAMA, Mixer, ModelArgs, MoEArgs
from model.arch.family import (
    Family,
    GGUFMeta,
    check_hf_silu,
    gguf_hybrid_attention,
    gguf_per_layer,
    gguf_uniform,
    hf_moe,
)
from model.arch.weights import layer_weights

# transformers 5 writes linear_attention / full_attention; released configs say mamba / attention
_LAYER_KINDS: dict[str, Mixer] = {
    "mamba": "mamba2",
    "linear_attention": "mamba2",
    "attention": "attn",
    "full_attention": "attn",
}
HF_ATTN_NAMES = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
}


def gguf_args(meta: GGUFMeta, vocab_size: int) -> ModelArgs:
    n_layers = int(meta.get("block_count"))
    dim = int(meta.get("embedding_length"))
    eps = float(meta.get("attention.layer_norm_rms_epsilon"))
    att = gguf_hybrid_attention(meta, n_layers, dim)
    mixers: list[Mixer] = ["attn" if a else "mamba2" for a in att.layers]
    head_dim = att.head_dim
    ff = gguf_per_layer(meta, "feed_forward_length", n_layers)
    recurrent = [i for i, m in enumerate(mixers) if m == "mamba2"]
    rope_on = bool(meta.get("rope.scaling.finetuned", True))
    args = ModelArgs(
        arch="granitehybrid",
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=att.n_heads,
        n_kv_heads=att.n_kv_heads,
        head_dim=head_dim,
        hidden_dim=gguf_uniform(meta, ff, "feed_forward_length"),
        norm_eps=eps,
        rope=RopeConfig(
            theta=float(meta.get("rope.freq_base", 10000.0)),
            dim=int(meta.get("rope.dimension_count", head_dim)),
            layout="neox",  # NOTE: Q/K are un-permuted to HF layout on load
        ),
        n_ctx_train=int(meta.get("context_length", 2048)),
        attn_scale=float(meta.get("attention.scale", 0.0)) or None,  # 0: 1/sqrt(head_dim)
        mixers=tuple(mixers),
        ssm=mamba2.gguf_ssm(meta, eps, recurrent) if recurrent else None,
        nope=not rope_on,
        # llama.cpp: 0 (absent) means no scaling
        embed_mult=float(meta.get("embedding_scale", 0.0)) or 1.0,
        residual_mult=float(meta.get("residual_scale", 0.0)) or 1.0,
        logits_scaling=float(meta.get("logit_scale", 0.0)) or 1.0,
    )
    n_experts = int(meta.get("expert_count", 0))
    if n_experts > 0:  # llama.cpp's granitehybrid: build_moe_ffn(softmax, norm_w) + the shared
        args.moe = MoEArgs(
            n_experts=n_experts,
            n_used=int(meta.get("expert_used_count")),
            expert_dim=int(meta.get("expert_feed_forward_length", args.hidden_dim)),
            norm_topk_prob=True,  # llama.cpp's granitehybrid graph, whatever the file says
            shared_dim=int(meta.get("expert_shared_feed_forward_length", 0)),
        )
    return args


def hf_args(config: dict[str, Any]) -> ModelArgs:
    check_hf_silu(config)
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not supported")
    model_type = str(config["model_type"])
    dim = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or dim // n_heads)
    eps = float(config.get("rms_norm_eps", 1e-6))
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {params['rope_type']!r} is not supported")
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    granite = model_type == "granitemoehybrid"
    partial = float(
        config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    )
    mixers = _hf_mixers(config)
    args = ModelArgs(
        arch=model_type,
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=len(mixers),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        hidden_dim=int(config["shared_intermediate_size" if granite else "intermediate_size"]),
        norm_eps=eps,
        rope=RopeConfig(theta, int(head_dim * partial), "neox"),
        n_ctx_train=int(config.get("max_position_embeddings", 0)),
        block=LLAMA,
        mixers=mixers,
        ssm=mamba2.hf_ssm(config, dim, eps, "mamba_"),
    )
    if granite:
        args.nope = config.get("position_embedding_type") != "rope"
        args.attn_scale = float(config.get("attention_multiplier", 1.0))
        args.embed_mult = float(config.get("embedding_multiplier", 1.0))
        args.residual_mult = float(config.get("residual_multiplier", 1.0))
        args.logits_scaling = float(config.get("logits_scaling", 1.0))
        if int(config.get("num_local_experts") or 0) > 0:
            # GraniteMoeHybridMoE: a softmax over the top-k logits (the top-k renormalized);
            # shared_mlp, shared_intermediate_size wide, every row takes beside them
            hf_moe(args, config, norm_topk=True)
            assert args.moe is not None
            args.moe = replace(args.moe, shared_dim=args.hidden_dim)
    elif int(config.get("num_local_experts") or 0) > 0:
        raise ValueError("a Bamba with experts is not a released model and not supported")
    return args


def _hf_mixers(config: dict[str, Any]) -> tuple[Mixer, ...]:
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types") or config.get("layers_block_type")
    if types is None and config.get("attn_layer_indices") is not None:  # Bamba
        attn = {int(i) for i in config["attn_layer_indices"]}
        types = ["attention" if i in attn else "mamba" for i in range(n)]
    if types is None:
        types = ["mamba"] * n
    if len(types) != n:
        raise ValueError(f"{len(types)} layer types for {n} layers")
    unknown = sorted({str(t) for t in types} - set(_LAYER_KINDS))
    if unknown:
        raise ValueError(f"layer types {unknown} are not supported")
    return tuple(_LAYER_KINDS[str(t)] for t in types)


def hf_tensors(args: ModelArgs, present: Collection[str]) -> dict[str, str]:
    granite = args.arch == "granitemoehybrid"
    names = {
        "tok_embeddings": "model.embed_tokens.weight",
        "norm": "model.norm.weight" if granite else "model.final_layernorm.weight",
        "output": "lm_head.weight",
    }
    ffn = {
        "ffn_norm": "post_attention_layernorm.weight" if granite else "pre_ff_layernorm.weight",
        "w1": "shared_mlp.input_linear.weight" if granite else "feed_forward.gate_proj.weight",
        "w3": "shared_mlp.input_linear.weight" if granite else "feed_forward.up_proj.weight",
        "w2": "shared_mlp.output_linear.weight" if granite else "feed_forward.down_proj.weight",
    }
    table = {"attn_norm": "input_layernorm.weight"}
    table |= {k: "mamba." + v for k, v in mamba2.HF_MIXER_NAMES.items()} | HF_ATTN_NAMES | ffn
    table |= _HF_MOE_NAMES
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{table[ours]}"
    return names


# GraniteMoeHybridMoE's experts and the shared MLP beside them (a shared expert)
_HF_MOE_NAMES = {
    "moe_router": "block_sparse_moe.router.layer.weight",
    "w1_exps": "block_sparse_moe.input_linear.weight",  # [E, 2 f, d]: gates || ups
    "w3_exps": "block_sparse_moe.input_linear.weight",
    "w2_exps": "block_sparse_moe.output_linear.weight",  # [E, d, f]
    "w1_shexp": "shared_mlp.input_linear.weight",
    "w3_shexp": "shared_mlp.input_linear.weight",
    "w2_shexp": "shared_mlp.output_linear.weight",
}
_GATE_UP = {"w1": 0, "w3": 1, "w1_shexp": 0, "w3_shexp": 1}  # input_linear = gate || up (dim 0)
_EXPERTS_GATE_UP = {"w1_exps": 0, "w3_exps": 1}  # [E, 2 f, d] (dim 1)


def hf_convert(kind: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    if args.arch == "granitemoehybrid" and kind in _GATE_UP:
        return w.chunk(2, dim=0)[_GATE_UP[kind]]
    if kind in _EXPERTS_GATE_UP:
        return w.chunk(2, dim=1)[_EXPERTS_GATE_UP[kind]]
    return mamba2.hf_convert(kind, w, args)


FAMILY = Family(
    arch="granitehybrid",
    model_types=("granitemoehybrid", "bamba"),
    recurrent=True,
    gguf_permuted_qk=True,
    gguf_names=mamba2.GGUF_NAMES,
    gguf_args=gguf_args,
    hf_args=hf_args,
    hf_tensors=hf_tensors,
    hf_convert=hf_convert,
    gguf_convert=mamba2.gguf_convert,
)
