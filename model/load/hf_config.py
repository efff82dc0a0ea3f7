"""Read a Hugging Face folder's config.json into ModelArgs (model/load/hf.py reads its weights)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcache.rope import RopeConfig, RopeLayout, linear_rope, yarn
from model.arch import (
    ARCH_BLOCKS,
    EXAONE4_SWA_PERIOD,
    GEMMA2_SWA_PERIOD,
    GPTOSS_SWA_PERIOD,
    SMOLLM3_NOPE_PERIOD,
    LongRope,
    ModelArgs,
    MoEArgs,
    smollm3_nope_layers,
)
from model.errors import ModelLoadError
from model.load.hf_ssm import SSM_MODEL_TYPES, read_ssm_args

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "exaone4",
    "glm4",
    "granite",
    "qwen3_moe",
    "olmoe",
    "granitemoe",
    "gpt_oss",
    *SSM_MODEL_TYPES,
)
# model_type -> its model.arch.ARCH_BLOCKS key (llama.cpp's architecture name), where they differ
_BLOCK_OF = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
_ROPE_LAYOUT: dict[str, RopeLayout] = {"glm4": "interleaved"}


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object file, or {} when the file does not exist."""
    if not file.is_file():
        return {}
    try:
        data: dict[str, Any] = json.loads(file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e}).") from e
    return data


def read_config(folder: Path) -> dict[str, Any]:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: config.json is missing.")
    return read_json(folder / "config.json")


def read_args(config: dict[str, Any], folder: Path, allow_bidirectional: bool = False) -> ModelArgs:
    """`allow_bidirectional`: read an EmbeddingGemma config (its encoder's loader does)."""
    model_type = config.get("model_type")
    if model_type == "gemma3":
        raise ModelLoadError(
            f"{folder}: a multimodal gemma3 checkpoint is not supported (a text-only "
            "gemma3_text one is)."
        )
    if config.get("use_bidirectional_attention") and not allow_bidirectional:
        raise ModelLoadError(
            f"{folder}: an embedding model (EmbeddingGemma: bidirectional attention), "
            "served on /v1/embeddings (model/load/encoder.py), not a generative one."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{folder}: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    if model_type in SSM_MODEL_TYPES:
        try:
            return read_ssm_args(config, str(model_type))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{folder}/config.json: bad or unsupported field ({e}).") from e
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", model_type == "mistral")
    if (
        model_type not in ("gemma2", "gemma3_text", "phi3", "exaone4", "gpt_oss")
        and uses_window
        and window is not None
        and window < config.get("max_position_embeddings", 0)
    ):
        raise ModelLoadError(f"{folder}: sliding-window attention ({window}) is not supported.")
    try:
        dim = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or dim // n_heads)
        rope_params = config.get("rope_parameters") or {}
        theta = float(config.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        partial = config.get("partial_rotary_factor", rope_params.get("partial_rotary_factor"))
        rope_dim = int(head_dim * (partial or 1.0))
        scaling = config.get("rope_scaling") or rope_params
        longrope = _rope_kind(scaling) in ("longrope", "su")  # "su": early Phi-3 128k configs
        is_yarn = _rope_kind(scaling) == "yarn"
        factors = None if longrope or is_yarn else _freq_factors(scaling, theta, rope_dim)
        args = ModelArgs(
            arch=str(model_type),
            vocab_size=int(config["vocab_size"]),
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            hidden_dim=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            # GLM-4 rotates interleaved pairs (its rotate_half pairs x[2i], x[2i + 1])
            rope=RopeConfig(theta, rope_dim, _ROPE_LAYOUT.get(model_type, "neox"), factors),
            n_ctx_train=int(config.get("max_position_embeddings", 2048)),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            block=ARCH_BLOCKS[_BLOCK_OF.get(str(model_type), str(model_type))],
        )
        if is_yarn:
            args.rope = replace(_yarn(scaling, theta, rope_dim), layout=args.rope.layout)
        if _rope_kind(scaling) == "linear":
            args.rope = linear_rope(args.rope, float(scaling["factor"]))
        if model_type == "gpt_oss":
            _gptoss_layers(args, config)
        if model_type in ("qwen3_moe", "olmoe", "granitemoe"):
            _moe_layers(args, config)
        if model_type in ("granite", "granitemoe"):
            _granite_scalars(args, config)
        if model_type == "gemma3_text":
            _gemma3_layers(args, config)
        if model_type == "gemma2":
            _gemma2_layers(args, config)
        if model_type == "exaone4" and window is not None:
            _exaone4_layers(args, config, int(window))
        if model_type == "phi3" and window is not None and window < args.n_ctx_train:
            args.windows = (int(window),) * args.n_layers  # Phi3Config: every layer slides
        if longrope:
            if model_type != "phi3":
                raise ValueError(f"rope scaling 'longrope' is not supported for {model_type}")
            _longrope(args, config, scaling)
        if model_type == "smollm3":
            uses_rope = config.get("no_rope_layers")  # 1: RoPE on that layer, 0: none
            args.nope_layers = (
                tuple(not bool(u) for u in uses_rope)
                if uses_rope is not None
                else smollm3_nope_layers(
                    args.n_layers, int(config.get("no_rope_layer_interval", SMOLLM3_NOPE_PERIOD))
                )
            )
            if len(args.nope_layers) != args.n_layers:
                raise ValueError(f"no_rope_layers has {len(args.nope_layers)} entries")
        return args
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: bad or missing field ({e}).") from e


def _moe_layers(args: ModelArgs, config: dict[str, Any]) -> None:
    """The experts' sizes and routing; Qwen3-MoE's dense layers (mlp_only_layers, and with
    decoder_sparse_step s only every s-th layer sparse) keep intermediate_size."""
    if config.get("clip_qkv") is not None:
        raise ValueError("clip_qkv is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported")
    model_type = config["model_type"]
    qwen = model_type == "qwen3_moe"
    args.moe = MoEArgs(
        # transformers 5 writes num_local_experts (its attribute map for num_experts)
        n_experts=int(config.get("num_experts") or config["num_local_experts"]),
        n_used=int(config["num_experts_per_tok"]),
        expert_dim=int(config["moe_intermediate_size" if qwen else "intermediate_size"]),
        # Granite: softmax over the top-k logits, the same as renormalizing the top-k of all
        norm_topk_prob=model_type == "granitemoe" or bool(config.get("norm_topk_prob", False)),
    )
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    args.moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(args.n_layers))


def _gptoss_layers(args: ModelArgs, config: dict[str, Any]) -> None:
    """gpt-oss (GptOssConfig): layer_types slide by sliding_window (default: the even layers),
    attention sinks, biases on q/k/v/o (attention_bias), the router and the experts."""
    if config.get("quantization_config"):
        kind = config["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"quantization_config {kind!r}: a quantized gpt-oss folder is not read (its GGUF is)"
        )
    window = int(config["sliding_window"])
    types = config.get("layer_types") or [
        "full" if (i + 1) % GPTOSS_SWA_PERIOD == 0 else "sliding" for i in range(args.n_layers)
    ]
    if len(types) != args.n_layers:
        raise ValueError(f"layer_types has {len(types)} entries")
    args.windows = tuple(window if str(t).startswith("sliding") else 0 for t in types)
    args.attn_sinks = True
    args.out_bias = args.qkv_bias
    args.moe = MoEArgs(
        n_experts=int(config["num_local_experts"]),
        n_used=int(config["num_experts_per_tok"]),
        expert_dim=int(config["intermediate_size"]),
        norm_topk_prob=True,  # softmax over the top-k logits
        bias=True,
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )


def _yarn(scaling: dict[str, Any], theta: float, dim: int) -> RopeConfig:
    """YaRN from rope_scaling / rope_parameters, as transformers' _compute_yarn_parameters
    (mscale / mscale_all_dim: DeepSeek's attention factor, refused)."""
    if scaling.get("mscale") or scaling.get("mscale_all_dim"):
        raise ValueError("yarn with mscale / mscale_all_dim is not supported")
    attn = scaling.get("attention_factor")
    return yarn(
        theta,
        dim,
        float(scaling["factor"]),
        int(scaling["original_max_position_embeddings"]),
        float(scaling.get("beta_fast") or 32.0),
        float(scaling.get("beta_slow") or 1.0),
        bool(scaling.get("truncate", True)),
        None if attn is None else float(attn),
    )


def _granite_scalars(args: ModelArgs, config: dict[str, Any]) -> None:
    """Granite's multipliers (GraniteConfig, GraniteMoeConfig): the softmax scale is
    attention_multiplier, not head_dim ** -0.5."""
    args.attn_scale = float(config.get("attention_multiplier", 1.0))
    args.embed_mult = float(config.get("embedding_multiplier", 1.0))
    args.residual_mult = float(config.get("residual_multiplier", 1.0))
    args.logits_scaling = float(config.get("logits_scaling", 1.0))


def _gemma2_layers(args: ModelArgs, config: dict[str, Any]) -> None:
    """Every other layer slides (layer_types; Gemma2Config's default), query_pre_attn_scalar,
    the attention and final logit soft-capping; one RoPE for every layer."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {config['hidden_activation']!r} is not supported")
    window = int(config["sliding_window"])
    types = config.get("layer_types") or [
        "full" if (i + 1) % GEMMA2_SWA_PERIOD == 0 else "sliding" for i in range(args.n_layers)
    ]
    args.windows = tuple(window if str(t).startswith("sliding") else 0 for t in types)
    args.attn_scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
    args.attn_softcap = float(config.get("attn_logit_softcapping") or 0.0)
    args.final_softcap = float(config.get("final_logit_softcapping") or 0.0)


def _exaone4_layers(args: ModelArgs, config: dict[str, Any], window: int) -> None:
    """layer_types (or sliding_window_pattern: every n-th layer global, or a string of L / G,
    the last layer global) slide by `window`; the global layers take no RoPE
    (transformers' Exaone4Attention: NoPE on them once the model has a window)."""
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", EXAONE4_SWA_PERIOD)
        if isinstance(pattern, str):
            types = [pattern[i % len(pattern)] == "L" for i in range(args.n_layers)]
            types = ["sliding" if t else "full" for t in types[:-1]] + ["full"]
        else:
            period = int(pattern)
            types = ["full" if (i + 1) % period == 0 else "sliding" for i in range(args.n_layers)]
    args.windows = tuple(window if str(t).startswith("sliding") else 0 for t in types)
    args.nope_layers = tuple(w == 0 for w in args.windows)


def _longrope(args: ModelArgs, config: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Phi-3's LongRoPE as transformers' _compute_longrope_parameters: the short and long
    divisors per rotated pair, the attention factor sqrt(1 + ln(s) / ln(n_orig)) for
    s = max_position_embeddings / n_orig unless the config gives it."""
    import math

    orig = int(
        config.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or args.n_ctx_train
    )
    factor = float(scaling.get("factor") or args.n_ctx_train / orig)
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ropes = []
    for key in ("short_factor", "long_factor"):
        factors = tuple(float(f) for f in scaling[key])
        if len(factors) != args.rope.dim // 2:
            raise ValueError(f"rope {key} has {len(factors)} entries, not {args.rope.dim // 2}")
        ropes.append(RopeConfig(args.rope.theta, args.rope.dim, "neox", factors, float(attn)))
    args.longrope = LongRope(ropes[0], ropes[1], orig)
    args.rope = ropes[0]


def _gemma3_layers(args: ModelArgs, config: dict[str, Any]) -> None:
    """Windows from layer_types (or the older sliding_window_pattern), per-layer-type RoPE from
    rope_parameters (or rope_theta / rope_local_base_freq), query_pre_attn_scalar."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"{key} is not supported")
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {config['hidden_activation']!r} is not supported")
    window = int(config["sliding_window"])
    types = config.get("layer_types")
    if types is None:
        period = int(config.get("sliding_window_pattern", 6))
        types = ["full" if (i + 1) % period == 0 else "sliding" for i in range(args.n_layers)]
    args.windows = tuple(window if str(t).startswith("sliding") else 0 for t in types)
    params = config.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_theta": config.get("rope_theta", 1e6)}
    local = params.get("sliding_attention") or {
        "rope_theta": config.get("rope_local_base_freq", 10000.0)
    }
    # the 4B and larger: linear scaling of the global layers' positions (rope_scaling in older
    # configs, rope_parameters.full_attention in newer ones); the local layers keep theirs
    scaling = full if "rope_type" in full else (config.get("rope_scaling") or {})
    factor = _linear_factor(scaling)
    if _rope_kind(local) != "default":
        raise ValueError(f"sliding-window rope scaling {_rope_kind(local)!r} is not supported")
    args.rope = RopeConfig(
        float(full["rope_theta"]),
        args.head_dim,
        "neox",
        None if factor == 1.0 else (factor,) * (args.head_dim // 2),
    )
    args.rope_swa = RopeConfig(float(local["rope_theta"]), args.head_dim, "neox")
    args.attn_scale = float(config.get("query_pre_attn_scalar", args.head_dim)) ** -0.5


def _rope_kind(p: dict[str, Any]) -> str:
    return str(p.get("rope_type", p.get("type", "default")))


def _linear_factor(scaling: dict[str, Any]) -> float:
    """Linear RoPE scaling (positions / factor: every inverse frequency / factor, llama.cpp's
    freq_scale = 1 / factor) -> factor; 1.0 for none; other kinds are refused."""
    kind = _rope_kind(scaling)
    if kind == "default":
        return 1.0
    if kind != "linear":
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return float(scaling["factor"])


def _freq_factors(scaling: dict[str, Any], theta: float, dim: int) -> tuple[float, ...] | None:
    """llama3 rope scaling as llama.cpp's rope_freqs divisors (HF _compute_llama3_parameters)."""
    kind = _rope_kind(scaling)
    if kind in ("default", "linear"):  # linear: kvcache.rope.linear_rope, once args exist
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported")
    import math

    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)
