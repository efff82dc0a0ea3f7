"""A GGUF file's metadata -> ModelArgs: the sizes, RoPE and experts every family's llama.cpp keys
give, then the family's own keys (its file in model/arch/: windows, scales, LongRoPE, ...);
model/load/gguf.py reads the tensors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvcache.rope import RopeConfig, linear_rope, yarn
from model.arch import FAMILIES, GGUFMeta, ModelArgs, MoEArgs, family_of_gguf
from model.errors import ModelLoadError
from model.load.gguf_file import GGUFError, GGUFFile, GGUFTensor, open_shared

SUPPORTED_ARCHS = tuple(f.arch for f in FAMILIES)


def open_gguf(path: Path) -> GGUFFile:
    try:
        return open_shared(path)
    except (GGUFError, OSError) as e:
        raise ModelLoadError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})."
        ) from e


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def read_args(reader: GGUFFile, path: Path) -> ModelArgs:
    arch = field_value(reader, "general.architecture")
    family = family_of_gguf(arch) if isinstance(arch, str) else None
    if family is None:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHS)})."
        )

    def get(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key {arch}.{key} is missing.")
        return value

    embd = tensor_info(reader, "token_embd.weight", path)
    vocab_size = int(embd.shape[-1])
    meta = GGUFMeta(
        get=get,
        floats=lambda name: _floats(reader, name, path),
        has=lambda name: name in reader,
        path=path,
    )
    if family.gguf_args is not None:  # read whole (the recurrent and hybrid families)
        try:
            args = family.gguf_args(meta, vocab_size)
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: bad {arch} metadata ({e}).") from e
        _refuse_unsupported(reader, arch, path, args.moe is not None)
        return args
    dim = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv_heads = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", dim // n_heads))
    freq_factors = None
    if "rope_freqs.weight" in reader:
        freq_factors = _floats(reader, "rope_freqs.weight", path)
    args = ModelArgs(
        arch=str(arch),
        vocab_size=vocab_size,
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_dim=int(get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope=RopeConfig(
            theta=float(get("rope.freq_base", 10000.0)),
            dim=int(get("rope.dimension_count", head_dim)),
            # NOTE: llama Q/K are un-permuted to HF layout (model/load/gguf.py)
            layout=family.rope_layout,
            freq_factors=freq_factors,
        ),
        n_ctx_train=int(get("context_length", 2048)),
        # the file says: llama.cpp loads q/k/v and output biases where there are some
        # (transformers' attention_bias: Llama, Granite, Qwen3, OLMo 2, ... all four; Qwen2
        # and GLM-4 q/k/v only)
        qkv_bias=family.qkv_bias or "blk.0.attn_q.bias" in reader,
        out_bias="blk.0.attn_output.bias" in reader,
        block=family.block,
    )
    scaling = get("rope.scaling.type", "none")
    if scaling == "yarn":
        args.rope = replace(_yarn(args.rope, get, path), layout=args.rope.layout)
    elif scaling == "linear":  # every family (llama.cpp's freq_scale = 1 / factor)
        args.rope = linear_rope(args.rope, float(get("rope.scaling.factor", 1.0)))
    elif scaling not in ("none", "longrope", None):  # longrope: model/arch/phi3.py
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported.")
    moe = family.moe_norm_topk is not None
    if moe and (not family.moe_optional or int(get("expert_count", 0)) > 0):
        # every layer sparse, as llama.cpp builds them
        try:
            args.moe = MoEArgs(
                n_experts=int(get("expert_count")),
                n_used=int(get("expert_used_count")),
                expert_dim=int(get("expert_feed_forward_length", args.hidden_dim)),
                norm_topk_prob=bool(get("expert_weights_norm", family.moe_norm_topk)),
            )
        except ValueError as e:
            raise ModelLoadError(f"{path}: bad {arch} metadata ({e}).") from e
    if family.from_gguf is not None:
        family.from_gguf(args, meta)
    return args


# tensors llama.cpp reads for the recurrent and hybrid archs that their forward does not implement
# (the experts' only where the metadata names none)
_EXPERT_MARKERS = {
    "ffn_gate_inp": "a mixture-of-experts FFN",
    "_exps": "a mixture-of-experts FFN",
    "_shexp": "a mixture-of-experts FFN (shared expert)",
}
_UNSUPPORTED = {
    "attn_q.bias": "attention biases",
    "attn_k.bias": "attention biases",
    "attn_v.bias": "attention biases",
    "attn_output.bias": "attention biases",
    "ffn_gate.bias": "FFN biases",
    "ffn_up.bias": "FFN biases",
    "ffn_down.bias": "FFN biases",
}


def _refuse_unsupported(reader: GGUFFile, arch: str, path: Path, moe: bool) -> None:
    """A recurrent family's file with tensors of features we do not run: refused, named."""
    markers = _UNSUPPORTED if moe else _EXPERT_MARKERS | _UNSUPPORTED
    for name in sorted(t.name for t in reader.tensors):
        for marker, what in markers.items():
            if marker in name:
                raise ModelLoadError(
                    f"{path}: tensor {name} means {what}, which is not supported for {arch}."
                )


def _floats(reader: GGUFFile, name: str, path: Path) -> tuple[float, ...]:
    """A small float tensor's values (RoPE factors), dequantized."""
    return tuple(float(f) for f in dequantize(tensor_info(reader, name, path)).reshape(-1))


def _yarn(rope: RopeConfig, get: Any, path: Path) -> RopeConfig:
    """YaRN as llama.cpp's rope_yarn reads the file: rope.scaling.factor over
    original_context_length, beta_fast / beta_slow (32 / 1 when absent), q and k scaled by
    yarn_attn_factor * (0.1 ln(factor) + 1); its corr_dims floor / ceil the ramp's ends."""
    ext = float(get("rope.scaling.yarn_ext_factor", 1.0))
    log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0))
    if ext not in (1.0, -1.0) or log_mul:  # -1: llama.cpp's "from the scaling type", 1 here
        raise ModelLoadError(
            f"{path}: yarn with ext_factor {ext} / log_multiplier {log_mul} is not supported."
        )
    factor = float(get("rope.scaling.factor"))
    scaled = yarn(
        rope.theta,
        rope.dim,
        factor,
        int(get("rope.scaling.original_context_length")),
        float(get("rope.scaling.yarn_beta_fast", 32.0)),
        float(get("rope.scaling.yarn_beta_slow", 1.0)),
    )
    attn = float(get("rope.scaling.yarn_attn_factor", 1.0))
    return replace(scaled, attn_factor=attn * scaled.attn_factor)


def tensor_info(reader: GGUFFile, name: str, path: Path) -> GGUFTensor:
    t = reader.tensor(name)
    if t is None:
        raise ModelLoadError(f"{path}: tensor {name} is missing.")
    return t


def dequantize(t: GGUFTensor) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
