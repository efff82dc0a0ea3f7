"""Write a Hugging Face / sentence-transformers BERT folder as a GGUF in llama.cpp's `bert` layout
(model/load/hf_to_gguf.py dispatches here for model_type "bert").

Follows llama.cpp's convert_hf_to_gguf BertModel: tensor names from gguf-py's BERT map (the
pooler and the MLM head dropped), `bert.*` hyper-parameters with attention.causal false, the
sentence-transformers pooling as `bert.pooling_type`, and the WordPiece vocabulary in llama.cpp's
phantom-space spelling (model/load/wordpiece.py reads it back) with [CLS] / [SEP] as BOS / EOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from model.arch.bert import weight_names
from model.errors import ModelLoadError
from model.load.encoder import read_folder
from model.load.wordpiece import PHANTOM

_POOLING = {
    "mean": gguf.PoolingType.MEAN,
    "cls": gguf.PoolingType.CLS,
    "last": gguf.PoolingType.LAST,
}


def convert_bert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    args, weights = read_folder(folder)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, args.n_layers)
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_name(folder.name)
    writer.add_context_length(args.n_positions)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_block_count(args.n_layers)
    writer.add_head_count(args.n_heads)
    writer.add_layer_norm_eps(args.norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(_POOLING[args.pooling])
    _write_vocab(writer, folder, args.n_token_types)
    for hf_name in weight_names(args):
        module, suffix = hf_name.rsplit(".", 1)
        w = weights[hf_name].numpy()
        f16 = outtype == "f16" and w.ndim == 2 and suffix == "weight"
        writer.add_tensor(
            f"{names.get_name(module)}.{suffix}", w.astype(np.float16 if f16 else np.float32)
        )
    f16 = outtype == "f16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_vocab(writer: gguf.GGUFWriter, folder: Path, n_token_types: int) -> None:
    file = folder / "tokenizer.json"
    spec = json.loads(file.read_text()) if file.is_file() else {}
    model = spec.get("model", {})
    if model.get("type") != "WordPiece":
        raise ModelLoadError(f"{folder}: tokenizer.json has no WordPiece model to convert.")
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    types = [control if i in special.values() else normal for i in range(len(tokens))]
    spelled = [
        t if kind == control else t[2:] if t.startswith("##") else PHANTOM + t
        for t, kind in zip(tokens, types, strict=True)
    ]
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(spelled)
    writer.add_token_types(types)
    writer.add_token_type_count(n_token_types)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    ids = {
        k: special.get(config.get(f"{k}_token") or "") for k in ("unk", "cls", "sep", "pad", "mask")
    }
    if ids["unk"] is None or ids["cls"] is None or ids["sep"] is None:
        raise ModelLoadError(f"{folder}: tokenizer_config.json lacks unk / cls / sep tokens.")
    writer.add_unk_token_id(ids["unk"])
    writer.add_bos_token_id(ids["cls"])  # llama.cpp's BERT: BOS is [CLS], EOS and SEP [SEP]
    writer.add_eos_token_id(ids["sep"])
    writer.add_sep_token_id(ids["sep"])
    if ids["pad"] is not None:
        writer.add_pad_token_id(ids["pad"])
    if ids["mask"] is not None:
        writer.add_mask_token_id(ids["mask"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
