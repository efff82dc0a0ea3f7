"""A GGUF file's metadata -> ModelArgs: the architectures served, and the sizes, RoPE, windows and
experts each one's llama.cpp keys give (model/load/gguf.py reads the tensors)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from kvcache.rope import RopeConfig, linear_rope, yarn
from model.arch import (
    ARCH_BLOCKS,
    EXAONE4_SWA_PERIOD,
    GEMMA2_SWA_PERIOD,
    GEMMA3_LOCAL_ROPE_BASE,
    GPTOSS_SWA_PERIOD,
    LongRope,
    ModelArgs,
    MoEArgs,
    gemma3_windows,
    smollm3_nope_layers,
)
from model.errors import ModelLoadError
from model.load.gguf_file import GGUFError, GGUFFile, GGUFTensor, open_shared
from model.load.gguf_ssm import SSM_ARCHS
from model.load.gguf_ssm import read_args as read_ssm_args

# mixture-of-experts architectures (model/layers/moe.py); llama.cpp's qwen3moe normalizes the
# top-k weights (build_moe_ffn norm_w), its olmoe does not; gpt-oss softmaxes the top-k logits
MOE_ARCHS = ("qwen3moe", "olmoe", "granitemoe", "gpt-oss")
_NORM_TOPK = {"qwen3moe": True, "olmoe": False, "granitemoe": True, "gpt-oss": True}
DENSE_ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "exaone4",
    "glm4",
    "granite",
)
SUPPORTED_ARCHS = (*DENSE_ARCHS, *SSM_ARCHS, *MOE_ARCHS)
# llama.cpp's LLAMA_ROPE_TYPE_NORM archs that its converter did not permute (GLM's own pairs)
_INTERLEAVED = ("glm4",)


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
    if arch not in SUPPORTED_ARCHS:
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
    if arch in SSM_ARCHS:
        try:
            return read_ssm_args(reader, arch, get, vocab_size, path)
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: bad {arch} metadata ({e}).") from e
    dim = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv_heads = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", dim // n_heads))
    freq_factors = None
    if "rope_freqs.weight" in reader:
        ff = dequantize(tensor_info(reader, "rope_freqs.weight", path))
        freq_factors = tuple(float(f) for f in ff.reshape(-1))
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
            # NOTE: llama Q/K are un-permuted to HF layout below
            layout="interleaved" if arch in _INTERLEAVED else "neox",
            freq_factors=freq_factors,
        ),
        n_ctx_train=int(get("context_length", 2048)),
        # the file says: llama.cpp loads q/k/v and output biases where there are some
        # (transformers' attention_bias: Llama, Granite, Qwen3, OLMo 2, ... all four; Qwen2
        # and GLM-4 q/k/v only)
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in reader,
        out_bias="blk.0.attn_output.bias" in reader,
        block=ARCH_BLOCKS[arch],
    )
    scaling = get("rope.scaling.type", "none")
    if scaling == "yarn":
        args.rope = replace(_yarn(args.rope, get, path), layout=args.rope.layout)
    elif scaling == "linear":  # every family (llama.cpp's freq_scale = 1 / factor)
        args.rope = linear_rope(args.rope, float(get("rope.scaling.factor", 1.0)))
    elif scaling not in ("none", "longrope", None):  # longrope: Phi-3's factors below
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported.")
    if arch == "gemma3":
        _gemma3_layers(args, get, path)
    if arch == "gemma2":
        _gemma2_layers(args, get)
    if arch == "phi3" and "rope_factors_long.weight" in reader:
        _longrope(reader, args, get, path)
    window = int(get("attention.sliding_window", 0)) if arch == "phi3" else 0
    if 0 < window < args.n_ctx_train:
        # NOTE: as transformers' Phi3 (every layer slides); llama.cpp ignores the window
        args.windows = (window,) * args.n_layers
    if arch == "exaone4" and args.n_layers == 64:
        # NOTE: llama.cpp's exaone4 slides (LLLG, NoPE on the global layers) only for the
        # 64-layer 32B: the file says neither the pattern nor, for the 1.2B, that it has none
        window = int(get("attention.sliding_window", 4096))
        args.windows = gemma3_windows(args.n_layers, window, EXAONE4_SWA_PERIOD)
        args.nope_layers = tuple(w == 0 for w in args.windows)
    if arch == "smollm3":  # llama.cpp: n_no_rope_layer_step = 4, not in the file
        args.nope_layers = smollm3_nope_layers(args.n_layers)
    if arch in MOE_ARCHS:  # every layer sparse, as llama.cpp builds them
        args.moe = MoEArgs(
            n_experts=int(get("expert_count")),
            n_used=int(get("expert_used_count")),
            expert_dim=int(get("expert_feed_forward_length", args.hidden_dim)),
            norm_topk_prob=bool(get("expert_weights_norm", _NORM_TOPK[arch])),
        )
    if arch == "gpt-oss":
        _gptoss_layers(args, get)
    if arch in ("granite", "granitemoe"):  # llama.cpp: 0 (absent) means not scaled
        args.attn_scale = float(get("attention.scale", 0.0)) or None
        args.embed_mult = float(get("embedding_scale", 0.0)) or 1.0
        args.residual_mult = float(get("residual_scale", 0.0)) or 1.0
        args.logits_scaling = float(get("logit_scale", 0.0)) or 1.0
    return args


def _gptoss_layers(args: ModelArgs, get: Any) -> None:
    """llama.cpp's openai-moe: layers 0, 2, ... slide (set_swa_pattern(2)); biases on q/k/v/o,
    the router and the experts, attention sinks; the SwiGLU's alpha and limit are its
    constants (MoEArgs' defaults), not in the file."""
    args.windows = gemma3_windows(
        args.n_layers, int(get("attention.sliding_window")), GPTOSS_SWA_PERIOD
    )
    args.qkv_bias = args.out_bias = args.attn_sinks = True
    assert args.moe is not None
    args.moe = replace(args.moe, bias=True)


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


def _gemma2_layers(args: ModelArgs, get: Any) -> None:
    """llama.cpp's gemma2: layers 0, 2, ... slide (set_swa_pattern(2)); the caps from the file;
    query_pre_attn_scalar is not in it: head_dim, dim / n_heads for the 27B (46 layers)."""
    window = int(get("attention.sliding_window"))
    args.windows = gemma3_windows(args.n_layers, window, GEMMA2_SWA_PERIOD)
    args.attn_softcap = float(get("attn_logit_softcapping", 0.0))
    args.final_softcap = float(get("final_logit_softcapping", 0.0))
    scalar = args.dim // args.n_heads if args.n_layers == 46 else args.head_dim
    args.attn_scale = scalar**-0.5


def _longrope(reader: GGUFFile, args: ModelArgs, get: Any, path: Path) -> None:
    """Phi-3's LongRoPE as llama.cpp's phi3 reads it: rope_factors_short / rope_factors_long
    [n_rot / 2], rope.scaling.attn_factor, rope.scaling.original_context_length (the long
    factors past it: llama_model::get_rope_factors)."""
    attn = float(get("rope.scaling.attn_factor", 1.0))
    ropes = []
    for kind in ("short", "long"):
        ff = dequantize(tensor_info(reader, f"rope_factors_{kind}.weight", path)).reshape(-1)
        if ff.shape[0] != args.rope.dim // 2:
            raise ModelLoadError(
                f"{path}: rope_factors_{kind}.weight has {ff.shape[0]} values, not "
                f"{args.rope.dim // 2}."
            )
        factors = tuple(float(f) for f in ff)
        ropes.append(replace(args.rope, freq_factors=factors, attn_factor=attn))
    orig = int(get("rope.scaling.original_context_length", args.n_ctx_train))
    args.longrope = LongRope(ropes[0], ropes[1], orig)
    args.rope = ropes[0]


def _gemma3_layers(args: ModelArgs, get: Any, path: Path) -> None:
    """Sliding windows, local RoPE and attention scale the way llama.cpp's gemma3 reads them
    (the GGUF stores only the window; transformers' Gemma3TextConfig defaults agree)."""
    # NOTE: the 4B and larger scale the global layers' RoPE linearly (read_args: args.rope);
    # the local layers' RoPE below never is
    args.windows = gemma3_windows(args.n_layers, int(get("attention.sliding_window")))
    args.rope_swa = RopeConfig(GEMMA3_LOCAL_ROPE_BASE, args.rope.dim, "neox")
    # NOTE: query_pre_attn_scalar is not in the file: head_dim, except for the 27B model
    # (62 layers) where it is dim / n_heads (llama.cpp's f_attention_scale for gemma3).
    scalar = args.dim // args.n_heads if args.n_layers == 62 else args.head_dim
    args.attn_scale = scalar**-0.5


def tensor_info(reader: GGUFFile, name: str, path: Path) -> GGUFTensor:
    t = reader.tensor(name)
    if t is None:
        raise ModelLoadError(f"{path}: tensor {name} is missing.")
    return t


def dequantize(t: GGUFTensor) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
