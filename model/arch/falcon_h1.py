"""Falcon-H1: every layer attention and a Mamba2 mixer side by side on the same normed input,
their outputs summed ("attn_mamba2"), then a SwiGLU MLP. Each layer keeps K/V cells and a state
slot (ModelArgs.memory_spec: the states after the attention entries, ModelArgs.state_layer).

HF (`falcon_h1`, FalconH1Config): input_layernorm, self_attn.{q,k,v,o}_proj (RoPE, head_dim),
mamba.* (Mamba2's mixer: mamba_n_heads of mamba_d_head, mamba_d_ssm wide, mamba_n_groups,
mamba_d_state, mamba_d_conv; the gated RMSNorm mamba.norm only with mamba_rms_norm, after the
gate unless mamba_norm_before_gate), pre_ff_layernorm, feed_forward.{gate,up,down}_proj,
final_layernorm. Its muP multipliers (ModelArgs.mup) are folded into the weights here, as
llama.cpp's converter folds them; the embedding and lm_head multipliers stay scalars.
GGUF (llama.cpp's "falcon-h1", convert_hf_to_gguf FalconH1Model): the multipliers already in
the weights; Mamba2's ssm.* keys and tensors; one attention.head_count / head_count_kv; Q/K not
permuted (NEOX RoPE); ssm_norm optional and, in llama.cpp's graph, always after the gate.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any, Literal

import torch

from kvcache.rope import RopeConfig
from model.arch import mamba2
from model.arch.args import LLAMA, Mixer, ModelArgs, MuP, SSMArgs
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

_PARALLEL: Mixer = "attn_mamba2"


def gguf_args(meta: GGUFMeta, vocab_size: int) -> ModelArgs:
    n_layers = int(meta.get("block_count"))
    dim = int(meta.get("embedding_length"))
    eps = float(meta.get("attention.layer_norm_rms_epsilon"))
    att = gguf_hybrid_attention(meta, n_layers, dim)
    if not all(att.layers):
        raise ModelLoadError(f"{meta.path}: a layer without attention heads (inconsistent file).")
    layers = list(range(n_layers))
    with_norm = [i for i in layers if meta.has(f"blk.{i}.ssm_norm.weight")]
    if with_norm and len(with_norm) != n_layers:
        raise ModelLoadError(f"{meta.path}: only some layers have ssm_norm (inconsistent file).")
    # llama.cpp's build_mamba2_layer: the norm (where the file has one) after the gate
    ssm = replace(mamba2.gguf_ssm(meta, eps, layers), norm="after_gate" if with_norm else "none")
    ff = gguf_per_layer(meta, "feed_forward_length", n_layers)
    return ModelArgs(
        arch="falcon-h1",
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=att.n_heads,
        n_kv_heads=att.n_kv_heads,
        head_dim=att.head_dim,
        hidden_dim=gguf_uniform(meta, ff, "feed_forward_length"),
        norm_eps=eps,
        rope=RopeConfig(
            theta=float(meta.get("rope.freq_base", 10000.0)),
            dim=int(meta.get("rope.dimension_count", att.head_dim)),
            layout="neox",
        ),
        n_ctx_train=int(meta.get("context_length", 0)),
        attn_scale=float(meta.get("attention.scale", 0.0)) or None,  # 0: 1/sqrt(head_dim)
        mixers=(_PARALLEL,) * n_layers,
        ssm=ssm,
    )


def _float(value: Any) -> float:
    """A config number; transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def hf_args(config: dict[str, Any]) -> ModelArgs:
    check_hf_silu(config)
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not supported")
    in_bias, out_bias = bool(config.get("mamba_proj_bias")), bool(config.get("projectors_bias"))
    if in_bias != out_bias:
        raise ValueError("mamba_proj_bias and projectors_bias differ: not supported")
    limit = config.get("time_step_limit") or (0.0, math.inf)
    if _float(limit[0]) > 0.0 or _float(limit[1]) != math.inf:
        raise ValueError(f"time_step_limit {limit} (a clamped dt) is not supported")
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("rope scaling is not supported")
    dim = int(config["hidden_size"])
    n_layers = int(config["num_hidden_layers"])
    n_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or dim // n_heads)
    eps = float(config.get("rms_norm_eps", 1e-5))
    ssm_heads, ssm_head_dim = int(config["mamba_n_heads"]), int(config["mamba_d_head"])
    d_ssm = int(config.get("mamba_d_ssm") or int(config.get("mamba_expand", 2)) * dim)
    groups = int(config.get("mamba_n_groups", 1))
    if ssm_heads * ssm_head_dim != d_ssm or ssm_heads % groups:
        raise ValueError(
            f"{ssm_heads} Mamba heads x {ssm_head_dim} != mamba_d_ssm {d_ssm}, or {groups} "
            "groups do not divide them"
        )
    norm: Literal["after_gate", "before_gate", "none"] = "none"
    if config.get("mamba_rms_norm"):
        norm = "before_gate" if config.get("mamba_norm_before_gate", True) else "after_gate"
    rows = tuple(float(m) for m in config.get("ssm_multipliers") or (1.0,) * 5)
    gate, down = (float(m) for m in config.get("mlp_multipliers") or (1.0, 1.0))
    if len(rows) != 5:
        raise ValueError(f"ssm_multipliers has {len(rows)} entries (z, x, B, C, dt: 5)")
    return ModelArgs(
        arch="falcon_h1",
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        hidden_dim=int(config["intermediate_size"]),
        norm_eps=eps,
        rope=RopeConfig(float(params.get("rope_theta", config.get("rope_theta", 1e4))), head_dim),
        n_ctx_train=int(config.get("max_position_embeddings", 0)),
        block=LLAMA,
        mixers=(_PARALLEL,) * n_layers,
        ssm=SSMArgs(
            n_heads=ssm_heads,
            head_dim=ssm_head_dim,
            d_state=int(config["mamba_d_state"]),
            n_groups=groups,
            d_conv=int(config.get("mamba_d_conv", 4)),
            conv_bias=bool(config.get("mamba_conv_bias", True)),
            proj_bias=in_bias,
            norm_eps=eps,
            norm=norm,
        ),
        embed_mult=float(config.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(config.get("lm_head_multiplier", 1.0)),
        mup=MuP(
            attn_in=float(config.get("attention_in_multiplier", 1.0)),
            key=float(config.get("key_multiplier", 1.0)),
            attn_out=float(config.get("attention_out_multiplier", 1.0)),
            ssm_in=float(config.get("ssm_in_multiplier", 1.0)),
            ssm_rows=rows,
            ssm_out=float(config.get("ssm_out_multiplier", 1.0)),
            gate=gate,
            down=down,
        ),
    )


def hf_tensors(args: ModelArgs, present: Collection[str]) -> dict[str, str]:
    names = dict(HF_HYBRID_NAMES)
    table = HF_HYBRID_LAYER_NAMES | {k: "mamba." + v for k, v in mamba2.HF_MIXER_NAMES.items()}
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{table[ours]}"
    return names


def _row_scales(args: ModelArgs, n_rows: int) -> torch.Tensor:
    """in_proj's per-row multipliers (transformers' mup_vector): z, x, B, C, dt blocks."""
    s, mup = args.ssm, args.mup
    assert s is not None and mup is not None
    gn = s.n_groups * s.d_state
    sizes = (s.d_inner, s.d_inner, gn, gn, s.n_heads)
    if sum(sizes) != n_rows:
        raise ValueError(f"has {n_rows} rows, expected {sum(sizes)}")
    return torch.cat([torch.full((n,), m) for n, m in zip(sizes, mup.ssm_rows, strict=True)])


def hf_convert(kind: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Mamba2's conv / A_log conversions, then the muP multipliers folded in (float32)."""
    w = mamba2.hf_convert(kind, w, args)
    mup = args.mup
    if mup is None:
        return w
    scale = {
        "wq": mup.attn_in,
        "wv": mup.attn_in,
        "wk": mup.attn_in * mup.key,
        "wo": mup.attn_out,
        "ssm_out": mup.ssm_out,
        "ssm_out_b": mup.ssm_out,
        "w1": mup.gate,
        "w2": mup.down,
    }
    if kind in scale:
        return w.float() * scale[kind]
    if kind in ("ssm_in", "ssm_in_b"):  # in_proj(x * ssm_in) * mup_vector
        rows = _row_scales(args, w.shape[0])
        rows = rows * mup.ssm_in if kind == "ssm_in" else rows
        return w.float() * (rows[:, None] if w.dim() == 2 else rows)
    return w


FAMILY = Family(
    arch="falcon-h1",
    model_types=("falcon_h1",),
    recurrent=True,
    # llama.cpp loads the MLP norm as blk.{i}.ffn_norm, without ".weight" (its converter's name)
    gguf_names={**mamba2.GGUF_NAMES, "ffn_norm": "ffn_norm"},
    gguf_args=gguf_args,
    hf_args=hf_args,
    hf_tensors=hf_tensors,
    hf_convert=hf_convert,
    gguf_convert=mamba2.gguf_convert,
)
