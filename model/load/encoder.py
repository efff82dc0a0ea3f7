"""Encoder embedding models (BERT) from a Hugging Face / sentence-transformers folder or a GGUF
in llama.cpp's `bert` layout -> LoadedEncoder (model/layers/encoder.py).

Folder: config.json (model_type "bert"), *.safetensors, tokenizer.json; sentence-transformers'
modules.json names the Pooling folder (its config.json: mean / CLS / last token) and whether a
Normalize module follows (then the vectors are L2-normalised); sentence_bert_config.json's
max_seq_length bounds the input. Without modules.json: mean pooling, normalised (OpenAI's
vectors are).
GGUF: llama.cpp's tensor names (gguf-py's BERT map), `bert.*` hyper-parameters, `bert.pooling_type`
(llama.cpp's enum: 1 mean, 2 CLS, 3 last) and a WordPiece vocabulary (model/load/wordpiece.py);
normalised, as llama.cpp's server does for /v1/embeddings.
Shortened (Matryoshka) vectors: as a folder's config.json declares them (model/load/matryoshka.py);
a GGUF declares none.
EmbeddingGemma (a bidirectional gemma3_text folder, a `gemma-embedding` GGUF): read by
model/load/gemma_encoder.py into model/layers/gemma_encoder.py's GemmaEncoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from model.arch.bert import EncoderArgs, weight_names
from model.arch.embedding_gemma import GemmaEncoderArgs
from model.errors import ModelLoadError
from model.layers.encoder import Encoder
from model.layers.gemma_encoder import GemmaEncoder
from model.load.dtypes import resolve_dtype
from model.load.gemma_encoder import GGUF_ARCH, is_gemma_folder, read_gemma_folder, read_gemma_gguf
from model.load.gguf import open_gguf
from model.load.hf import read_safetensors
from model.load.hf_config import read_json
from model.load.matryoshka import Matryoshka, read_matryoshka
from model.load.tokenizer import Tokenizer
from model.load.wordpiece import wordpiece_from_gguf

ENCODER_ARCHS = ("bert",)
# llama.cpp's enum llama_pooling_type (gguf.PoolingType)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_ST_POOLING = {  # sentence-transformers' Pooling config flag -> ours
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_MODE = {"mean": "mean", "cls": "cls", "lasttoken": "last"}  # sentence-transformers 6's names


@dataclass(slots=True)
class LoadedEncoder:
    path: Path
    name: str
    config: EncoderArgs | GemmaEncoderArgs
    encoder: Encoder | GemmaEncoder
    tokenizer: Tokenizer
    matryoshka: Matryoshka | None = None  # the shortened vectors it serves; None: none


def is_encoder(path: str | Path) -> bool:
    """Whether `path` (a folder or a GGUF file) holds an encoder embedding model."""
    path = Path(path)
    if path.is_dir():
        config = read_json(path / "config.json")
        return config.get("model_type") in ENCODER_ARCHS or is_gemma_folder(config)
    if path.is_file():
        try:
            reader = open_gguf(path)
        except ModelLoadError:
            return False
        return reader.fields.get("general.architecture") in (*ENCODER_ARCHS, GGUF_ARCH)
    return False


def load_encoder(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> LoadedEncoder:
    """Raises ModelLoadError (one sentence naming the file) for anything it cannot serve."""
    path = Path(path)
    args: EncoderArgs | GemmaEncoderArgs
    if path.is_dir() and is_gemma_folder(read_json(path / "config.json")):
        args, weights = read_gemma_folder(path)
        tokenizer = Tokenizer.from_hf_dir(path)
    elif path.is_dir():
        args, weights = read_folder(path)
        tokenizer = Tokenizer.from_hf_dir(path)
    elif path.is_file() and open_gguf(path).fields.get("general.architecture") == GGUF_ARCH:
        args, weights, tokenizer = read_gemma_gguf(open_gguf(path), path)
    elif path.is_file():
        args, weights, tokenizer = _read_gguf(path)
    else:
        raise ModelLoadError(f"{path}: no such model file or folder.")
    # NOTE: a sentence-transformers tokenizer.json pads and truncates (to 128 for
    # all-MiniLM-L6-v2): an input past the context is refused, never silently cut
    tokenizer.hf.no_padding()
    tokenizer.hf.no_truncation()
    if args.vocab_size < tokenizer.vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{args.vocab_size}."
        )
    torch_dtype = resolve_dtype(dtype)
    try:
        args.check()
        cast = {k: v.to(torch_dtype) for k, v in weights.items()}
        encoder: Encoder | GemmaEncoder = (
            GemmaEncoder(args, cast) if isinstance(args, GemmaEncoderArgs) else Encoder(args, cast)
        ).to(device)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: {e}.") from e
    matryoshka = None
    if path.is_dir():
        config = path / "config.json"
        matryoshka = read_matryoshka(read_json(config), args.dim, config)
    name = path.stem if path.is_file() else path.name
    return LoadedEncoder(path, name, args, encoder, tokenizer, matryoshka)


def read_folder(folder: Path) -> tuple[EncoderArgs, dict[str, torch.Tensor]]:
    """A BERT folder's EncoderArgs and its weights (Hugging Face names, float32)."""
    config = read_json(folder / "config.json")
    if config.get("model_type") not in ENCODER_ARCHS:
        raise ModelLoadError(f"{folder}: model_type {config.get('model_type')!r} is no encoder.")
    act = config.get("hidden_act", "gelu")
    if act != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(
            f"{folder}: only BERT with gelu and absolute positions is supported "
            f"(hidden_act {act!r}, position_embedding_type "
            f"{config.get('position_embedding_type')!r})."
        )
    pooling, normalize = _st_pooling(folder)
    n_positions = int(config["max_position_embeddings"])
    max_seq = read_json(folder / "sentence_bert_config.json").get("max_seq_length")
    args = EncoderArgs(
        arch="bert",
        vocab_size=int(config["vocab_size"]),
        dim=int(config["hidden_size"]),
        n_layers=int(config["num_hidden_layers"]),
        n_heads=int(config["num_attention_heads"]),
        ffn_dim=int(config["intermediate_size"]),
        n_positions=n_positions,
        n_token_types=int(config.get("type_vocab_size", 2)),
        norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        pooling=pooling,
        normalize=normalize,
        n_ctx=min(int(max_seq or n_positions), n_positions),
    )
    raw = read_safetensors(sorted(folder.glob("*.safetensors")), folder)
    raw = {key.removeprefix("bert."): value for key, value in raw.items()}
    return args, _pick(raw, args, folder)


def _st_pooling(folder: Path) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' modules.json; none: mean, normalised."""
    modules = read_json(folder / "modules.json") if (folder / "modules.json").is_file() else None
    if not isinstance(modules, list):
        return "mean", True
    pooling = "mean"
    for module in modules:
        if module.get("type", "").endswith(".Pooling"):
            cfg = read_json(folder / module.get("path", "") / "config.json")
            # sentence-transformers 6 writes one "pooling_mode" string, older ones a flag each
            flags = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
            one = cfg.get("pooling_mode")
            modes = [m for f, m in _ST_POOLING.items() if f in flags or _ST_MODE.get(one) == m]
            if len(modes) != 1 or len(flags) + (one is not None) != 1:
                raise ModelLoadError(
                    f"{folder}: pooling {one or flags or 'none'} is not supported (one of mean, "
                    "cls, lasttoken: pooling_mode, or pooling_mode_mean_tokens, "
                    "pooling_mode_cls_token, pooling_mode_lasttoken)."
                )
            pooling = modes[0]
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    return pooling, normalize


def _pick(raw: dict[str, torch.Tensor], args: EncoderArgs, where: Path) -> dict[str, torch.Tensor]:
    names = weight_names(args)
    missing = [n for n in names if n not in raw]
    if missing:
        raise ModelLoadError(f"{where}: the weights lack {', '.join(missing[:4])}.")
    return {n: raw[n].float() for n in names}


def _read_gguf(path: Path) -> tuple[EncoderArgs, dict[str, torch.Tensor], Tokenizer]:
    reader = open_gguf(path)
    arch = reader.fields.get("general.architecture")
    if arch not in ENCODER_ARCHS:
        raise ModelLoadError(f"{path}: architecture {arch!r} is no encoder.")

    def field(key: str, default: Any = None) -> Any:
        value = reader.fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: the GGUF lacks {arch}.{key}.")
        return value

    if field("attention.causal", False):
        raise ModelLoadError(f"{path}: {arch}.attention.causal is true; an encoder is not causal.")
    pooling_type = int(field("pooling_type", 1))
    if pooling_type not in GGUF_POOLING:
        raise ModelLoadError(
            f"{path}: {arch}.pooling_type {pooling_type} is not supported (1 mean, 2 CLS, 3 last)."
        )
    tok_embd = reader.tensor("token_embd.weight")
    if tok_embd is None:
        raise ModelLoadError(f"{path}: the GGUF has no token_embd.weight.")
    n_ctx = int(field("context_length"))
    args = EncoderArgs(
        arch=arch,
        vocab_size=int(tok_embd.shape[1]),
        dim=int(field("embedding_length")),
        n_layers=int(field("block_count")),
        n_heads=int(field("attention.head_count")),
        ffn_dim=int(field("feed_forward_length")),
        n_positions=n_ctx,
        n_token_types=int(reader.fields.get("tokenizer.ggml.token_type_count", 2)),
        norm_eps=float(field("attention.layer_norm_epsilon")),
        pooling=GGUF_POOLING[pooling_type],
        normalize=True,
        n_ctx=n_ctx,
    )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, args.n_layers)
    raw: dict[str, torch.Tensor] = {}
    for hf_name in weight_names(args):
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(module)
        t = reader.tensor(f"{gguf_name}.{suffix}") if gguf_name else None
        if t is None:
            raise ModelLoadError(f"{path}: the GGUF lacks the tensor for {hf_name}.")
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: {t.name} ({t.tensor_type.name}): {e}.") from e
        raw[hf_name] = torch.from_numpy(w.reshape(tuple(reversed(t.shape))).copy())
    fields = {k: v for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    if fields.get("tokenizer.ggml.model") != "bert":
        raise ModelLoadError(
            f"{path}: tokenizer model {fields.get('tokenizer.ggml.model')!r}; an encoder GGUF "
            "needs llama.cpp's WordPiece ('bert')."
        )
    return args, _pick(raw, args, path), wordpiece_from_gguf(fields, path)
