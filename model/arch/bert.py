"""BERT (`bert`, e.g. all-MiniLM-L6-v2): an encoder for /v1/embeddings (model/layers/encoder.py),
absolute positions, post-norm blocks, then sentence-transformers' pooling and normalisation.
Its sizes (EncoderArgs) and Hugging Face BertModel's tensor names, which llama.cpp's `bert`
GGUF layout maps onto (model/load/encoder.py reads both, model/load/bert_to_gguf.py writes
one). Not a Family: an encoder keeps no KV cells and is served on /v1/embeddings only.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLINGS = ("mean", "cls", "last")


@dataclass(frozen=True, slots=True)
class EncoderArgs:
    arch: str  # "bert"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    n_positions: int  # rows of the position table
    n_token_types: int
    norm_eps: float
    pooling: str  # one of POOLINGS
    normalize: bool  # L2-normalise the pooled vector
    n_ctx: int  # the longest input served (sentence-transformers' max_seq_length, else n_positions)

    def check(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling {self.pooling!r}: one of {', '.join(POOLINGS)}")
        if self.dim % self.n_heads:
            raise ValueError(f"hidden size {self.dim} is not a multiple of {self.n_heads} heads")
        if not 1 <= self.n_ctx <= self.n_positions:
            raise ValueError(f"context {self.n_ctx} is past the {self.n_positions} positions")


# weight names (Hugging Face BertModel's, without the "bert." prefix) of layer i
def layer_names(i: int) -> dict[str, str]:
    p = f"encoder.layer.{i}."
    return {
        "wq": p + "attention.self.query",
        "wk": p + "attention.self.key",
        "wv": p + "attention.self.value",
        "wo": p + "attention.output.dense",
        "attn_norm": p + "attention.output.LayerNorm",
        "w_up": p + "intermediate.dense",
        "w_down": p + "output.dense",
        "ffn_norm": p + "output.LayerNorm",
    }


EMBED_NAMES = {
    "tok_embd": "embeddings.word_embeddings.weight",
    "pos_embd": "embeddings.position_embeddings.weight",
    "type_embd": "embeddings.token_type_embeddings.weight",
    "norm": "embeddings.LayerNorm",
}


def weight_names(args: EncoderArgs) -> list[str]:
    """Every tensor the encoder reads: Linear/LayerNorm modules as .weight and .bias."""
    names = [EMBED_NAMES[k] for k in ("tok_embd", "pos_embd", "type_embd")]
    names += [EMBED_NAMES["norm"] + ".weight", EMBED_NAMES["norm"] + ".bias"]
    for i in range(args.n_layers):
        for module in layer_names(i).values():
            names += [module + ".weight", module + ".bias"]
    return names
