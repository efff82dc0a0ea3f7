"""Read a Hugging Face folder's *.safetensors into HF-layout weights (config.json into ModelArgs:
model/load/hf_config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from model.arch import ModelArgs, family_of_hf
from model.arch.weights import FLOAT32_KINDS, layer_weights, weight_shapes
from model.errors import ModelLoadError

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w1": "mlp.gate_proj.weight",
    "w3": "mlp.up_proj.weight",
    "w2": "mlp.down_proj.weight",
}
_BIAS_TENSORS = {
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
}
_QK_NORM_TENSORS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
# fused projections (Phi-3: both, GLM-4: gate|up; Family.hf_fused): the parts, in order, by our
# name
_FUSED = {
    "self_attn.qkv_proj": ("wq", "wk", "wv"),
    "mlp.gate_up_proj": ("w1", "w3"),
    "shared_mlp.input_linear": ("w1_shexp", "w3_shexp"),  # GraniteMoeShared's shared expert
}
# mixture of experts (Qwen3-MoE, OLMoE): the router, and per expert e mlp.experts.{e}.<proj>
_MOE_TENSORS = {
    "moe_router": "mlp.gate.weight",
    "w1_shexp": "mlp.shared_expert.gate_proj.weight",  # Qwen2-MoE's shared expert
    "w3_shexp": "mlp.shared_expert.up_proj.weight",
    "w2_shexp": "mlp.shared_expert.down_proj.weight",
    "shexp_gate": "mlp.shared_expert_gate.weight",  # [1, d]: read as [d]
}
_EXPERT_PROJ = {"w1_exps": "gate_proj", "w3_exps": "up_proj", "w2_exps": "down_proj"}
_MIXTRAL_PROJ = {"w1_exps": "w1", "w3_exps": "w3", "w2_exps": "w2"}  # block_sparse_moe.experts
# gpt-oss: the experts stacked (_gptoss_experts)
_GPTOSS_EXPERTS = ("w1_exps", "w3_exps", "w2_exps", "b1_exps", "b3_exps", "b2_exps")


def read_safetensors(files: list[Path], where: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `files` by name; a ModelLoadError naming `where` or the bad file."""
    if not files:
        raise ModelLoadError(f"{where}: no *.safetensors file.")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    raw[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own SafetensorError on bad files
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e}).") from e
    return raw


def _read_whole(
    raw: dict[str, torch.Tensor],
    args: ModelArgs,
    config: dict[str, Any],
    dtype: torch.dtype,
    folder: Path,
) -> dict[str, torch.Tensor]:
    """A family's own tensor names and layouts (model/arch/mamba2.py, granite_hybrid.py,
    lfm2.py), every tensor checked against its expected shape."""
    family = family_of_hf(args.arch)
    assert family is not None and family.hf_tensors is not None, args.arch
    names = family.hf_tensors(args, raw.keys())
    tied = config.get("tie_embedding", config.get("tie_word_embeddings", family.hf_tied))
    if "lm_head.weight" not in raw and tied:
        del names["output"]
    expected = weight_shapes(args)
    weights: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        kind = ours.rsplit(".", 1)[-1]
        if "{}" in theirs:  # one tensor per expert (LFM2-MoE): stacked [E, out, in]
            assert args.moe is not None
            stacked = _stack_experts(raw, theirs, args.moe.n_experts, expected[kind], folder)
            weights[ours] = stacked.to(dtype)
            continue
        if theirs not in raw:
            raise ModelLoadError(f"{folder}: tensor {theirs} is missing.")
        w = raw[theirs] if family.hf_convert is None else family.hf_convert(kind, raw[theirs], args)
        if tuple(w.shape) != expected[kind]:
            raise ModelLoadError(
                f"{folder}: tensor {theirs} has shape {tuple(raw[theirs].shape)}, which does not "
                f"give the expected {expected[kind]}."
            )
        weights[ours] = w.to(torch.float32 if kind in FLOAT32_KINDS else dtype)
    weights.setdefault("output", weights["tok_embeddings"])
    return weights


def read_weights(
    folder: Path, args: ModelArgs, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    raw = read_safetensors(sorted(folder.glob("*.safetensors")), folder)
    family = family_of_hf(args.arch)
    assert family is not None, args.arch  # hf_config.read_args refused the others
    if family.hf_tensors is not None:  # read whole (the recurrent and hybrid families)
        return _read_whole(raw, args, config, dtype, folder)
    # the file says whether o_proj has a bias: transformers' attention_bias gives Llama,
    # Granite, Qwen3, OLMo 2, ... one on all four projections, Qwen2 and GLM-4 on q/k/v only
    args.out_bias = args.out_bias or "model.layers.0.self_attn.o_proj.bias" in raw
    names = {"tok_embeddings": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    tied = config.get("tie_word_embeddings", family.hf_tied)
    if "lm_head.weight" in raw or not tied:
        names["output"] = "lm_head.weight"
    if family.hf_fused:
        _split_fused(raw, args, family.hf_fused, folder)
    table = _LAYER_TENSORS | _BIAS_TENSORS | _QK_NORM_TENSORS | _MOE_TENSORS | family.hf_names
    expected = weight_shapes(args)
    weights: dict[str, torch.Tensor] = {}
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            if ours in _GPTOSS_EXPERTS and family.hf_experts == "gpt_oss":
                w = _gptoss_experts(raw, i, ours, expected[ours], folder)
                weights[f"layers.{i}.{ours}"] = w.to(dtype)
                continue
            if ours in _EXPERT_PROJ and family.hf_experts == "granite":
                w = _granite_experts(raw, i, ours, expected[ours], folder)
                weights[f"layers.{i}.{ours}"] = w.to(dtype)
                continue
            if ours in _EXPERT_PROJ:
                assert args.moe is not None
                theirs = f"model.layers.{i}.mlp.experts.{{}}.{_EXPERT_PROJ[ours]}.weight"
                if family.hf_experts == "mixtral":
                    theirs = f"model.layers.{i}.block_sparse_moe.experts.{{}}."
                    theirs += f"{_MIXTRAL_PROJ[ours]}.weight"
                stacked = _stack_experts(raw, theirs, args.moe.n_experts, expected[ours], folder)
                weights[f"layers.{i}.{ours}"] = stacked.to(dtype)
                continue
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{table[ours]}"
    for ours, theirs in names.items():
        if theirs not in raw:
            raise ModelLoadError(f"{folder}: tensor {theirs} is missing.")
        w = raw[theirs]
        want = expected[ours.rsplit(".", 1)[-1]]
        if ours.endswith("shexp_gate") and w.dim() == 2 and w.shape[0] == 1:
            w = w[0]
        if tuple(w.shape) != want:
            raise ModelLoadError(
                f"{folder}: tensor {theirs} has shape {tuple(w.shape)}, expected {want}."
            )
        weights[ours] = w.to(dtype)
    weights.setdefault("output", weights["tok_embeddings"])
    return weights


def _split_fused(
    raw: dict[str, torch.Tensor], args: ModelArgs, names: tuple[str, ...], folder: Path
) -> None:
    """qkv_proj [q_dim + 2 kv_dim, d] and gate_up_proj [2 f, d] into the parts Llama's names
    read (row ranges: views, no copy)."""
    shapes = weight_shapes(args)
    for i in range(args.n_layers):
        for fused in names:
            parts = _FUSED[fused]
            if not set(parts) & set(layer_weights(args, i)):
                continue  # a layer without them (GraniteMoe: no shared expert)
            name = f"model.layers.{i}.{fused}.weight"
            if name not in raw:
                raise ModelLoadError(f"{folder}: tensor {name} is missing.")
            rows = [shapes[p][0] for p in parts]
            want = (sum(rows), shapes[parts[0]][1])
            if tuple(raw[name].shape) != want:
                raise ModelLoadError(
                    f"{folder}: tensor {name} has shape {tuple(raw[name].shape)}, expected {want}."
                )
            for part, w in zip(parts, raw.pop(name).split(rows), strict=True):
                raw[f"model.layers.{i}.{(_LAYER_TENSORS | _MOE_TENSORS)[part]}"] = w


def _stack_experts(
    raw: dict[str, torch.Tensor], pattern: str, n_experts: int, want: tuple[int, ...], folder: Path
) -> torch.Tensor:
    """Each expert's [out, in] tensor (`pattern` formatted with its index) -> [E, out, in]."""
    parts = []
    for e in range(n_experts):
        name = pattern.format(e)
        if name not in raw:
            raise ModelLoadError(f"{folder}: tensor {name} is missing.")
        if tuple(raw[name].shape) != want[1:]:
            raise ModelLoadError(
                f"{folder}: tensor {name} has shape {tuple(raw[name].shape)}, expected {want[1:]}."
            )
        parts.append(raw.pop(name))
    return torch.stack(parts)


def _granite_experts(
    raw: dict[str, torch.Tensor], layer: int, kind: str, want: tuple[int, ...], folder: Path
) -> torch.Tensor:
    """GraniteMoE's experts: input_linear [E, 2 f, d] holds the gates then the ups,
    output_linear [E, d, f] the down projections."""
    p = f"model.layers.{layer}.block_sparse_moe."
    name = p + ("output_linear.weight" if kind == "w2_exps" else "input_linear.weight")
    if name not in raw:
        raise ModelLoadError(f"{folder}: tensor {name} is missing.")
    w = raw[name]
    full = want if kind == "w2_exps" else (want[0], 2 * want[1], want[2])
    if tuple(w.shape) != full:
        raise ModelLoadError(
            f"{folder}: tensor {name} has shape {tuple(w.shape)}, expected {full}."
        )
    if kind == "w2_exps":
        return w
    return w[:, : want[1]] if kind == "w1_exps" else w[:, want[1] :]


def _gptoss_experts(
    raw: dict[str, torch.Tensor], layer: int, kind: str, want: tuple[int, ...], folder: Path
) -> torch.Tensor:
    """GptOssExperts' tensors are x @ W ([E, in, out], not [E, out, in]); gate_up_proj
    [E, d, 2 f] and its bias [E, 2 f] interleave the gate (even columns) and the up (odd)
    ones (GptOssExperts._apply_gate); down_proj [E, f, d], down_proj_bias [E, d]."""
    bias = kind.startswith("b")
    down = kind.startswith(("w2", "b2"))
    name = f"model.layers.{layer}.mlp.experts.{'down_proj' if down else 'gate_up_proj'}"
    name += "_bias" if bias else ""
    if name not in raw:
        raise ModelLoadError(f"{folder}: tensor {name} is missing.")
    full = want if down else (want[0], 2 * want[1], *want[2:])  # [E, out, in] or [E, out]
    stored = full if bias else (full[0], full[2], full[1])
    if tuple(raw[name].shape) != stored:
        raise ModelLoadError(
            f"{folder}: tensor {name} has shape {tuple(raw[name].shape)}, expected {stored}."
        )
    w = raw[name] if bias else raw[name].transpose(1, 2)  # -> [E, out, in]
    if down:
        return w.contiguous()
    return w[:, 0::2].contiguous() if kind[1] == "1" else w[:, 1::2].contiguous()
