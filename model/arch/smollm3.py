"""SmolLM3: Llama's block; no RoPE on every 4th layer (llama.cpp's n_no_rope_layer_step = 4, not
in the file; transformers' no_rope_layers / no_rope_layer_interval)."""

from __future__ import annotations

from typing import Any

from model.arch.args import ModelArgs
from model.arch.family import Family, GGUFMeta

NOPE_PERIOD = 4


def nope_layers(n_layers: int, period: int = NOPE_PERIOD) -> tuple[bool, ...]:
    """Per layer: True where SmolLM3 uses no RoPE ((i + 1) % period == 0)."""
    return tuple((i + 1) % period == 0 for i in range(n_layers))


def from_gguf(args: ModelArgs, meta: GGUFMeta) -> None:
    args.nope_layers = nope_layers(args.n_layers)


def from_hf(args: ModelArgs, config: dict[str, Any]) -> None:
    uses_rope = config.get("no_rope_layers")  # 1: RoPE on that layer, 0: none
    args.nope_layers = (
        tuple(not bool(u) for u in uses_rope)
        if uses_rope is not None
        else nope_layers(args.n_layers, int(config.get("no_rope_layer_interval", NOPE_PERIOD)))
    )
    if len(args.nope_layers) != args.n_layers:
        raise ValueError(f"no_rope_layers has {len(args.nope_layers)} entries")


FAMILY = Family(
    arch="smollm3",
    model_types=("smollm3",),
    gguf_permuted_qk=True,
    from_gguf=from_gguf,
    from_hf=from_hf,
)
