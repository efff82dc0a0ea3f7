"""EmbeddingGemma (`gemma-embedding`): Gemma 3's blocks read with bidirectional attention for
/v1/embeddings (model/layers/gemma_encoder.py), then sentence-transformers' mean Pooling, its
Dense layers and Normalize. Its sizes (GemmaEncoderArgs over the Gemma 3 text model's
ModelArgs) and the names of a layer's weights; model/load/gemma_encoder.py reads them from a
sentence-transformers folder or llama.cpp's GGUF. Not a Family: an encoder keeps no KV cells.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.arch.args import ModelArgs

# per layer, our names (model/arch's layer_weights for a Gemma 3 block)
LAYER_KEYS = (
    "attn_norm",
    "wq",
    "wk",
    "wv",
    "wo",
    "q_norm",
    "k_norm",
    "post_attn_norm",
    "ffn_norm",
    "w1",
    "w3",
    "w2",
    "post_ffn_norm",
)
NORM_KEYS = frozenset(k for k in LAYER_KEYS if k.endswith("norm"))


@dataclass(frozen=True, slots=True)
class GemmaEncoderArgs:
    model: ModelArgs  # the Gemma 3 text model: sizes, windows, RoPE per layer, attention scale
    dense: tuple[tuple[int, int], ...]  # sentence-transformers' Dense layers: (in, out) each
    normalize: bool  # L2-normalise the last vector (sentence-transformers' Normalize)
    n_ctx: int  # the longest input served
    arch: str = "gemma-embedding"
    pooling: str = "mean"

    @property
    def n_layers(self) -> int:
        return self.model.n_layers

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def dim(self) -> int:
        """The length of the vectors served: the last Dense layer's output, else the model's."""
        return self.dense[-1][1] if self.dense else self.model.dim

    def check(self) -> None:
        m = self.model
        if len(m.windows) not in (0, m.n_layers):
            raise ValueError(f"{len(m.windows)} windows for {m.n_layers} layers")
        width = m.dim
        for n_in, n_out in self.dense:
            if n_in != width:
                raise ValueError(f"a Dense layer takes {n_in} features where {width} come")
            width = n_out
        if not 1 <= self.n_ctx <= m.n_ctx_train:
            raise ValueError(f"context {self.n_ctx} is past the {m.n_ctx_train} positions")
