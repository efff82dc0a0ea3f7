"""Gemma 3 (transformers' gemma3_text, llama.cpp's gemma3): (1 + w) norms, GeGLU, q/k norms,
post norms, scaled embeddings; five sliding-window layers to every global one, the local ones
with their own RoPE base."""

from __future__ import annotations

from typing import Any

from kvcache.rope import RopeConfig
from model.arch.args import BlockSpec, ModelArgs, periodic_windows
from model.arch.family import (
    GEMMA_HF_NAMES,
    Family,
    GGUFMeta,
    check_hf_gelu,
    hf_layer_windows,
    hf_linear_factor,
    hf_rope_kind,
)

BLOCK = BlockSpec(
    norm_shift=1.0, activation="gelu_tanh", qk_norm=True, post_norms=True, embed_scale=True
)
# the local (sliding-window) layers use RoPE base 10,000 whatever the global base
# (transformers' rope_local_base_freq default, llama.cpp's rope_freq_base_train_swa)
LOCAL_ROPE_BASE = 10000.0
SWA_PERIOD = 6  # every 6th layer is global: llama.cpp set_swa_pattern(6), HF layer_types


def windows(n_layers: int, window: int) -> tuple[int, ...]:
    """Per layer: `window` for the sliding-window layers, 0 for every 6th (global)."""
    return periodic_windows(n_layers, window, SWA_PERIOD)


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    """Sliding windows, local RoPE and attention scale the way llama.cpp's gemma3 reads them
    (the GGUF stores only the window; transformers' Gemma3TextConfig defaults agree)."""
    # NOTE: the 4B and larger scale the global layers' RoPE linearly (gguf_args: args.rope);
    # the local layers' RoPE below never is
    args.windows = windows(args.n_layers, int(meta.get("attention.sliding_window")))
    args.rope_swa = RopeConfig(LOCAL_ROPE_BASE, args.rope.dim, "neox")
    # NOTE: query_pre_attn_scalar is not in the file: head_dim, except for the 27B model
    # (62 layers) where it is dim / n_heads (llama.cpp's f_attention_scale for gemma3).
    scalar = args.dim // args.n_heads if args.n_layers == 62 else args.head_dim
    args.attn_scale = scalar**-0.5


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """Windows from layer_types (or the older sliding_window_pattern), per-layer-type RoPE from
    rope_parameters (or rope_theta / rope_local_base_freq), query_pre_attn_scalar."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"{key} is not supported")
    check_hf_gelu(config)
    period = int(config.get("sliding_window_pattern", SWA_PERIOD))
    args.windows = hf_layer_windows(config, args.n_layers, int(config["sliding_window"]), period)
    params = config.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_theta": config.get("rope_theta", 1e6)}
    local = params.get("sliding_attention") or {
        "rope_theta": config.get("rope_local_base_freq", LOCAL_ROPE_BASE)
    }
    # the 4B and larger: linear scaling of the global layers' positions (rope_scaling in older
    # configs, rope_parameters.full_attention in newer ones); the local layers keep theirs
    scaling = full if "rope_type" in full else (config.get("rope_scaling") or {})
    factor = hf_linear_factor(scaling)
    if hf_rope_kind(local) != "default":
        raise ValueError(f"sliding-window rope scaling {hf_rope_kind(local)!r} is not supported")
    args.rope = RopeConfig(
        float(full["rope_theta"]),
        args.head_dim,
        "neox",
        None if factor == 1.0 else (factor,) * (args.head_dim // 2),
    )
    args.rope_swa = RopeConfig(float(local["rope_theta"]), args.head_dim, "neox")
    args.attn_scale = float(config.get("query_pre_attn_scalar", args.head_dim)) ** -0.5


FAMILY = Family(
    arch="gemma3",
    model_types=("gemma3_text",),
    block=BLOCK,
    sliding=True,
    hf_names=GEMMA_HF_NAMES,
    hf_tied=True,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
