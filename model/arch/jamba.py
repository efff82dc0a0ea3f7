"""Jamba: Mamba (1) mixers (model/arch/mamba.py) with dt / B / C RMS norms that have weights,
and some attention layers without any position encoding; every layer an MLP, a mixture of
experts on some (a softmax over all the experts, the top-k weights not renormalized).

HF (`jamba`, JambaConfig): layer i is attention where i % attn_layer_period ==
attn_layer_offset, else Mamba; its MLP is the experts where i % expert_layer_period ==
expert_layer_offset (num_experts of intermediate_size, num_experts_per_tok used), else a dense
SwiGLU of the same width; mamba_* sizes; input_layernorm, pre_ff_layernorm, final_layernorm;
the experts one tensor each (feed_forward.experts.{e}.gate_proj, ...), the router
feed_forward.router.
GGUF (llama.cpp's "jamba", convert_hf_to_gguf JambaModel, llama-model.cpp LLM_ARCH_JAMBA):
attention.head_count_kv per layer, 0 on a Mamba layer; an MoE layer is one with
ffn_gate_inp (its experts stacked in ffn_*_exps), a dense one has ffn_gate / up / down; no
RoPE; Q/K not permuted; build_moe_ffn with softmax gating and no weight normalization.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvcache.rope import RopeConfig
from model.arch import mamba, mamba2
from model.arch.args import LLAMA, Mixer, ModelArgs, MoEArgs
from model.arch.family import (
    HF_HYBRID_LAYER_NAMES,
    HF_HYBRID_NAMES,
    Family,
    GGUFMeta,
    check_hf_silu,
    gguf_hybrid_attention,
    gguf_per_layer,
    gguf_uniform,
)
from model.arch.weights import layer_weights
from model.errors import ModelLoadError


def gguf_args(meta: GGUFMeta, vocab_size: int) -> ModelArgs:
    n_layers = int(meta.get("block_count"))
    dim = int(meta.get("embedding_length"))
    eps = float(meta.get("attention.layer_norm_rms_epsilon"))
    att = gguf_hybrid_attention(meta, n_layers, dim)
    mixers: list[Mixer] = ["attn" if a else "mamba" for a in att.layers]
    recurrent = [i for i, m in enumerate(mixers) if m == "mamba"]
    ff = gguf_per_layer(meta, "feed_forward_length", n_layers)
    args = ModelArgs(
        arch="jamba",
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=att.n_heads,
        n_kv_heads=att.n_kv_heads,
        head_dim=att.head_dim,
        hidden_dim=gguf_uniform(meta, ff, "feed_forward_length"),
        norm_eps=eps,
        rope=RopeConfig(10000.0, att.head_dim),
        n_ctx_train=int(meta.get("context_length", 0)),
        mixers=tuple(mixers),
        mamba=mamba.gguf_mamba(meta, eps, recurrent) if recurrent else None,
        nope=True,
    )
    moe_layers = tuple(meta.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(n_layers))
    n_experts = int(meta.get("expert_count", 0))
    if any(moe_layers):
        if n_experts <= 0:
            raise ModelLoadError(f"{meta.path}: expert layers without expert_count.")
        args.moe = MoEArgs(
            n_experts=n_experts,
            n_used=int(meta.get("expert_used_count")),
            expert_dim=int(meta.get("expert_feed_forward_length", args.hidden_dim)),
            norm_topk_prob=False,  # llama.cpp's jamba graph, as transformers' JambaTopKRouter
        )
        args.moe_layers = moe_layers
    return args


def hf_args(config: dict[str, Any]) -> ModelArgs:
    check_hf_silu(config)
    dim = int(config["hidden_size"])
    n = int(config["num_hidden_layers"])
    n_heads = int(config["num_attention_heads"])
    head_dim = dim // n_heads
    eps = float(config.get("rms_norm_eps", 1e-6))
    attn_period, attn_offset = int(config["attn_layer_period"]), int(config["attn_layer_offset"])
    kinds: list[Mixer] = ["attn" if i % attn_period == attn_offset else "mamba" for i in range(n)]
    args = ModelArgs(
        arch="jamba",
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=n,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        hidden_dim=int(config["intermediate_size"]),
        norm_eps=eps,
        rope=RopeConfig(10000.0, head_dim),
        n_ctx_train=int(config.get("max_position_embeddings", 0)),
        block=LLAMA,
        mixers=tuple(kinds),
        mamba=mamba.hf_mamba(config, dim, "mamba_", "weighted", eps),
        nope=True,
    )
    n_experts = int(config.get("num_experts") or 1)
    if n_experts > 1:
        period, offset = int(config["expert_layer_period"]), int(config["expert_layer_offset"])
        args.moe = MoEArgs(
            n_experts=n_experts,
            n_used=int(config["num_experts_per_tok"]),
            expert_dim=args.hidden_dim,
            norm_topk_prob=False,  # JambaTopKRouter: the top-k of the softmax as they are
        )
        args.moe_layers = tuple(i % period == offset for i in range(n))
    return args


_HF_NAMES = HF_HYBRID_LAYER_NAMES | {
    "moe_router": "feed_forward.router.weight",
    "w1_exps": "feed_forward.experts.{}.gate_proj.weight",  # one per expert: stacked
    "w3_exps": "feed_forward.experts.{}.up_proj.weight",
    "w2_exps": "feed_forward.experts.{}.down_proj.weight",
}


def hf_tensors(args: ModelArgs, present: Collection[str]) -> dict[str, str]:
    names = dict(HF_HYBRID_NAMES)
    table = _HF_NAMES | {k: "mamba." + v for k, v in mamba.HF_MIXER_NAMES.items()}
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        for ours in layer_weights(args, i):
            theirs = p + table[ours]
            # AI21's first checkpoints keep a dense MLP as the only expert (llama.cpp's converter
            # reads it so too)
            dense = theirs.replace(".feed_forward.", ".feed_forward.experts.0.")
            if ours in ("w1", "w3", "w2") and theirs not in present and dense in present:
                theirs = dense
            names[f"layers.{i}.{ours}"] = theirs
    return names


FAMILY = Family(
    arch="jamba",
    model_types=("jamba",),
    recurrent=True,
    gguf_names=mamba.GGUF_NAMES,
    gguf_args=gguf_args,
    hf_args=hf_args,
    hf_tensors=hf_tensors,
    hf_convert=mamba2.hf_convert,
    gguf_convert=mamba.gguf_convert,
)
