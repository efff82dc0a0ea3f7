"""A tiny HF folder (tests/tiny_models.py) converted to GGUF the way llama.cpp's
convert_hf_to_gguf.py does, for tests of the GGUF loader and the servers that read it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from tokenizers import Tokenizer

from model.load.chat_template import CHATML_TEMPLATE

# llama.cpp's LLAMA_ROPE_TYPE_NORM archs: Q and K stored permuted for interleaved-pair RoPE
PERMUTED_ARCHS = ("llama", "smollm3", "granite", "granitemoe")


def permute_for_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (HF rotate-half -> interleaved)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


SPM_PIECES = [
    "▁",
    "e",
    "t",
    "h",
    "o",
    "l",
    "w",
    "r",
    "d",
    "a",
    "n",
    "s",
    "i",
    "u",
    "m",
    "y",
    ",",
    ".",
    "!",
    "?",
    "▁t",
    "he",
    "▁the",
    "ll",
    "▁h",
    "▁he",
    "llo",
    "▁hello",
    "▁w",
    "or",
    "▁wor",
    "ld",
    "▁world",
    "in",
    "▁a",
    "an",
    "▁an",
    "is",
    "▁is",
    "▁th",
    "▁i",
    "▁s",
    "▁m",
    "my",
    "▁my",
    "▁▁",
    "▁▁▁▁",
]


def _add_spm_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A SentencePiece-BPE vocab (llama 2 / TinyLlama style): <unk> <s> </s>, 256 byte tokens,
    then pieces scored best-first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(SPM_PIECES)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)


def write_tiny_gguf(
    path: str | Path,
    hf_folder: str | Path,
    arch: str = "llama",
    skip: tuple[str, ...] = (),
    spm_tokenizer: bool = False,
    qtype: str = "F32",
    fim_ids: dict[str, int] | None = None,
    extra: Callable[[gguf.GGUFWriter], dict[str, np.ndarray]] | None = None,
) -> Path:
    """Convert a tiny HF folder (from write_tiny_llama) to GGUF the way llama.cpp does (F32,
    Q/K permuted, gpt2 tokenizer, or a small SentencePiece vocab with `spm_tokenizer`);
    `skip` leaves out tensors by GGUF name; `qtype` (F16, BF16, Q8_0, Q4_0, Q4_1, ...) is
    the type of the 2-D weights, quantized with gguf.quants; `fim_ids` ("pre", "suf", ...)
    are written as tokenizer.ggml.fim_*_token_id; `extra` writes more metadata and returns
    more tensors by GGUF name (tests/tiny_moe.py: the experts)."""
    path, hf_folder = Path(path), Path(hf_folder)
    config = json.loads((hf_folder / "config.json").read_text())
    spec = json.loads((hf_folder / "tokenizer.json").read_text())
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    # (MixtralConfig writes head_dim: null)
    if (config.get("head_dim") or config["hidden_size"] // n_heads) != config[
        "hidden_size"
    ] // n_heads:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if spm_tokenizer:
        _add_spm_tokenizer(writer)
    else:
        vocab = Tokenizer.from_file(str(hf_folder / "tokenizer.json")).get_vocab(True)
        tokens = sorted(vocab, key=vocab.__getitem__)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        specials = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
        writer.add_token_types([3 if t in specials else 1 for t in tokens])
        merges = spec["model"]["merges"]
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_eos_token_id(config["eos_token_id"])
        writer.add_add_bos_token(False)
    for kind, token_id in (fim_ids or {}).items():
        writer.add_uint32(f"tokenizer.ggml.fim_{kind}_token_id", token_id)
    writer.add_chat_template(CHATML_TEMPLATE)
    tensors = load_file(str(hf_folder / "model.safetensors"))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    hf_to_gguf = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in hf_to_gguf.items():
            names[f"model.layers.{i}.{hf_name}"] = f"blk.{i}.{gguf_name}"
        if f"model.layers.{i}.self_attn.q_norm.weight" in tensors:
            names[f"model.layers.{i}.self_attn.q_norm.weight"] = f"blk.{i}.attn_q_norm.weight"
            names[f"model.layers.{i}.self_attn.k_norm.weight"] = f"blk.{i}.attn_k_norm.weight"
        if arch in ("qwen2", "qwen2moe"):
            for proj in "qkv":
                names[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = f"blk.{i}.attn_{proj}.bias"
    arrays = {g: tensors[h].numpy().astype(np.float32) for h, g in names.items() if h in tensors}
    arrays |= extra(writer) if extra is not None else {}
    for gguf_name, w in arrays.items():
        if gguf_name in skip:
            continue
        if arch in PERMUTED_ARCHS and gguf_name.endswith("attn_q.weight"):
            w = permute_for_gguf(w, n_heads)
        elif arch in PERMUTED_ARCHS and gguf_name.endswith("attn_k.weight"):
            w = permute_for_gguf(w, n_kv)
        if qtype == "F32" or w.ndim == 1 or gguf_name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(gguf_name, w)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
