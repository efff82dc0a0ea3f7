"""The GGUF side of the recurrent and hybrid architectures: llama.cpp's "mamba2",
"granitehybrid" (Granite 4.0-H, Bamba) and "lfm2" metadata and tensors -> ModelArgs and HF-layout
weights.

Layout (llama.cpp convert_hf_to_gguf Mamba2Model / GraniteHybridModel, llama-model.cpp):
ssm.inner_size = d_inner, ssm.time_step_rank = the number of heads H (not HF's time_step_rank),
ssm.group_count, ssm.state_size, ssm.conv_kernel; granitehybrid's attention.head_count_kv is a
per-layer array where 0 marks a recurrent layer, rope.scaling.finetuned false means no position
encoding, and logit_scale divides the logits. Numpy shapes of the tensors (ggml's reversed):
ssm_conv1d.weight [conv_dim, K] (HF's [conv_dim, 1, K] squeezed), ssm_a = -exp(A_log) [H, 1],
ssm_d [H, 1], ssm_norm.weight [G, d_inner / G]. lfm2 (LFM2ColBertModel's parent LFM2Model):
attention.head_count_kv 0 marks a short-conv layer, shortconv.l_cache its kernel length,
shortconv.conv.weight [dim, L]; the final norm is token_embd_norm (model/load/gguf.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.rope import RopeConfig
from model.arch import Mixer, ModelArgs, SSMArgs, recurrent
from model.errors import ModelLoadError
from model.load.gguf_file import GGUFFile

SSM_TENSORS = {
    "ssm_in": "ssm_in.weight",
    "ssm_conv": "ssm_conv1d.weight",
    "ssm_conv_b": "ssm_conv1d.bias",
    "ssm_dt_b": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_d": "ssm_d",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
    "shortconv_in": "shortconv.in_proj.weight",
    "shortconv_conv": "shortconv.conv.weight",
    "shortconv_out": "shortconv.out_proj.weight",
}
# tensors llama.cpp reads for these archs that our forward does not implement
_UNSUPPORTED = {
    "ffn_gate_inp": "a mixture-of-experts FFN",
    "_exps": "a mixture-of-experts FFN",
    "_shexp": "a mixture-of-experts FFN (shared expert)",
    "attn_q.bias": "attention biases",
    "attn_k.bias": "attention biases",
    "attn_v.bias": "attention biases",
    "attn_output.bias": "attention biases",
    "ffn_gate.bias": "FFN biases",
    "ffn_up.bias": "FFN biases",
    "ffn_down.bias": "FFN biases",
}


def _int_list(value: Any, n_layers: int, key: str, path: Path) -> list[int]:
    """A llama.cpp get_key_or_arr value: one number for every layer, or one per layer."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n_layers
    if len(values) != n_layers:
        raise ModelLoadError(
            f"{path}: {key} has {len(values)} entries for {n_layers} layers (inconsistent file)."
        )
    return [int(v) for v in values]


def _uniform(values: list[int], key: str, path: Path) -> int:
    nonzero = {v for v in values if v}
    if len(nonzero) > 1:
        raise ModelLoadError(
            f"{path}: {key} differs between layers ({sorted(nonzero)}); not supported."
        )
    return nonzero.pop() if nonzero else 0


def read_args(reader: GGUFFile, arch: str, get: Any, vocab_size: int, path: Path) -> ModelArgs:
    """`get(key, default)`: the value of `{arch}.{key}`; raises ModelLoadError when it is
    missing and no default is given."""
    if arch == "lfm2":
        args = _lfm2_args(get, vocab_size, path)
        _check_tensors(reader, args, path)
        return args
    expert_count = int(get("expert_count", 0))
    if expert_count > 0:
        raise ModelLoadError(
            f"{path}: a mixture-of-experts {arch} model ({expert_count} experts) is not "
            "supported; the dense Granite 4.0-H models (no experts) are."
        )
    n_layers = int(get("block_count"))
    dim = int(get("embedding_length"))
    eps = float(get("attention.layer_norm_rms_epsilon"))
    mixers: list[Mixer]
    if arch == "mamba2":
        mixers = ["mamba2"] * n_layers
        n_heads = n_kv_heads = head_dim = hidden_dim = 0
    else:
        kv_per_layer = _int_list(
            get("attention.head_count_kv"), n_layers, "attention.head_count_kv", path
        )
        mixers = ["attn" if kv else "mamba2" for kv in kv_per_layer]  # llama.cpp: 0 = recurrent
        n_kv_heads = _uniform(kv_per_layer, "attention.head_count_kv", path)
        heads = _int_list(get("attention.head_count"), n_layers, "attention.head_count", path)
        attn_heads = [h for h, m in zip(heads, mixers, strict=True) if m == "attn"]
        n_heads = _uniform(attn_heads, "attention.head_count", path)
        head_dim = int(get("attention.key_length", dim // n_heads if n_heads else 0))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise ModelLoadError(f"{path}: attention key and value lengths differ; not supported.")
        ff = _int_list(get("feed_forward_length"), n_layers, "feed_forward_length", path)
        hidden_dim = _uniform(ff, "feed_forward_length", path)
    ssm = _ssm_args(get, eps, path) if "mamba2" in mixers else None
    rope_on = arch == "granitehybrid" and bool(get("rope.scaling.finetuned", True))
    attn_scale = float(get("attention.scale", 0.0))
    args = ModelArgs(
        arch=arch,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_dim=hidden_dim,
        norm_eps=eps,
        rope=RopeConfig(
            theta=float(get("rope.freq_base", 10000.0)),
            dim=int(get("rope.dimension_count", head_dim)),
            layout="neox",  # NOTE: granitehybrid Q/K are un-permuted to HF layout on load
        ),
        n_ctx_train=int(get("context_length", 2048)),
        attn_scale=attn_scale or None,  # llama.cpp: 0 (absent) means 1/sqrt(head_dim)
        mixers=tuple(mixers),
        ssm=ssm,
        ffn=arch != "mamba2",
        nope=arch == "granitehybrid" and not rope_on,
        # llama.cpp: 0 (absent) means no scaling
        embed_mult=float(get("embedding_scale", 0.0)) or 1.0,
        residual_mult=float(get("residual_scale", 0.0)) or 1.0,
        logits_scaling=float(get("logit_scale", 0.0)) or 1.0,
    )
    _check_tensors(reader, args, path)
    return args


def _lfm2_args(get: Any, vocab_size: int, path: Path) -> ModelArgs:
    n_layers = int(get("block_count"))
    dim = int(get("embedding_length"))
    kv = _int_list(get("attention.head_count_kv"), n_layers, "attention.head_count_kv", path)
    mixers: list[Mixer] = ["attn" if k else "shortconv" for k in kv]
    heads = _int_list(get("attention.head_count"), n_layers, "attention.head_count", path)
    attn_heads = [h for h, m in zip(heads, mixers, strict=True) if m == "attn"]
    n_heads = _uniform(attn_heads, "attention.head_count", path)
    head_dim = int(get("attention.key_length", dim // n_heads if n_heads else 0))
    ff = _int_list(get("feed_forward_length"), n_layers, "feed_forward_length", path)
    return ModelArgs(
        arch="lfm2",
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_uniform(kv, "attention.head_count_kv", path),
        head_dim=head_dim,
        hidden_dim=_uniform(ff, "feed_forward_length", path),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope=RopeConfig(
            theta=float(get("rope.freq_base", 10000.0)),
            dim=int(get("rope.dimension_count", head_dim)),
            layout="neox",  # llama.cpp's LLM_ARCH_LFM2 is LLAMA_ROPE_TYPE_NEOX: not permuted
        ),
        n_ctx_train=int(get("context_length", 2048)),
        block=recurrent.LFM2.block,
        mixers=tuple(mixers),
        short_conv=int(get("shortconv.l_cache")),
    )


def _ssm_args(get: Any, eps: float, path: Path) -> SSMArgs:
    d_inner = int(get("ssm.inner_size"))
    n_heads = int(get("ssm.time_step_rank"))
    n_groups = int(get("ssm.group_count", 1))
    if n_heads <= 0 or d_inner % n_heads or n_groups <= 0 or n_heads % n_groups:
        raise ModelLoadError(
            f"{path}: inconsistent Mamba2 sizes: ssm.inner_size {d_inner}, ssm.time_step_rank "
            f"(heads) {n_heads}, ssm.group_count {n_groups} (heads must divide the inner size "
            "and groups the heads)."
        )
    return SSMArgs(
        n_heads=n_heads,
        head_dim=d_inner // n_heads,
        d_state=int(get("ssm.state_size")),
        n_groups=n_groups,
        d_conv=int(get("ssm.conv_kernel")),
        conv_bias=True,  # refined by _check_tensors from the file
        proj_bias=False,
        norm_eps=eps,
    )


def _check_tensors(reader: GGUFFile, args: ModelArgs, path: Path) -> None:
    """Refuse tensors of features we do not run (experts, biases), name them; decide whether
    the conv has a bias (llama.cpp's granitehybrid makes it optional)."""
    names = {t.name for t in reader.tensors}
    for name in sorted(names):
        for marker, what in _UNSUPPORTED.items():
            if marker in name:
                raise ModelLoadError(
                    f"{path}: tensor {name} means {what}, which is not supported for {args.arch}."
                )
    for name in ("ssm_in.bias", "ssm_out.bias"):
        if any(n.endswith(name) for n in names):
            raise ModelLoadError(
                f"{path}: Mamba2 projection biases ({name}) are not in llama.cpp's layout "
                "and not supported."
            )
    recurrent = [i for i, m in enumerate(args.mixers) if m == "mamba2"]
    if args.ssm is not None:
        with_bias = [i for i in recurrent if f"blk.{i}.ssm_conv1d.bias" in names]
        if with_bias and len(with_bias) != len(recurrent):
            raise ModelLoadError(
                f"{path}: only some recurrent layers have ssm_conv1d.bias (inconsistent file)."
            )
        args.ssm = replace(args.ssm, conv_bias=bool(with_bias))


def to_hf_layout(kind: str, w: np.ndarray, args: ModelArgs, name: str, path: Path) -> np.ndarray:
    """A Mamba2 tensor as llama.cpp stores it -> our (HF) layout; shapes are checked here for
    the kinds whose GGUF shape differs from ours, by the caller for the rest."""
    s = args.ssm
    if s is None or kind not in ("ssm_a", "ssm_d", "ssm_norm"):
        return w
    want = (s.n_groups, s.d_inner // s.n_groups) if kind == "ssm_norm" else (s.n_heads, 1)
    if tuple(w.shape) != want:
        raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(w.shape)}, expected {want}.")
    return w.reshape(-1)
