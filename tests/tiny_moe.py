"""Tiny random mixture-of-experts models built and saved by transformers (Qwen3-MoE, OLMoE,
GraniteMoE, Mixtral, Qwen2-MoE), and their GGUFs in llama.cpp's layout (experts stacked into 3-D
ffn_*_exps tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama

# HF expert projection -> llama.cpp's stacked tensor
WEIGHT_SCALE, ROUTER_SCALE = 0.1, 1.0
# Granite's scalars, away from 1 so that a missed one shows
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=3.0,
    residual_multiplier=0.6,
    attention_multiplier=0.25,
    logits_scaling=2.5,
)
_EXPERT_TENSORS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def write_tiny_moe(
    folder: str | Path,
    model_type: str = "qwen3_moe",
    n_layers: int = 2,
    n_experts: int = 8,
    n_used: int = 2,
    expert_dim: int = 32,
    seed: int = 0,
    **config_kw: object,
) -> Path:
    """A random Qwen3MoeForCausalLM ("qwen3_moe": dim 64, 4 heads of 32, 2 K/V heads, q/k norms
    per head, norm_topk_prob), OlmoeForCausalLM ("olmoe": q/k norms over the whole projection,
    no renormalization) or GraniteMoeForCausalLM ("granitemoe": Llama's attention, fused
    gate|up experts, GRANITE_MULTIPLIERS; "granitemoeshared": with a shared expert 64 wide),
    MixtralForCausalLM ("mixtral": Llama's block) or Qwen2MoeForCausalLM ("qwen2_moe": q/k/v
    biases, a gated shared expert 64 wide) saved by transformers, with write_tiny_llama's
    tokenizer and ChatML template. Weights ~ N(0, 0.1), the router's N(0, 1), norms
    1 + N(0, 0.1): routing far from ties (a quantized path picks the same experts), unlike the
    models' own tiny init.
    `config_kw` overrides config fields (mlp_only_layers, ...)."""
    import transformers

    folder = write_tiny_llama(folder, seed=seed)  # the tokenizer files, then the model's own
    base = json.loads((folder / "config.json").read_text())
    common = dict(
        vocab_size=base["vocab_size"],
        hidden_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=n_experts,
        num_experts_per_tok=n_used,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        pad_token_id=base["eos_token_id"],
        tie_word_embeddings=model_type == "qwen3_moe",
    )
    if model_type == "olmoe":  # no GQA, as OLMoE-1B-7B (llama.cpp's olmoe assumes it)
        common["num_key_value_heads"] = common["num_attention_heads"]
    if model_type == "qwen3_moe":
        extra = dict(head_dim=32, moe_intermediate_size=expert_dim, norm_topk_prob=True)
        extra["intermediate_size"] = 96  # the dense layers' (mlp_only_layers)
    elif model_type == "qwen2_moe":  # a shared expert 64 wide; no renormalization (llama.cpp's)
        extra = dict(moe_intermediate_size=expert_dim, shared_expert_intermediate_size=64)
        extra |= dict(intermediate_size=96, norm_topk_prob=False)
    else:
        extra = dict(intermediate_size=expert_dim)
    if model_type in ("granitemoe", "granitemoeshared"):
        extra |= GRANITE_MULTIPLIERS
    if model_type == "granitemoeshared":
        extra["shared_intermediate_size"] = 64
    if model_type == "mixtral":  # MixtralConfig calls them num_local_experts
        common["num_local_experts"] = common.pop("num_experts")
    classes = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "granitemoeshared": (
            transformers.GraniteMoeSharedConfig,
            transformers.GraniteMoeSharedForCausalLM,
        ),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }
    if model_type not in classes:
        raise ValueError(f"model_type {model_type!r}: one of {', '.join(classes)}")
    config_cls, model_cls = classes[model_type]
    model = model_cls(config_cls(**(common | extra | config_kw)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            router = name.endswith(("mlp.gate.weight", "router.layer.weight", "moe.gate.weight"))
            scale = ROUTER_SCALE if router else WEIGHT_SCALE
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise)
    model.save_pretrained(folder)
    return folder


def write_tiny_moe_gguf(path: str | Path, folder: str | Path, qtype: str = "F32") -> Path:
    """The folder of write_tiny_moe as llama.cpp's convert_hf_to_gguf writes it
    (Qwen3MoeModel / OlmoeModel): expert_count, expert_used_count, expert_feed_forward_length,
    ffn_gate_inp (kept F32) and the experts stacked [n_expert, out, in]; `qtype` as
    write_tiny_gguf's."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    arch = {  # llama.cpp's converter writes Mixtral as `llama` with experts (LlamaModel)
        "qwen3_moe": "qwen3moe",
        "olmoe": "olmoe",
        "granitemoe": "granitemoe",
        "granitemoeshared": "granitemoe",  # llama.cpp's converter: granitemoe + shexp
        "mixtral": "llama",
        "qwen2_moe": "qwen2moe",
    }[config["model_type"]]
    tensors = load_file(str(folder / "model.safetensors"))
    n_experts = config.get("num_experts") or config["num_local_experts"]

    def experts(writer: gguf.GGUFWriter) -> dict[str, np.ndarray]:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if arch in ("qwen3moe", "qwen2moe"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        shared = config.get("shared_intermediate_size")
        if arch == "granitemoe" and shared:
            writer.add_expert_shared_feed_forward_length(shared)
        if arch == "granitemoe":  # GraniteMoeModel's set_gguf_parameters
            writer.add_attention_scale(config["attention_multiplier"])
            writer.add_embedding_scale(config["embedding_multiplier"])
            writer.add_residual_scale(config["residual_multiplier"])
            writer.add_logit_scale(config["logits_scaling"])
        out = {}
        for i in range(config["num_hidden_layers"]):
            if arch == "granitemoe" and shared:  # shared_mlp.input_linear [2 s, d]: gate, up
                p = f"model.layers.{i}.shared_mlp."
                gate_up = tensors[p + "input_linear.weight"].numpy()
                s = gate_up.shape[0] // 2
                out[f"blk.{i}.ffn_gate_shexp.weight"] = gate_up[:s]
                out[f"blk.{i}.ffn_up_shexp.weight"] = gate_up[s:]
                out[f"blk.{i}.ffn_down_shexp.weight"] = tensors[p + "output_linear.weight"].numpy()
            if arch == "granitemoe":  # input_linear [E, 2 f, d]: the gates, then the ups
                p = f"model.layers.{i}.block_sparse_moe."
                gate_up = tensors[p + "input_linear.weight"].numpy()
                f = gate_up.shape[1] // 2
                out[f"blk.{i}.ffn_gate_inp.weight"] = tensors[p + "router.layer.weight"].numpy()
                out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :f]
                out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, f:]
                out[f"blk.{i}.ffn_down_exps.weight"] = tensors[p + "output_linear.weight"].numpy()
                continue
            mixtral = config["model_type"] == "mixtral"
            p = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}."
            out[f"blk.{i}.ffn_gate_inp.weight"] = tensors[p + "gate.weight"].numpy()
            for proj, name in _EXPERT_TENSORS.items():
                proj = _MIXTRAL_NAMES[proj] if mixtral else proj
                stack = [tensors[f"{p}experts.{e}.{proj}.weight"] for e in range(n_experts)]
                out[f"blk.{i}.{name}.weight"] = torch.stack(stack).numpy()
            if arch == "qwen2moe":  # the shared expert, its gate [1, d] written as [d]
                for proj, name in _EXPERT_TENSORS.items():
                    shexp = name.replace("_exps", "_shexp")
                    out[f"blk.{i}.{shexp}.weight"] = tensors[
                        f"{p}shared_expert.{proj}.weight"
                    ].numpy()
                gate = tensors[f"{p}shared_expert_gate.weight"].numpy()
                out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = gate.reshape(-1)
        return out

    return write_tiny_gguf(path, folder, arch=arch, qtype=qtype, extra=experts)
