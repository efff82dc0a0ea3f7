"""`python -m bench.make_moe`: the Granite-3.1-3B-A800M-shaped benchmark model, a mixture of
experts (40 experts a layer, 8 of them a token: 3.3B weights, 0.9B read a token), made as
bench/make_8b.py makes the 8B: a Hugging Face folder (transformers' GraniteMoeConfig, SmolLM2's
tokenizer, random weights of std 0.02 in bfloat16), converted by llama.cpp's own
`convert_hf_to_gguf.py` and quantized to Q4_K_M by its `llama-quantize`. The routers are random
too, so each token still picks its own 8 experts; only the text is noise.

The folder (6.6 GB) is written one layer at a time; the bf16 GGUF (6.6 GB) and the folder are
deleted once the Q4_K_M (about 2 GB) is written, unless --keep. Prints the GGUF's path; an existing
one is reused. `python -m bench.run --model granite-3b-a800m-shape` serves it.
"""

from __future__ import annotations

import pathlib
import sys
from dataclasses import asdict, dataclass

from bench.make_8b import (
    _smollm2_vocab,
    cli,
    make_gguf,
    write_shards,
    write_tokenizer,
)

NAME = "granite-3b-a800m-shape"


@dataclass(frozen=True, slots=True)
class Shape:
    """Granite-3.1-3B-A800M's widths, experts and multipliers (a 4096-token rope: the context
    does not change a token's cost) but SmolLM2's vocabulary; intermediate_size is each
    expert's."""

    hidden_size: int = 1536
    intermediate_size: int = 512
    num_hidden_layers: int = 32
    num_attention_heads: int = 24
    num_key_value_heads: int = 8
    num_local_experts: int = 40
    num_experts_per_tok: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    embedding_multiplier: float = 12.0
    residual_multiplier: float = 0.22
    attention_multiplier: float = 0.015625
    logits_scaling: float = 6.0


GRANITE_3B_A800M = Shape()


def write_config(folder: pathlib.Path, shape: Shape, v: dict) -> None:
    from transformers import GraniteMoeConfig

    GraniteMoeConfig(
        **asdict(shape),
        vocab_size=len(v["tokens"]),
        architectures=["GraniteMoeForCausalLM"],
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=True,
        bos_token_id=v["bos"],
        eos_token_id=v["eos"],
        pad_token_id=v["eos"],
        torch_dtype="bfloat16",
    ).save_pretrained(folder)


def _layer_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """The checkpoint's names (transformers renames them on loading, conversion_mapping.py's
    "granitemoe"; llama.cpp's converter reads these)."""
    h, f, e = shape.hidden_size, shape.intermediate_size, shape.num_local_experts
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    return {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "block_sparse_moe.input_linear.weight": (e, 2 * f, h),  # [gate; up] of each expert
        "block_sparse_moe.output_linear.weight": (e, h, f),
        "block_sparse_moe.router.layer.weight": (e, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }


def write_weights(folder: pathlib.Path, shape: Shape, vocab_size: int, seed: int = 0) -> None:
    """One shard a layer, plus one for the embeddings and norm (the head is the embeddings)."""
    n = shape.num_hidden_layers
    shards: list[dict[str, tuple[int, ...]]] = [
        {f"model.layers.{i}.{k}": d for k, d in _layer_shapes(shape).items()} for i in range(n)
    ]
    h = shape.hidden_size
    shards.append({"model.embed_tokens.weight": (vocab_size, h), "model.norm.weight": (h,)})
    write_shards(folder, shards, seed)


def write_hf_folder(folder: pathlib.Path, shape: Shape = GRANITE_3B_A800M, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = _smollm2_vocab()  # read once: the tokenizer, the config and the embeddings' size
    write_tokenizer(folder, vocab)
    write_config(folder, shape, vocab)
    write_weights(folder, shape, len(vocab["tokens"]), seed)


def make(out: pathlib.Path, shape: Shape, keep: bool, threads: int) -> pathlib.Path:
    return make_gguf(out, NAME, shape, write_hf_folder, keep, threads)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "bench.make_moe", __doc__ or "", NAME, GRANITE_3B_A800M, write_hf_folder)


if __name__ == "__main__":
    sys.exit(main())
