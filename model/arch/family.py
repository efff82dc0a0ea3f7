"""What a family file in model/arch/ declares: its blocks, how its GGUF metadata and HF config
map onto ModelArgs, and the few ways its files name or lay out tensors.

The loaders (model/load/gguf_args.py, hf_config.py, gguf.py, hf.py) read what every family shares
(sizes, RoPE and its scaling, biases the file has) and then call the family's hook for the rest:
`from_gguf(args, meta)` with llama.cpp's `<arch>.*` keys, `from_hf(args, config)` with
config.json. Adding a family is one file here and one line in model/arch/__init__.py.

The recurrent and hybrid families (Mamba2, Granite 4.0-H, LFM2), whose ModelArgs differ from the
start (a mixer per layer, state shapes), read them whole instead: `gguf_args(meta, vocab_size)`
and `hf_args(config)`, with their HF tensors' names (`hf_tensors`) and layouts (`hf_convert`,
`gguf_convert`) in the same file.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvcache.rope import RopeLayout
from model.arch.args import LLAMA, BlockSpec, ModelArgs, MoEArgs
from model.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class GGUFMeta:
    """A GGUF file's metadata as a family hook reads it: `get(key, default)` of `<arch>.<key>`
    (a missing key without a default raises ModelLoadError), `floats(tensor)` the values of a
    small float tensor (RoPE factors), `has(tensor)` whether the file holds one."""

    get: Callable[..., Any]
    floats: Callable[[str], tuple[float, ...]]
    has: Callable[[str], bool]
    path: Path


@dataclass(frozen=True, slots=True)
class Family:
    arch: str  # llama.cpp's architecture name (GGUF general.architecture)
    model_types: tuple[str, ...]  # transformers' model_type values read as this family
    block: BlockSpec = LLAMA
    rope_layout: RopeLayout = "neox"  # "interleaved": RoPE pairs (2i, 2i + 1), GLM's own
    qkv_bias: bool = False  # q/k/v biases whatever the config or file says (Qwen2)
    sliding: bool = False  # its HF config's sliding_window is read (by from_hf), not refused
    longrope: bool = False  # its HF config's LongRoPE scaling is read (by from_hf), not refused
    # a recurrent or hybrid family: ModelArgs read whole by gguf_args / hf_args (no hooks)
    recurrent: bool = False
    moe_norm_topk: bool | None = None  # a mixture of experts: GGUF expert_weights_norm default
    # a mixture of experts only where the file names experts (GGUF expert_count, config.json
    # num_local_experts): llama's arch holds Mixtral too
    moe_optional: bool = False
    # GGUF: q/k rows permuted by llama.cpp's converter (LlamaModel.undo_permute undoes it)
    gguf_permuted_qk: bool = False
    gguf_fused: frozenset[str] = frozenset()  # kinds stored fused (model/load/gguf.py _FUSED)
    gguf_names: Mapping[str, str] = field(default_factory=dict)  # kind -> tensor, where it differs
    hf_names: Mapping[str, str] = field(default_factory=dict)  # kind -> HF tensor, where it differs
    hf_fused: tuple[str, ...] = ()  # HF fused projections (model/load/hf.py _FUSED)
    hf_tied: bool = False  # tie_word_embeddings when config.json does not say
    # how its HF files store the experts (model/load/hf.py): one tensor per expert and projection
    # (Qwen3-MoE, OLMoE; Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2), Granite-MoE's
    # fused input_linear / output_linear, gpt-oss's stacked gate_up_proj with biases
    hf_experts: Literal["per_expert", "mixtral", "granite", "gpt_oss"] = "per_expert"
    from_gguf: Callable[[ModelArgs, GGUFMeta], None] | None = None
    from_hf: Callable[[ModelArgs, dict[str, Any]], None] | None = None
    # read whole (recurrent): ModelArgs from the metadata and the embedding's row count, from
    # config.json (raising KeyError / TypeError / ValueError on a bad one)
    gguf_args: Callable[[GGUFMeta, int], ModelArgs] | None = None
    hf_args: Callable[[dict[str, Any]], ModelArgs] | None = None
    # read whole: our weight name -> its HF tensor, given the names the folder holds
    hf_tensors: Callable[[ModelArgs, Collection[str]], dict[str, str]] | None = None
    # an HF tensor (torch) of a kind -> our layout; a GGUF one (numpy) likewise, raising
    # ValueError("has shape ..., expected ...") where its shape is not the one it must have
    hf_convert: Callable[[str, Any, ModelArgs], Any] | None = None
    gguf_convert: Callable[[str, Any, ModelArgs], Any] | None = None


# Gemma's names (and OLMo 2's, EXAONE 4.0's): post_attention_layernorm normalizes the attention
# OUTPUT (Llama's name for the pre-MLP norm); the pre-MLP norm is pre_feedforward_layernorm
GEMMA_HF_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}


# transformers' hybrids that keep Jamba's tensor names (Jamba, Falcon-H1): the model's own and,
# under model.layers.{i}., a layer's norms, attention and dense MLP
HF_HYBRID_NAMES = {
    "tok_embeddings": "model.embed_tokens.weight",
    "norm": "model.final_layernorm.weight",
    "output": "lm_head.weight",
}
HF_HYBRID_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "pre_ff_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w1": "feed_forward.gate_proj.weight",
    "w3": "feed_forward.up_proj.weight",
    "w2": "feed_forward.down_proj.weight",
}


def hf_layer_windows(
    config: dict[str, Any], n_layers: int, window: int, period: int
) -> tuple[int, ...]:
    """Per layer: `window` where config.json's layer_types says "sliding*", else 0; without
    layer_types every `period`-th layer is global."""
    types = config.get("layer_types") or [
        "full" if (i + 1) % period == 0 else "sliding" for i in range(n_layers)
    ]
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries")
    return tuple(window if str(t).startswith("sliding") else 0 for t in types)


def gguf_per_layer(meta: GGUFMeta, key: str, n_layers: int) -> list[int]:
    """A llama.cpp get_key_or_arr value: one number for every layer, or one per layer."""
    value = meta.get(key)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n_layers
    if len(values) != n_layers:
        raise ModelLoadError(
            f"{meta.path}: {key} has {len(values)} entries for {n_layers} layers (inconsistent "
            "file)."
        )
    return [int(v) for v in values]


def gguf_uniform(meta: GGUFMeta, values: list[int], key: str) -> int:
    """The one nonzero value of a per-layer list (0 where the layer has none of it)."""
    nonzero = {v for v in values if v}
    if len(nonzero) > 1:
        raise ModelLoadError(
            f"{meta.path}: {key} differs between layers ({sorted(nonzero)}); not supported."
        )
    return nonzero.pop() if nonzero else 0


@dataclass(frozen=True, slots=True)
class HybridAttention:
    layers: tuple[bool, ...]  # per layer: attention (True) or a recurrent mixer
    n_heads: int
    n_kv_heads: int
    head_dim: int


def gguf_hybrid_attention(meta: GGUFMeta, n_layers: int, dim: int) -> HybridAttention:
    """A hybrid's attention layers and sizes from llama.cpp's per-layer head counts
    (granitehybrid, jamba): attention.head_count_kv 0 marks a recurrent layer; the attention
    layers share one head count, kv head count and head size (key_length = value_length)."""
    kv_per_layer = gguf_per_layer(meta, "attention.head_count_kv", n_layers)
    layers = tuple(kv > 0 for kv in kv_per_layer)
    heads = gguf_per_layer(meta, "attention.head_count", n_layers)
    n_heads = gguf_uniform(meta, [h for h, a in zip(heads, layers, strict=True) if a],
                           "attention.head_count")  # fmt: skip
    head_dim = int(meta.get("attention.key_length", dim // n_heads if n_heads else 0))
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{meta.path}: attention key and value lengths differ; not supported.")
    n_kv = gguf_uniform(meta, kv_per_layer, "attention.head_count_kv")
    return HybridAttention(layers, n_heads, n_kv, head_dim)


def check_hf_silu(config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported")


def hf_rope_kind(p: dict[str, Any]) -> str:
    return str(p.get("rope_type", p.get("type", "default")))


def hf_linear_factor(scaling: dict[str, Any]) -> float:
    """Linear RoPE scaling (positions / factor: every inverse frequency / factor, llama.cpp's
    freq_scale = 1 / factor) -> factor; 1.0 for none; other kinds are refused."""
    kind = hf_rope_kind(scaling)
    if kind == "default":
        return 1.0
    if kind != "linear":
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return float(scaling["factor"])


def check_hf_gelu(config: dict[str, Any]) -> None:
    """Gemma's MLP: tanh-approximated GELU only."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {config['hidden_activation']!r} is not supported")


def hf_moe(
    args: ModelArgs,
    config: dict[str, Any],
    expert_dim_key: str = "intermediate_size",
    norm_topk: bool | None = None,
) -> None:
    """The experts' sizes and routing from config.json (Qwen3-MoE, OLMoE, Granite-MoE): each
    expert's width under `expert_dim_key`, the top-k weights renormalized where `norm_topk` says
    (None: the config's norm_topk_prob). Qwen3-MoE's dense layers (mlp_only_layers, and with
    decoder_sparse_step s only every s-th layer sparse) keep intermediate_size."""
    if config.get("clip_qkv") is not None:
        raise ValueError("clip_qkv is not supported")
    check_hf_silu(config)
    if norm_topk is None:
        norm_topk = bool(config.get("norm_topk_prob", False))
    args.moe = MoEArgs(
        # transformers 5 writes num_local_experts (its attribute map for num_experts)
        n_experts=int(config.get("num_experts") or config["num_local_experts"]),
        n_used=int(config["num_experts_per_tok"]),
        expert_dim=int(config[expert_dim_key]),
        norm_topk_prob=norm_topk,
    )
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    args.moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(args.n_layers))
