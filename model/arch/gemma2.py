"""Gemma 2: Gemma 3's block without q/k norms (soft-capped scores instead), every other layer
sliding (layers 0, 2, ...: llama.cpp's set_swa_pattern(2)), one RoPE for every layer."""

from __future__ import annotations

from typing import Any

from model.arch.args import BlockSpec, ModelArgs, periodic_windows
from model.arch.family import GEMMA_HF_NAMES, Family, GGUFMeta, check_hf_gelu, hf_layer_windows

BLOCK = BlockSpec(norm_shift=1.0, activation="gelu_tanh", post_norms=True, embed_scale=True)
SWA_PERIOD = 2


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    """llama.cpp's gemma2: the caps from the file; query_pre_attn_scalar is not in it: head_dim,
    dim / n_heads for the 27B (46 layers)."""
    args.windows = periodic_windows(
        args.n_layers, int(meta.get("attention.sliding_window")), SWA_PERIOD
    )
    args.attn_softcap = float(meta.get("attn_logit_softcapping", 0.0))
    args.final_softcap = float(meta.get("final_logit_softcapping", 0.0))
    scalar = args.dim // args.n_heads if args.n_layers == 46 else args.head_dim
    args.attn_scale = scalar**-0.5


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """layer_types (Gemma2Config's default: every other layer), query_pre_attn_scalar, the
    attention and final logit soft-capping."""
    check_hf_gelu(config)
    window = int(config["sliding_window"])
    args.windows = hf_layer_windows(config, args.n_layers, window, SWA_PERIOD)
    args.attn_scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
    args.attn_softcap = float(config.get("attn_logit_softcapping") or 0.0)
    args.final_softcap = float(config.get("final_logit_softcapping") or 0.0)


FAMILY = Family(
    arch="gemma2",
    model_types=("gemma2",),
    block=BLOCK,
    sliding=True,
    hf_names=GEMMA_HF_NAMES,
    hf_tied=True,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
