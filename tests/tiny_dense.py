"""Tiny random dense models of the families beyond Llama built and saved by transformers
(Gemma 2, Phi-3 with LongRoPE, OLMo 2, EXAONE 4.0, GLM-4, Granite), and their GGUFs in
llama.cpp's layout (convert_hf_to_gguf's Gemma2Model, Phi3MiniModel, Olmo2Model, Exaone4Model,
Glm4Model, GraniteModel)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama

DENSE_TYPES = ["gemma2", "phi3", "olmo2", "exaone4", "glm4", "granite"]
# Granite's scalars, away from 1 so that a missed one shows (tests/tiny_moe.py's)
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=3.0,
    residual_multiplier=0.6,
    attention_multiplier=0.25,
    logits_scaling=2.5,
)
# Gemma 2's caps, small enough that tanh bends the tiny model's scores and logits
GEMMA2_CAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
GEMMA2_WINDOW = 8
# Phi-3's LongRoPE: trained on 32 positions, extended to 128 (attention factor
# sqrt(1 + ln 4 / ln 32))
PHI3_ORIG_CTX, PHI3_MAX_CTX = 32, 128


def write_tiny_dense(
    folder: str | Path,
    model_type: str,
    n_layers: int = 4,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    hidden_dim: int = 128,
    seed: int = 0,
    **config_kw: object,
) -> Path:
    """A random Gemma2ForCausalLM (window GEMMA2_WINDOW on layers 0, 2, GEMMA2_CAPS,
    query_pre_attn_scalar = head_dim), Phi3ForCausalLM (fused qkv and gate_up, LongRoPE with
    random short / long factors), Olmo2ForCausalLM (post-norms only, q/k norms over the whole
    projection), Glm4ForCausalLM (pre and post norms, q/k/v biases, interleaved RoPE on half of
    each head, gate_up fused), Exaone4ForCausalLM (post-norms only, q/k norms per head; no
    window, as the 1.2B, unless `sliding_window` is given: then LLLG with NoPE on the global
    layers, as the 32B)
    or GraniteForCausalLM (GRANITE_MULTIPLIERS) or a plain LlamaForCausalLM, saved by
    transformers (Phi-3:
    `partial_rotary_factor` rotates that part of each head, as Phi-4-mini's 0.75), with
    write_tiny_llama's tokenizer and ChatML template. Weights ~ N(0, 0.15), norms 1 + N(0, 0.1)
    (Gemma's stored w of 1 + w: N(0, 0.1)). `config_kw` overrides config fields."""
    import transformers

    folder = write_tiny_llama(folder, seed=seed)  # the tokenizer files, then the model's own
    base = json.loads((folder / "config.json").read_text())
    common = dict(
        vocab_size=base["vocab_size"],
        hidden_size=dim,
        intermediate_size=hidden_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["eos_token_id"],
        tie_word_embeddings=model_type in ("gemma2", "granite"),
    )
    head_dim = dim // n_heads
    extra: dict[str, object] = {}
    if model_type == "gemma2":
        extra = dict(
            head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=GEMMA2_WINDOW
        )
        extra |= GEMMA2_CAPS
    elif model_type == "phi3":
        gen = torch.Generator().manual_seed(seed + 100)
        half = int(head_dim * float(config_kw.pop("partial_rotary_factor", 1.0))) // 2
        short = (1.0 + 0.5 * torch.rand(half, generator=gen)).tolist()
        long = (1.0 + 7.0 * torch.rand(half, generator=gen)).tolist()
        extra = dict(
            max_position_embeddings=PHI3_MAX_CTX,
            original_max_position_embeddings=PHI3_ORIG_CTX,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": short,
                "long_factor": long,
                "partial_rotary_factor": 2 * half / head_dim,
            },
            sliding_window=None,
        )
    elif model_type == "granite":
        extra = dict(GRANITE_MULTIPLIERS)
    elif model_type == "glm4":  # Glm4Config's head_dim default is 128
        extra = dict(head_dim=head_dim, partial_rotary_factor=0.5, attention_bias=True)
    elif model_type == "exaone4" and config_kw.get("sliding_window") is None:
        extra = dict(sliding_window=None, layer_types=["full_attention"] * n_layers)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
        "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    }
    if model_type not in classes:
        raise ValueError(f"model_type {model_type!r}: one of {', '.join(classes)}")
    config_cls, model_cls = classes[model_type]
    model = model_cls(config_cls(**(common | extra | config_kw)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(0.1 * noise if model_type == "gemma2" else 1.0 + 0.1 * noise)
            else:
                p.copy_((1.0 if "embed_tokens" in name else 0.15) * noise)
    model.save_pretrained(folder)
    return folder


def write_tiny_dense_gguf(path: str | Path, folder: str | Path, qtype: str = "F32") -> Path:
    """The folder of write_tiny_dense as llama.cpp's convert_hf_to_gguf writes it: Gemma's
    norms as 1 + w and its caps and window; Phi-3's attn_qkv and ffn_up (gate then up) fused,
    rope_factors_short / _long, rope.scaling.attn_factor and original_context_length; OLMo 2's
    post norms; Granite's scales (Q/K permuted, as llama's). `qtype` as write_tiny_gguf's."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    model_type = config["model_type"]
    tensors = load_file(str(folder / "model.safetensors"))
    n_layers = config["num_hidden_layers"]
    skip: tuple[str, ...] = ()

    def arrays(name: str) -> np.ndarray:
        return tensors[name].numpy().astype(np.float32)

    def extra(writer: gguf.GGUFWriter) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if model_type == "gemma2":  # Gemma2Model: norms + 1, caps, window
            writer.add_sliding_window(config["sliding_window"])
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
            norms = {
                "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm",
            }
            out["output_norm.weight"] = arrays("model.norm.weight") + 1.0
            for i in range(n_layers):
                for hf, ours in norms.items():
                    w = arrays(f"model.layers.{i}.{hf}.weight") + 1.0
                    out[f"blk.{i}.{ours}.weight"] = w
        if model_type == "phi3":  # Phi3MiniModel
            rope = config["rope_parameters"]
            orig = config["original_max_position_embeddings"]
            scale = config["max_position_embeddings"] / orig
            attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
            rot = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
            writer.add_rope_dimension_count(
                int(rot * config["hidden_size"]) // config["num_attention_heads"]
            )
            writer.add_sliding_window(config.get("sliding_window") or 0)
            writer.add_rope_scaling_orig_ctx_len(orig)
            writer.add_rope_scaling_attn_factors(attn)
            out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
            out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
            for i in range(n_layers):
                p = f"model.layers.{i}."
                out[f"blk.{i}.attn_qkv.weight"] = arrays(p + "self_attn.qkv_proj.weight")
                out[f"blk.{i}.ffn_up.weight"] = arrays(p + "mlp.gate_up_proj.weight")
        if model_type in ("olmo2", "exaone4"):  # no pre-norms, post norms by their own names
            for i in range(n_layers):
                p = f"model.layers.{i}."
                out[f"blk.{i}.post_attention_norm.weight"] = arrays(
                    p + "post_attention_layernorm.weight"
                )
                out[f"blk.{i}.post_ffw_norm.weight"] = arrays(
                    p + "post_feedforward_layernorm.weight"
                )
        if model_type == "glm4":  # Glm4Model: RoPE on half of each head, gate|up fused
            head_dim = config["hidden_size"] // config["num_attention_heads"]
            writer.add_rope_dimension_count(int(head_dim * 0.5))
            for i in range(n_layers):
                p = f"model.layers.{i}."
                out[f"blk.{i}.ffn_up.weight"] = arrays(p + "mlp.gate_up_proj.weight")
                out[f"blk.{i}.post_attention_norm.weight"] = arrays(
                    p + "post_self_attn_layernorm.weight"
                )
                out[f"blk.{i}.post_ffw_norm.weight"] = arrays(p + "post_mlp_layernorm.weight")
                for proj in "qkv":
                    out[f"blk.{i}.attn_{proj}.bias"] = arrays(f"{p}self_attn.{proj}_proj.bias")
        if model_type == "granite":  # GraniteModel's set_gguf_parameters
            writer.add_attention_scale(config["attention_multiplier"])
            writer.add_embedding_scale(config["embedding_multiplier"])
            writer.add_residual_scale(config["residual_multiplier"])
            writer.add_logit_scale(config["logits_scaling"])
        return out

    if model_type in ("olmo2", "exaone4"):  # write_tiny_gguf reads post_attention_layernorm
        skip = tuple(f"blk.{i}.ffn_norm.weight" for i in range(n_layers))  # as Llama's
    return write_tiny_gguf(path, folder, arch=model_type, qtype=qtype, skip=skip, extra=extra)
