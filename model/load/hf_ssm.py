"""Hugging Face folders of models with recurrent mixers: Mamba2 (`mamba2`), Granite 4.0-H
(`granitemoehybrid`, dense only), Bamba (`bamba`) and LFM2's short convolutions (`lfm2`), read
into ModelArgs and HF-layout weights under model.arch's names (ssm_a = -exp(A_log), the convs
squeezed to [channels, K], Granite's shared_mlp.input_linear split into w1 (gate, first half)
and w3 (up))."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvcache.rope import RopeConfig
from model.arch import LLAMA, Mixer, ModelArgs, SSMArgs, recurrent
from model.arch.weights import layer_weights, weight_shapes
from model.errors import ModelLoadError

# transformers 5 writes linear_attention / full_attention; released configs say mamba / attention
_LAYER_KINDS: dict[str, Mixer] = {
    "mamba": "mamba2",
    "linear_attention": "mamba2",
    "attention": "attn",
    "full_attention": "attn",
}
_MIXER_TENSORS = {
    "ssm_in": "in_proj.weight",
    "ssm_in_b": "in_proj.bias",
    "ssm_conv": "conv1d.weight",
    "ssm_conv_b": "conv1d.bias",
    "ssm_dt_b": "dt_bias",
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_norm": "norm.weight",
    "ssm_out": "out_proj.weight",
    "ssm_out_b": "out_proj.bias",
}
_ATTN_TENSORS = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
}
_LFM2_TENSORS = _ATTN_TENSORS | {
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
}
_LFM2_LAYER_KINDS: dict[str, Mixer] = {"conv": "shortconv", "full_attention": "attn"}


def read_ssm_args(config: dict[str, Any], model_type: str) -> ModelArgs:
    """Raises KeyError / TypeError / ValueError on a bad or unsupported config (the caller
    names the file)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported")
    dim = int(config["hidden_size"])
    if model_type == "lfm2":
        return _lfm2_args(config, dim)
    if model_type == "mamba2":
        n = int(config["num_hidden_layers"])
        eps = float(config.get("layer_norm_epsilon", 1e-5))
        ssm = _ssm(config, dim, eps, "")
        return ModelArgs(
            arch="mamba2",
            vocab_size=int(config["vocab_size"]),
            dim=dim,
            n_layers=n,
            n_heads=0,
            n_kv_heads=0,
            head_dim=0,
            hidden_dim=0,
            norm_eps=eps,
            rope=RopeConfig(10000.0, 0),
            n_ctx_train=0,  # no trained context limit
            block=LLAMA,
            mixers=("mamba2",) * n,
            ssm=ssm,
            ffn=False,
        )
    if int(config.get("num_local_experts") or 0) > 0:
        raise ValueError(
            f"mixture-of-experts layers (num_local_experts {config['num_local_experts']}) are "
            "not supported; the dense Granite 4.0-H models (H-350M, H-1B, H-Micro) are"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not supported")
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
    mixers = _mixers(config)
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
        ssm=_ssm(config, dim, eps, "mamba_"),
    )
    if granite:
        args.nope = config.get("position_embedding_type") != "rope"
        args.attn_scale = float(config.get("attention_multiplier", 1.0))
        args.embed_mult = float(config.get("embedding_multiplier", 1.0))
        args.residual_mult = float(config.get("residual_multiplier", 1.0))
        args.logits_scaling = float(config.get("logits_scaling", 1.0))
    return args


def _ssm(config: dict[str, Any], dim: int, eps: float, pre: str) -> SSMArgs:
    """Mamba2Config's fields, or GraniteMoeHybrid / Bamba's mamba_* ones (pre "mamba_")."""
    names = ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand")
    if pre:
        names = ("n_heads", "d_head", "d_state", "n_groups", "d_conv", "expand")
    heads, head_dim, state, groups, conv, expand = (config.get(pre + k) for k in names)
    n_heads, d_inner = int(heads), int(expand or 2) * dim
    p = d_inner // n_heads if head_dim in (None, "auto") else int(head_dim)
    if n_heads * p != d_inner or n_heads % int(groups) != 0:
        raise ValueError(
            f"{n_heads} heads x {p} != {d_inner}, or {groups} groups do not divide them"
        )
    conv_bias = config.get(pre + ("conv_bias" if pre else "use_conv_bias"), True)
    proj_bias = config.get(pre + ("proj_bias" if pre else "use_bias"), False)
    return SSMArgs(
        n_heads=n_heads,
        head_dim=p,
        d_state=int(state),
        n_groups=int(groups),
        d_conv=int(conv),
        conv_bias=bool(conv_bias),
        proj_bias=bool(proj_bias),
        norm_eps=eps,
    )


def _lfm2_args(config: dict[str, Any], dim: int) -> ModelArgs:
    """Lfm2Config: layer_types "conv" / "full_attention" (or full_attn_idxs: the attention
    layers), RoPE on whole heads, the MLP width as Lfm2MLP adjusts it."""
    if config.get("conv_bias"):
        raise ValueError("conv_bias is not supported (llama.cpp's lfm2 has no conv biases)")
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        attn = config.get("full_attn_idxs")
        attn = set(range(n)) if attn is None else {int(i) for i in attn}
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    if len(types) != n or not set(types) <= set(_LFM2_LAYER_KINDS):
        raise ValueError(f"layer_types {types} for {n} layers (conv / full_attention)")
    n_heads = int(config["num_attention_heads"])
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {params['rope_type']!r} is not supported")
    theta = float(config.get("rope_theta", params.get("rope_theta", 1000000.0)))
    return ModelArgs(
        arch="lfm2",
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=n,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=dim // n_heads,
        hidden_dim=_lfm2_ff_dim(config),
        norm_eps=float(config.get("norm_eps", 1e-5)),
        rope=RopeConfig(theta, dim // n_heads, "neox"),
        n_ctx_train=int(config.get("max_position_embeddings", 0)),
        block=recurrent.LFM2.block,
        mixers=tuple(_LFM2_LAYER_KINDS[t] for t in types),
        short_conv=int(config.get("conv_L_cache", 3)),
    )


def _lfm2_ff_dim(config: dict[str, Any]) -> int:
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


def _mixers(config: dict[str, Any]) -> tuple[Mixer, ...]:
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


def hf_names(args: ModelArgs) -> dict[str, str]:
    """Our weight name -> the HF tensor it comes from (before convert_tensor)."""
    if args.arch == "lfm2":
        names = {
            "tok_embeddings": "model.embed_tokens.weight",
            "norm": "model.embedding_norm.weight",  # NOTE: LFM2's final norm, by this name
            "output": "lm_head.weight",
        }
        for i in range(args.n_layers):
            for ours in layer_weights(args, i):
                names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{_LFM2_TENSORS[ours]}"
        return names
    if args.arch == "mamba2":
        layer_fmt, mixer = "backbone.layers.{}.", "mixer."
        names = {
            "tok_embeddings": "backbone.embeddings.weight",
            "norm": "backbone.norm_f.weight",
            "output": "lm_head.weight",
        }
    else:
        layer_fmt, mixer = "model.layers.{}.", "mamba."
        names = {
            "tok_embeddings": "model.embed_tokens.weight",
            "norm": "model.final_layernorm.weight" if args.arch == "bamba" else "model.norm.weight",
            "output": "lm_head.weight",
        }
    granite = args.arch == "granitemoehybrid"
    ffn = {
        "ffn_norm": "post_attention_layernorm.weight" if granite else "pre_ff_layernorm.weight",
        "w1": "shared_mlp.input_linear.weight" if granite else "feed_forward.gate_proj.weight",
        "w3": "shared_mlp.input_linear.weight" if granite else "feed_forward.up_proj.weight",
        "w2": "shared_mlp.output_linear.weight" if granite else "feed_forward.down_proj.weight",
    }
    for i in range(args.n_layers):
        pre = layer_fmt.format(i)
        table = {"attn_norm": "norm.weight" if args.arch == "mamba2" else "input_layernorm.weight"}
        table |= {k: mixer + v for k, v in _MIXER_TENSORS.items()} | _ATTN_TENSORS | ffn
        for ours in layer_weights(args, i):
            names[f"layers.{i}.{ours}"] = pre + table[ours]
    return names


def convert_tensor(ours: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """An HF tensor -> the shape and meaning model.arch.weights.weight_shapes gives `ours`."""
    kind = ours.rsplit(".", 1)[-1]
    if kind in ("ssm_conv", "shortconv_conv"):
        return w.reshape(w.shape[0], w.shape[-1])  # [channels, 1, K]
    if kind == "ssm_a":
        return -torch.exp(w.float())  # A_log -> A
    if args.arch == "granitemoehybrid" and kind in ("w1", "w3"):
        gate, up = w.chunk(2, dim=0)  # input_linear = gate || up
        return gate if kind == "w1" else up
    return w


def read_ssm_weights(
    raw: dict[str, torch.Tensor],
    args: ModelArgs,
    config: dict[str, Any],
    dtype: torch.dtype,
    folder: Path,
) -> dict[str, torch.Tensor]:
    names = hf_names(args)
    if "backbone.embedding.weight" in raw:  # older Mamba2 checkpoints (transformers' load_hook)
        raw.setdefault("backbone.embeddings.weight", raw["backbone.embedding.weight"])
    # LFM2 ties by default (transformers' Lfm2Config; its released configs say tie_embedding)
    lfm2 = args.arch == "lfm2"
    tied = config.get("tie_embedding", config.get("tie_word_embeddings", lfm2))
    if "lm_head.weight" not in raw and tied:
        del names["output"]
    expected = weight_shapes(args)
    weights: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        if theirs not in raw:
            raise ModelLoadError(f"{folder}: tensor {theirs} is missing.")
        w = convert_tensor(ours, raw[theirs], args)
        want = expected[ours.rsplit(".", 1)[-1]]
        if tuple(w.shape) != want:
            raise ModelLoadError(
                f"{folder}: tensor {theirs} has shape {tuple(raw[theirs].shape)}, which does not "
                f"give the expected {want}."
            )
        weights[ours] = w.to(dtype)
    weights.setdefault("output", weights["tok_embeddings"])
    return weights
