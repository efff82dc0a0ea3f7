"""EXAONE 4.0: OLMo 2's post-norms-only block with q/k norms per head; with a sliding window
(three local layers to every global one), the global layers take no RoPE."""

from __future__ import annotations

from typing import Any

from model.arch.args import BlockSpec, ModelArgs, periodic_windows
from model.arch.family import GEMMA_HF_NAMES, Family, GGUFMeta, hf_layer_windows

BLOCK = BlockSpec(qk_norm=True, post_norms=True, pre_norms=False)
SWA_PERIOD = 4  # LLLG: Exaone4Config's sliding_window_pattern, llama.cpp's 32B pattern


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    if args.n_layers == 64:
        # NOTE: llama.cpp's exaone4 slides (LLLG, NoPE on the global layers) only for the
        # 64-layer 32B: the file says neither the pattern nor, for the 1.2B, that it has none
        window = int(meta.get("attention.sliding_window", 4096))
        args.windows = periodic_windows(args.n_layers, window, SWA_PERIOD)
        args.nope_layers = tuple(w == 0 for w in args.windows)


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    """layer_types (or sliding_window_pattern: every n-th layer global, or a string of L / G,
    the last layer global) slide by sliding_window; the global layers take no RoPE
    (transformers' Exaone4Attention: NoPE on them once the model has a window)."""
    window = config.get("sliding_window")
    if window is None:
        return
    pattern = config.get("sliding_window_pattern", SWA_PERIOD)
    if config.get("layer_types") is None and isinstance(pattern, str):
        local = [pattern[i % len(pattern)] == "L" for i in range(args.n_layers)][:-1]
        args.windows = (*(int(window) if t else 0 for t in local), 0)
    else:
        period = SWA_PERIOD if isinstance(pattern, str) else int(pattern)  # with layer_types
        args.windows = hf_layer_windows(config, args.n_layers, int(window), period)
    args.nope_layers = tuple(w == 0 for w in args.windows)


FAMILY = Family(
    arch="exaone4",
    model_types=("exaone4",),
    block=BLOCK,
    sliding=True,
    hf_names=GEMMA_HF_NAMES,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
