"""Mamba2: every layer a Mamba2 mixer (model/layers/mamba2.py) over the sequence's state slot, no
MLP, no position encoding. Its mixer's sizes and tensors are shared with Granite 4.0-H
(model/arch/granite_hybrid.py).

GGUF (llama.cpp convert_hf_to_gguf Mamba2Model, llama-model.cpp): ssm.inner_size = d_inner,
ssm.time_step_rank = the number of heads H (not HF's time_step_rank), ssm.group_count,
ssm.state_size, ssm.conv_kernel. Numpy shapes of the tensors (ggml's reversed):
ssm_conv1d.weight [conv_dim, K] (HF's [conv_dim, 1, K] squeezed), ssm_a = -exp(A_log) [H, 1],
ssm_d [H, 1], ssm_norm.weight [G, d_inner / G]. HF: Mamba2Config under backbone.*, A_log.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from kvcache.rope import RopeConfig
from model.arch.args import LLAMA, Mixer, ModelArgs, SSMArgs
from model.arch.family import Family, GGUFMeta, check_hf_silu
from model.arch.weights import layer_weights
from model.errors import ModelLoadError

GGUF_NAMES = {
    "ssm_in": "ssm_in.weight",
    "ssm_conv": "ssm_conv1d.weight",
    "ssm_conv_b": "ssm_conv1d.bias",
    "ssm_dt_b": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_d": "ssm_d",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
}
# a mixer's tensors in an HF layer, under its prefix ("mixer." here, Granite's "mamba.")
HF_MIXER_NAMES = {
    "ssm_in": "in_proj.weight",
    "ssm_in_b": "in_proj.bias",
    "ssm_conv": "conv1d.weight",
    "ssm_conv_b": "conv1d.bias",
    "ssm_dt_b": "dt_bias",
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_norm": "norm.weight",
    "ssm_out": "out_proj.weight",
    "ssm_out_b": "out_proj.bias",
}


def gguf_ssm(meta: GGUFMeta, eps: float, layers: list[int]) -> SSMArgs:
    """The mixer's sizes, and from the tensors of its `layers` whether the conv has a bias
    (llama.cpp's granitehybrid makes it optional)."""
    d_inner = int(meta.get("ssm.inner_size"))
    n_heads = int(meta.get("ssm.time_step_rank"))
    n_groups = int(meta.get("ssm.group_count", 1))
    if n_heads <= 0 or d_inner % n_heads or n_groups <= 0 or n_heads % n_groups:
        raise ModelLoadError(
            f"{meta.path}: inconsistent Mamba2 sizes: ssm.inner_size {d_inner}, "
            f"ssm.time_step_rank (heads) {n_heads}, ssm.group_count {n_groups} (heads must "
            "divide the inner size and groups the heads)."
        )
    return SSMArgs(
        n_heads=n_heads,
        head_dim=d_inner // n_heads,
        d_state=int(meta.get("ssm.state_size")),
        n_groups=n_groups,
        d_conv=int(meta.get("ssm.conv_kernel")),
        conv_bias=_gguf_conv_bias(meta, layers),
        proj_bias=False,
        norm_eps=eps,
    )


def _gguf_conv_bias(meta: GGUFMeta, layers: list[int]) -> bool:
    for name in ("ssm_in.bias", "ssm_out.bias"):
        if any(meta.has(f"blk.{i}.{name}") for i in layers):
            raise ModelLoadError(
                f"{meta.path}: Mamba2 projection biases ({name}) are not in llama.cpp's layout "
                "and not supported."
            )
    with_bias = [i for i in layers if meta.has(f"blk.{i}.ssm_conv1d.bias")]
    if with_bias and len(with_bias) != len(layers):
        raise ModelLoadError(
            f"{meta.path}: only some recurrent layers have ssm_conv1d.bias (inconsistent file)."
        )
    return bool(with_bias)


def recurrent_args(
    meta: GGUFMeta | None,
    arch: str,
    mixer: Mixer,
    vocab_size: int,
    dim: int,
    n_layers: int,
    eps: float,
    **fields: Any,
) -> ModelArgs:
    """A model whose every layer is one recurrent mixer and no MLP (Mamba, Mamba2): no attention
    sizes; `fields` the mixer's (ssm=, mamba=) and what else differs. From a GGUF (`meta`),
    experts are refused: a model without MLP layers has none."""
    if meta is not None and int(meta.get("expert_count", 0)) > 0:
        raise ModelLoadError(
            f"{meta.path}: a {arch} model with {meta.get('expert_count')} experts is not a "
            f"{arch} (no MLP layers); not supported."
        )
    fields.setdefault("rope", RopeConfig(10000.0, 0))
    fields.setdefault("n_ctx_train", 0)  # no trained context limit
    return ModelArgs(
        arch=arch,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=0,
        n_kv_heads=0,
        head_dim=0,
        hidden_dim=0,
        norm_eps=eps,
        block=LLAMA,
        mixers=(mixer,) * n_layers,
        ffn=False,
        **fields,
    )  # fmt: skip


def gguf_args(meta: GGUFMeta, vocab_size: int) -> ModelArgs:
    n_layers = int(meta.get("block_count"))
    eps = float(meta.get("attention.layer_norm_rms_epsilon"))
    return recurrent_args(
        meta, "mamba2", "mamba2", vocab_size, int(meta.get("embedding_length")), n_layers, eps,
        rope=RopeConfig(
            theta=float(meta.get("rope.freq_base", 10000.0)),
            dim=int(meta.get("rope.dimension_count", 0)),
            layout="neox",
        ),
        n_ctx_train=int(meta.get("context_length", 2048)),
        attn_scale=float(meta.get("attention.scale", 0.0)) or None,
        ssm=gguf_ssm(meta, eps, list(range(n_layers))),
    )  # fmt: skip


def gguf_convert(kind: str, w: Any, args: ModelArgs) -> Any:
    """A mixer tensor as llama.cpp stores it -> our layout: ssm_a and ssm_d [H, 1] and ssm_norm
    [G, d_inner / G] flattened; the other kinds are stored as we read them."""
    s = args.ssm
    if s is None or kind not in ("ssm_a", "ssm_d", "ssm_norm"):
        return w
    want = (s.n_groups, s.d_inner // s.n_groups) if kind == "ssm_norm" else (s.n_heads, 1)
    if tuple(w.shape) != want:
        raise ValueError(f"has shape {tuple(w.shape)}, expected {want}")
    return w.reshape(-1)


def hf_ssm(config: dict[str, Any], dim: int, eps: float, pre: str) -> SSMArgs:
    """Mamba2Config's fields, or GraniteMoeHybrid / Bamba's mamba_* ones (pre "mamba_")."""
    names = ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand")
    if pre:
        names = ("n_heads", "d_head", "d_state", "n_groups", "d_conv", "expand")
    values: list[Any] = [config.get(pre + k) for k in names]
    heads, head_dim, state, groups, conv, expand = values
    n_heads, d_inner = int(heads), int(expand or 2) * dim
    p = d_inner // n_heads if head_dim in (None, "auto") else int(head_dim)
    if n_heads * p != d_inner or n_heads % int(groups) != 0:
        raise ValueError(
            f"{n_heads} heads x {p} != {d_inner}, or {groups} groups do not divide them"
        )
    conv_bias = config.get(pre + ("conv_bias" if pre else "use_conv_bias"), True)
    proj_bias = config.get(pre + ("proj_bias" if pre else "use_bias"), False)
    return SSMArgs(
        n_heads=n_heads,
        head_dim=p,
        d_state=int(state),
        n_groups=int(groups),
        d_conv=int(conv),
        conv_bias=bool(conv_bias),
        proj_bias=bool(proj_bias),
        norm_eps=eps,
    )


def hf_args(config: dict[str, Any]) -> ModelArgs:
    check_hf_silu(config)
    dim = int(config["hidden_size"])
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    return recurrent_args(
        None, "mamba2", "mamba2", int(config["vocab_size"]), dim,
        int(config["num_hidden_layers"]), eps, ssm=hf_ssm(config, dim, eps, ""),
    )  # fmt: skip


def hf_tensors(args: ModelArgs, present: Collection[str]) -> dict[str, str]:
    return backbone_tensors(args, present, HF_MIXER_NAMES)


def backbone_tensors(
    args: ModelArgs, present: Collection[str], mixer_names: dict[str, str]
) -> dict[str, str]:
    """transformers' MambaForCausalLM / Mamba2ForCausalLM names: backbone.layers.{i}.norm and
    .mixer.<mixer_names>, the embedding, norm_f and lm_head (model/arch/mamba.py's too)."""
    # older checkpoints name the embedding backbone.embedding (transformers' load_hook)
    old = "backbone.embedding.weight" in present and "backbone.embeddings.weight" not in present
    names = {
        "tok_embeddings": "backbone.embedding.weight" if old else "backbone.embeddings.weight",
        "norm": "backbone.norm_f.weight",
        "output": "lm_head.weight",
    }
    table = {"attn_norm": "norm.weight"} | {k: "mixer." + v for k, v in mixer_names.items()}
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            names[f"layers.{i}.{ours}"] = f"backbone.layers.{i}.{table[ours]}"
    return names


def hf_convert(kind: str, w: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """conv1d.weight [channels, 1, K] squeezed, A_log -> A (Mamba's [d_inner, N] likewise)."""
    if kind == "ssm_conv":
        return w.reshape(w.shape[0], w.shape[-1])  # [channels, 1, K]
    if kind == "ssm_a":
        return -torch.exp(w.float())  # A_log -> A
    return w


FAMILY = Family(
    arch="mamba2",
    model_types=("mamba2",),
    recurrent=True,
    gguf_names=GGUF_NAMES,
    gguf_args=gguf_args,
    hf_args=hf_args,
    hf_tensors=hf_tensors,
    hf_convert=hf_convert,
    gguf_convert=gguf_convert,
)
