"""EmbeddingGemma (google/embeddinggemma-300m's architecture) from a sentence-transformers folder
or from a GGUF as llama.cpp's convert_hf_to_gguf.py writes it -> GemmaEncoder
(model/layers/gemma_encoder.py).

Folder: config.json (model_type gemma3_text with use_bidirectional_attention), *.safetensors of
transformers' Gemma3TextModel (names with or without the "model." prefix), tokenizer.json;
modules.json: Transformer, Pooling (mean only), Dense layers (no bias, identity activation: each
its config.json and model.safetensors `linear.weight`), Normalize.
GGUF: arch `gemma-embedding`, norms stored as (1 + w), `dense_2` / `dense_3` tensors (the
converter's --sentence-transformers-dense-modules), `pooling_type` 1 (mean); the sliding layers
follow llama.cpp's gemma3 pattern (every 6th global) with `rope.freq_base_swa`; vectors normalised,
as llama.cpp's server gives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvcache.rope import RopeConfig
from model.arch import ModelArgs, gemma3
from model.arch.embedding_gemma import LAYER_KEYS, NORM_KEYS, GemmaEncoderArgs
from model.errors import ModelLoadError
from model.load.hf import read_safetensors
from model.load.hf_config import read_args, read_json
from model.load.tokenizer import Tokenizer

GGUF_ARCH = "gemma-embedding"
# sentence-transformers' Dense activation that is no activation
_IDENTITY = "torch.nn.modules.linear.Identity"
_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "post_attn_norm": "post_attention_layernorm",  # Gemma's: on the attention OUTPUT
    "ffn_norm": "pre_feedforward_layernorm",
    "w1": "mlp.gate_proj",
    "w3": "mlp.up_proj",
    "w2": "mlp.down_proj",
    "post_ffn_norm": "post_feedforward_layernorm",
}
_GGUF_LAYER = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm",
    "ffn_norm": "ffn_norm",
    "w1": "ffn_gate",
    "w3": "ffn_up",
    "w2": "ffn_down",
    "post_ffn_norm": "post_ffw_norm",
}
assert set(_HF_LAYER) == set(_GGUF_LAYER) == set(LAYER_KEYS)


def is_gemma_folder(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "gemma3_text" and bool(
        config.get("use_bidirectional_attention")
    )


def read_gemma_folder(folder: Path) -> tuple[GemmaEncoderArgs, dict[str, torch.Tensor]]:
    """A sentence-transformers EmbeddingGemma folder's args and weights (ours, float32)."""
    config = read_json(folder / "config.json")
    if not is_gemma_folder(config):
        raise ModelLoadError(f"{folder}: not a gemma3_text model with bidirectional attention.")
    model = read_args(config, folder, allow_bidirectional=True)
    raw = read_safetensors(sorted(folder.glob("*.safetensors")), folder)
    raw = {k.removeprefix("model."): v for k, v in raw.items()}
    names = {"tok_embeddings": "embed_tokens.weight", "norm": "norm.weight"}
    for i in range(model.n_layers):
        for key, theirs in _HF_LAYER.items():
            names[f"layers.{i}.{key}"] = f"layers.{i}.{theirs}.weight"
    weights = {}
    for ours, theirs in names.items():
        if theirs not in raw:
            raise ModelLoadError(f"{folder}: tensor {theirs} is missing.")
        w = raw[theirs].float()
        # NOTE: Gemma3RMSNorm scales by (1 + w); llama.cpp's converter stores 1 + w
        weights[ours] = w + 1.0 if ours == "norm" or ours.rsplit(".", 1)[-1] in NORM_KEYS else w
    dense, normalize = _st_modules(folder, weights)
    # sentence-transformers' max_seq_length (6 keeps it as the tokenizer's model_max_length)
    max_seq = read_json(folder / "sentence_bert_config.json").get("max_seq_length") or read_json(
        folder / "tokenizer_config.json"
    ).get("model_max_length")
    n_ctx = min(int(max_seq or model.n_ctx_train), model.n_ctx_train)
    return GemmaEncoderArgs(model, tuple(dense), normalize, n_ctx), weights


def _st_modules(
    folder: Path, weights: dict[str, torch.Tensor]
) -> tuple[list[tuple[int, int]], bool]:
    """modules.json: Transformer, then mean Pooling, Dense layers and Normalize, in that order;
    the Dense weights go into `weights` as dense.{j}. Without modules.json: mean, normalised."""
    modules = read_json(folder / "modules.json") if (folder / "modules.json").is_file() else None
    if not isinstance(modules, list):
        return [], True
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    order = ["Transformer", "Pooling"] + ["Dense"] * kinds.count("Dense")
    if kinds not in (order, [*order, "Normalize"]):
        raise ModelLoadError(
            f"{folder}: modules {kinds} are not supported (Transformer, Pooling, Dense..., "
            "Normalize)."
        )
    dense: list[tuple[int, int]] = []
    for module, kind in zip(modules, kinds, strict=True):
        sub = folder / module.get("path", "")
        cfg = read_json(sub / "config.json")
        if kind == "Pooling":
            # sentence-transformers 6 writes one "pooling_mode" string, older ones flags
            flags = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
            mode = cfg.get("pooling_mode", flags)
            if mode not in ("mean", ["pooling_mode_mean_tokens"]):
                raise ModelLoadError(f"{sub}: pooling {mode} is not supported (mean only).")
        if kind != "Dense":
            continue
        if cfg.get("bias", True) or cfg.get("activation_function") != _IDENTITY:
            raise ModelLoadError(
                f"{sub}: a Dense layer with a bias or an activation "
                f"({cfg.get('activation_function')}) is not supported."
            )
        w = read_safetensors([sub / "model.safetensors"], sub).get("linear.weight")
        shape = (int(cfg["out_features"]), int(cfg["in_features"]))
        if w is None or tuple(w.shape) != shape:
            raise ModelLoadError(f"{sub}: linear.weight is missing or not of shape {shape}.")
        weights[f"dense.{len(dense)}"] = w.float()
        dense.append((shape[1], shape[0]))
    return dense, kinds[-1] == "Normalize"


def read_gemma_gguf(
    reader: Any, path: Path
) -> tuple[GemmaEncoderArgs, dict[str, torch.Tensor], Tokenizer]:
    """A `gemma-embedding` GGUF (model.load.gguf.open_gguf's reader)."""
    arch = GGUF_ARCH

    def field(key: str, default: Any = None) -> Any:
        value = reader.fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: the GGUF lacks {arch}.{key}.")
        return value

    if int(field("pooling_type", 1)) != 1:
        raise ModelLoadError(f"{path}: {arch}.pooling_type {field('pooling_type')}: mean (1) only.")
    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: {t.name} ({t.tensor_type.name}): {e}.") from e
        raw[t.name] = torch.from_numpy(w.reshape(tuple(reversed(t.shape))).copy())
    if "token_embd.weight" not in raw:
        raise ModelLoadError(f"{path}: the GGUF has no token_embd.weight.")
    dim = int(field("embedding_length"))
    n_heads = int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", dim // n_heads))
    n_layers = int(field("block_count"))
    model = ModelArgs(
        arch="gemma3_text",
        vocab_size=int(raw["token_embd.weight"].shape[0]),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        hidden_dim=int(field("feed_forward_length")),
        norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=RopeConfig(float(field("rope.freq_base", 1e6)), head_dim, "neox"),
        n_ctx_train=int(field("context_length")),
        block=gemma3.BLOCK,
        # NOTE: as llama.cpp's gemma-embedding: every 6th layer global and query_pre_attn_scalar
        # head_dim (neither is in the file); the local RoPE base 10,000 unless the file says
        windows=gemma3.windows(n_layers, int(field("attention.sliding_window"))),
        rope_swa=RopeConfig(float(field("rope.freq_base_swa", gemma3.LOCAL_ROPE_BASE)), head_dim),
        attn_scale=head_dim**-0.5,
    )
    names = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight"}
    for i in range(n_layers):
        for key, theirs in _GGUF_LAYER.items():
            names[f"layers.{i}.{key}"] = f"blk.{i}.{theirs}.weight"
    dense: list[tuple[int, int]] = []
    for j, name in enumerate(t for t in ("dense_2.weight", "dense_3.weight") if t in raw):
        names[f"dense.{j}"] = name
        dense.append((int(raw[name].shape[1]), int(raw[name].shape[0])))
    missing = [theirs for theirs in names.values() if theirs not in raw]
    if missing:
        raise ModelLoadError(f"{path}: the GGUF lacks {', '.join(missing[:4])}.")
    weights = {ours: raw[theirs] for ours, theirs in names.items()}
    fields = {k: v for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    tokenizer = Tokenizer.from_gguf(fields, path, arch)
    if fields.get("tokenizer.ggml.add_eos_token") and tokenizer.eos_id is not None:
        _append_eos(tokenizer)
    args = GemmaEncoderArgs(model, tuple(dense), True, model.n_ctx_train)
    return args, weights, tokenizer


def _append_eos(tokenizer: Tokenizer) -> None:
    """<bos> text <eos>, as llama.cpp tokenizes with add_bos / add_eos (EmbeddingGemma's)."""
    from tokenizers.processors import TemplateProcessing

    assert tokenizer.eos_id is not None
    eos = tokenizer.id_to_token(tokenizer.eos_id)
    specials = [(eos, tokenizer.eos_id)]
    single = f"$A {eos}"
    if tokenizer.bos_id is not None and tokenizer.encode("")[:1] == [tokenizer.bos_id]:
        bos = tokenizer.id_to_token(tokenizer.bos_id)
        specials.append((bos, tokenizer.bos_id))
        single = f"{bos} {single}"
    tokenizer.hf.post_processor = TemplateProcessing(single=single, special_tokens=specials)
