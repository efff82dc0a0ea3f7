"""A tiny random BERT (transformers' BertModel) written as a sentence-transformers folder, with a
WordPiece tokenizer trained on a small corpus, for the encoder tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.processors import TemplateProcessing

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today? "
    "Embeddings turn sentences into vectors; similar meanings land close together. "
    "Café naïve résumé 0123456789 tokenization unaffable playing played player."
)
_POOL_FLAGS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "last": "pooling_mode_lasttoken",
    "max": "pooling_mode_max_tokens",
}


def _wordpiece() -> Tokenizer:
    """A fixed vocabulary (trainers are not deterministic): the specials, every character of the
    normalised corpus alone and as a continuation, and its words."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    text = tok.normalizer.normalize_str(_CORPUS)
    words = sorted({w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)})
    chars = sorted(set(text) - {" "})
    pieces = [*SPECIALS, *chars, *(f"##{c}" for c in chars), *words, "##ing", "##ed", "##er"]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    tok.model = models.WordPiece(vocab, unk_token="[UNK]")
    tok.add_special_tokens(list(SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def write_tiny_bert(
    folder: Path,
    pooling: str | None = "mean",
    normalize: bool = True,
    seed: int = 0,
    max_seq_length: int | None = 48,
) -> Path:
    """`pooling` None: a plain BertModel folder (no sentence-transformers modules)."""
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tok = _wordpiece()
    tok.save(str(folder / "tokenizer.json"))
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=True)
    with torch.no_grad():  # LayerNorms away from their 1 / 0 init, so a mix-up shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok_config = {f"{k}_token": f"[{k.upper()}]" for k in ("pad", "unk", "cls", "sep", "mask")}
    tok_config["do_lower_case"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if pooling is None:
        return folder
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if normalize else [])
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": paths[i], "type": f"sentence_transformers.models.{k}"}
        for i, k in enumerate(kinds)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: mode == pooling for mode, flag in _POOL_FLAGS.items()}
    pool_config = {"word_embedding_dimension": 32, **flags}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool_config))
    if max_seq_length is not None:
        st = {"max_seq_length": max_seq_length, "do_lower_case": False}
        (folder / "sentence_bert_config.json").write_text(json.dumps(st))
    return folder


def reference_vectors(
    folder: Path, inputs: list[list[int]], pooling: str, normalize: bool
) -> np.ndarray:
    """transformers' BertModel over each input alone (float32), pooled and normalised in numpy."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(folder)).eval()
    out = []
    with torch.no_grad():
        for ids in inputs:
            h = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
            v = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
            out.append(v / np.linalg.norm(v) if normalize else v)
    return np.array(out)
