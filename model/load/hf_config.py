"""Read a Hugging Face folder's config.json into ModelArgs (model/load/hf.py reads its weights)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcache.rope import RopeConfig, linear_rope, yarn
from model.arch import FAMILIES, ModelArgs, family_of_hf
from model.arch.family import hf_rope_kind
from model.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


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
    family = family_of_hf(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelLoadError(
            f"{folder}: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    if family.hf_args is not None:  # read whole (the recurrent and hybrid families)
        try:
            return family.hf_args(config)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{folder}/config.json: bad or unsupported field ({e}).") from e
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", model_type in ("mistral", "mixtral"))
    if (
        not family.sliding
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
        longrope = hf_rope_kind(scaling) in ("longrope", "su")  # "su": early Phi-3 128k configs
        is_yarn = hf_rope_kind(scaling) == "yarn"
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
            rope=RopeConfig(theta, rope_dim, family.rope_layout, factors),
            n_ctx_train=int(config.get("max_position_embeddings", 2048)),
            qkv_bias=family.qkv_bias or bool(config.get("attention_bias", False)),
            block=family.block,
        )
        if is_yarn:
            args.rope = replace(_yarn(scaling, theta, rope_dim), layout=args.rope.layout)
        if hf_rope_kind(scaling) == "linear":
            args.rope = linear_rope(args.rope, float(scaling["factor"]))
        if longrope and not family.longrope:
            raise ValueError(f"rope scaling 'longrope' is not supported for {model_type}")
        if family.from_hf is not None:
            family.from_hf(args, config)
        return args
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder}/config.json: bad or missing field ({e}).") from e


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


def _freq_factors(scaling: dict[str, Any], theta: float, dim: int) -> tuple[float, ...] | None:
    """llama3 rope scaling as llama.cpp's rope_freqs divisors (HF _compute_llama3_parameters)."""
    kind = hf_rope_kind(scaling)
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
