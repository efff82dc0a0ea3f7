"""Phi-3: Llama's block with qkv and gate|up fused in the files (split on load), LongRoPE
(short and long factors around the original training context), every layer sliding where the
config has a window (transformers' Phi3; llama.cpp ignores the window)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kvcache.rope import RopeConfig
from model.arch.args import LongRope, ModelArgs
from model.arch.family import Family, GGUFMeta, hf_rope_kind
from model.errors import ModelLoadError


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    if meta.has("rope_factors_long.weight"):
        _gguf_longrope(args, meta)
    window = int(meta.get("attention.sliding_window", 0))
    if 0 < window < args.n_ctx_train:
        # NOTE: as transformers' Phi3 (every layer slides); llama.cpp ignores the window
        args.windows = (window,) * args.n_layers


def _gguf_longrope(args: ModelArgs, meta: GGUFMeta) -> None:
    """LongRoPE as llama.cpp's phi3 reads it: rope_factors_short / rope_factors_long
    [n_rot / 2], rope.scaling.attn_factor, rope.scaling.original_context_length (the long
    factors past it: llama_model::get_rope_factors)."""
    attn = float(meta.get("rope.scaling.attn_factor", 1.0))
    ropes = []
    for kind in ("short", "long"):
        factors = meta.floats(f"rope_factors_{kind}.weight")
        if len(factors) != args.rope.dim // 2:
            raise ModelLoadError(
                f"{meta.path}: rope_factors_{kind}.weight has {len(factors)} values, not "
                f"{args.rope.dim // 2}."
            )
        ropes.append(replace(args.rope, freq_factors=factors, attn_factor=attn))
    orig = int(meta.get("rope.scaling.original_context_length", args.n_ctx_train))
    args.longrope = LongRope(ropes[0], ropes[1], orig)
    args.rope = ropes[0]


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    window = config.get("sliding_window")
    if window is not None and window < args.n_ctx_train:
        args.windows = (int(window),) * args.n_layers  # Phi3Config: every layer slides
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if hf_rope_kind(scaling) in ("longrope", "su"):  # "su": early Phi-3 128k configs
        _hf_longrope(args, config, scaling)


def _hf_longrope(args: ModelArgs, config: dict[str, Any], scaling: dict[str, Any]) -> None:
    """LongRoPE as transformers' _compute_longrope_parameters: the short and long divisors per
    rotated pair, the attention factor sqrt(1 + ln(s) / ln(n_orig)) for
    s = max_position_embeddings / n_orig unless the config gives it."""
    orig = int(
        config.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or args.n_ctx_train
    )
    factor = float(scaling.get("factor") or args.n_ctx_train / orig)
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ropes = []
    for key in ("short_factor", "long_factor"):
        factors = tuple(float(f) for f in scaling[key])
        if len(factors) != args.rope.dim // 2:
            raise ValueError(f"rope {key} has {len(factors)} entries, not {args.rope.dim // 2}")
        ropes.append(RopeConfig(args.rope.theta, args.rope.dim, "neox", factors, float(attn)))
    args.longrope = LongRope(ropes[0], ropes[1], orig)
    args.rope = ropes[0]


FAMILY = Family(
    arch="phi3",
    model_types=("phi3",),
    sliding=True,
    longrope=True,
    gguf_fused=frozenset(("wq", "wk", "wv", "w1", "w3")),
    hf_fused=("self_attn.qkv_proj", "mlp.gate_up_proj"),
    from_gguf=from_gguf,
    from_hf=from_hf,
)
