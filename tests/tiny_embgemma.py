"""A tiny random EmbeddingGemma (transformers' Gemma3TextModel with use_bidirectional_attention)
written by sentence-transformers itself as its folder: 0_Transformer (the folder's root),
1_Pooling (mean), 2_Dense and 3_Dense (no bias, identity), 4_Normalize, as
google/embeddinggemma-300m lays them out; the sizes are tiny (dim 32, 6 layers: 5 sliding with
window 8, i.e. 4 tokens each side, then 1 global, llama.cpp's gemma-embedding pattern)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers.processors import TemplateProcessing

from tests.tiny_models import _tiny_tokenizer

SPECIALS = ("<pad>", "<eos>", "<bos>")
WINDOW = 8  # config.json's sliding_window: |q - k| <= 4 in the sliding layers
DIM = 32


def write_tiny_embgemma(
    folder: Path, seed: int = 0, max_seq_length: int = 96, matryoshka: list[int] | None = None
) -> Path:
    """The sentence-transformers folder of a random EmbeddingGemma-shaped model; returns it.
    `matryoshka`: config.json's matryoshka_dimensions (vLLM's key; google's folder has none)."""
    import pytest
    from sentence_transformers import SentenceTransformer
    from transformers import Gemma3TextConfig, Gemma3TextModel, PreTrainedTokenizerFast

    try:  # sentence-transformers >= 6; before, sentence_transformers.models
        from sentence_transformers.sentence_transformer.modules import (
            Dense,
            Normalize,
            Pooling,
            Transformer,
        )
    except ImportError:
        from sentence_transformers.models import Dense, Normalize, Pooling, Transformer
    if not hasattr(Gemma3TextConfig(), "use_bidirectional_attention"):
        pytest.skip("transformers without Gemma 3's use_bidirectional_attention (>= 4.56 has it)")

    hf = folder.parent / f"{folder.name}-hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok = _tiny_tokenizer(SPECIALS)
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    # NOTE: EmbeddingGemma's tokenizer writes <bos> text <eos>
    tok.post_processor = TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(str(hf))
    config = Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        hidden_size=DIM,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,  # head_dim, as the real model (a GGUF does not store it)
        sliding_window=WINDOW,
        use_bidirectional_attention=True,
        max_position_embeddings=128,
        pad_token_id=tok.token_to_id("<pad>"),
        bos_token_id=bos,
        eos_token_id=eos,
        **({"matryoshka_dimensions": matryoshka} if matryoshka else {}),
    )
    torch.manual_seed(seed)
    model = Gemma3TextModel(config)
    with torch.no_grad():  # the (1 + w) norms away from their 0 init, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(hf), safe_serialization=True)

    transformer = Transformer(str(hf), max_seq_length=max_seq_length)
    pooling = Pooling(DIM, pooling_mode="mean")
    dense = [
        Dense(DIM, 4 * DIM, bias=False, activation_function=torch.nn.Identity()),
        Dense(4 * DIM, DIM, bias=False, activation_function=torch.nn.Identity()),
    ]
    st = SentenceTransformer(modules=[transformer, pooling, *dense, Normalize()], device="cpu")
    st.save(str(folder))
    return folder


def reference_vectors(
    folder: Path, texts: list[str], truncate_dim: int | None = None
) -> np.ndarray:
    """sentence-transformers' own vectors of `texts`, each encoded alone, float32; cut by its
    `truncate_dim` (after the Normalize module: not unit vectors again)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    st.float()
    return np.concatenate(
        [st.encode([t], convert_to_numpy=True, truncate_dim=truncate_dim) for t in texts]
    )


def module_types(folder: Path) -> list[str]:
    return [m["type"].rsplit(".", 1)[-1] for m in json.loads((folder / "modules.json").read_text())]
