"""Read a GGUF file (llama.cpp's format) into HF-layout weights, ModelArgs and tokenizer data.

The file is memory-mapped (model/load/gguf_file.py). `read_weights(..., blocks=True)` keeps the
linear and embedding weights as the file stores them (model/layers/ggml.py BlockWeight, views
of the mapping); otherwise every tensor is dequantized to the serving dtype."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvcache.rope import RopeConfig
from model.arch import (
    ARCH_BLOCKS,
    EXAONE4_SWA_PERIOD,
    GEMMA2_SWA_PERIOD,
    GEMMA3_LOCAL_ROPE_BASE,
    LongRope,
    ModelArgs,
    MoEArgs,
    gemma3_windows,
    smollm3_nope_layers,
)
from model.arch.weights import layer_weights, weight_shapes
from model.errors import ModelLoadError
from model.layers.ggml import GGML_TYPES, BlockWeight
from model.load.gguf_file import GGUFError, GGUFFile, GGUFTensor, open_shared
from model.load.gguf_ssm import SSM_ARCHS, SSM_TENSORS, to_hf_layout
from model.load.gguf_ssm import read_args as read_ssm_args

# mixture-of-experts architectures (model/layers/moe.py); llama.cpp's qwen3moe normalizes the
# top-k weights (build_moe_ffn norm_w), its olmoe does not
MOE_ARCHS = ("qwen3moe", "olmoe", "granitemoe")
_NORM_TOPK = {"qwen3moe": True, "olmoe": False, "granitemoe": True}
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
# the archs whose GGUF Q/K rows llama.cpp's converter permuted (LlamaModel.undo_permute)
_PERMUTED_QK = ("llama", "smollm3", "granite", "granitehybrid", "granitemoe")
# fused tensors (llama.cpp's phi3: attn_qkv, and ffn_up holding gate then up; glm4: ffn_up),
# split into our kinds by rows: kind -> (tensor, index of the part)
_FUSED = {"wq": ("attn_qkv.weight", 0), "wk": ("attn_qkv.weight", 1), "wv": ("attn_qkv.weight", 2)}
_FUSED |= {"w1": ("ffn_up.weight", 0), "w3": ("ffn_up.weight", 1)}
_FUSED_KINDS = {"phi3": frozenset(_FUSED), "glm4": frozenset(("w1", "w3"))}
# llama.cpp's LLAMA_ROPE_TYPE_NORM archs that its converter did not permute (GLM's own pairs)
_INTERLEAVED = ("glm4",)

_LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "w1": "ffn_gate.weight",
    "w3": "ffn_up.weight",
    "w2": "ffn_down.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
    "moe_router": "ffn_gate_inp.weight",
    "w1_exps": "ffn_gate_exps.weight",  # [n_expert, n_ff_exp, n_embd] (ggml: reversed)
    "w3_exps": "ffn_up_exps.weight",
    "w2_exps": "ffn_down_exps.weight",  # [n_expert, n_embd, n_ff_exp]
    **SSM_TENSORS,
}


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

    embd = _tensor_info(reader, "token_embd.weight", path)
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
        ff = _dequantize(_tensor_info(reader, "rope_freqs.weight", path))
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
        qkv_bias=arch == "qwen2" or (arch == "glm4" and "blk.0.attn_q.bias" in reader),
        block=ARCH_BLOCKS[arch],
    )
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
    if arch in ("granite", "granitemoe"):  # llama.cpp: 0 (absent) means not scaled
        args.attn_scale = float(get("attention.scale", 0.0)) or None
        args.embed_mult = float(get("embedding_scale", 0.0)) or 1.0
        args.residual_mult = float(get("residual_scale", 0.0)) or 1.0
        args.logits_scaling = float(get("logit_scale", 0.0)) or 1.0
    return args


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
        ff = _dequantize(_tensor_info(reader, f"rope_factors_{kind}.weight", path)).reshape(-1)
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
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":  # the 4B and larger: the global layers' positions / factor
        factor = float(get("rope.scaling.factor"))
        args.rope = replace(args.rope, freq_factors=(factor,) * (args.rope.dim // 2))
    elif scaling not in ("none", None):
        raise ModelLoadError(f"{path}: gemma3 RoPE scaling {scaling!r} is not supported.")
    args.windows = gemma3_windows(args.n_layers, int(get("attention.sliding_window")))
    args.rope_swa = RopeConfig(GEMMA3_LOCAL_ROPE_BASE, args.rope.dim, "neox")
    # NOTE: query_pre_attn_scalar is not in the file: head_dim, except for the 27B model
    # (62 layers) where it is dim / n_heads (llama.cpp's f_attention_scale for gemma3).
    scalar = args.dim // args.n_heads if args.n_layers == 62 else args.head_dim
    args.attn_scale = scalar**-0.5


def _tensor_info(reader: GGUFFile, name: str, path: Path) -> GGUFTensor:
    t = reader.tensor(name)
    if t is None:
        raise ModelLoadError(f"{path}: tensor {name} is missing.")
    return t


def _dequantize(t: GGUFTensor) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp convert's permute (interleaved-pair RoPE -> HF rotate-half rows)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# the architectures whose attention/FFN blocks take BlockLinears (the Mamba2 mixers read
# dense weights; LFM2's short convs are two linears around a conv, which stays dense)
BLOCK_ARCHS = (*DENSE_ARCHS, *MOE_ARCHS, "lfm2")
# the weights a BlockLinear / BlockEmbedding takes on the file's own blocks
BLOCK_KINDS = frozenset(
    ("wq", "wk", "wv", "wo", "w1", "w3", "w2", "output", "tok_embeddings")
    + ("shortconv_in", "shortconv_out")
)
EXPERT_KINDS = frozenset(("w1_exps", "w3_exps", "w2_exps"))  # one BlockWeight per expert


def read_weights(
    reader: GGUFFile, args: ModelArgs, path: Path, dtype: torch.dtype, blocks: bool = False
) -> dict[str, Any]:
    """HF-layout weights by our names: torch tensors in `dtype`, or with `blocks` the linears
    and the embedding table as BlockWeights (the file's bytes; a row permutation copies)."""
    names: dict[str, str] = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight"}
    present = {t.name for t in reader.tensors}
    if args.arch == "lfm2" and "token_embd_norm.weight" in present:
        names["norm"] = "token_embd_norm.weight"  # llama.cpp's lfm2: the final norm's name
    if "output.weight" in present:
        names["output"] = "output.weight"
    fused = _FUSED_KINDS.get(args.arch, frozenset())
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            theirs = _FUSED[ours][0] if ours in fused else _LAYER_TENSORS[ours]
            names[f"layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
    if args.arch in SSM_ARCHS:
        unused = present - set(names.values()) - {"rope_freqs.weight"}
        if unused:
            raise ModelLoadError(
                f"{path}: tensors this {args.arch} model does not use: "
                f"{', '.join(sorted(unused)[:5])}{' ...' if len(unused) > 5 else ''} "
                "(inconsistent file or an unsupported variant)."
            )
    expected = weight_shapes(args)
    weights: dict[str, Any] = {}
    cache: dict[str, np.ndarray] = {}
    for ours, theirs in names.items():
        info = _tensor_info(reader, theirs, path)
        kind = ours.rsplit(".", 1)[-1]
        if kind in fused:
            weights[ours] = _fused_part(info, args, kind, expected, path, dtype, blocks, cache)
            continue
        if blocks and kind in EXPERT_KINDS:
            weights[ours] = _expert_blocks(info, expected[kind], path)
            continue
        if blocks and kind in BLOCK_KINDS:
            weights[ours] = _block_weight(info, args, kind, expected[kind], path)
            continue
        try:
            w = _dequantize(info).reshape(tuple(reversed(info.shape)))
        except Exception as e:
            raise ModelLoadError(
                f"{path}: tensor {theirs} of type {info.tensor_type.name} cannot be "
                f"dequantized ({type(e).__name__}: {e})."
            ) from e
        w = to_hf_layout(kind, w, args, theirs, path)
        want = expected[kind]
        if tuple(w.shape) != want:
            raise ModelLoadError(
                f"{path}: tensor {theirs} has shape {tuple(w.shape)}, expected {want}."
            )
        if args.arch in _PERMUTED_QK and kind in ("wq", "wk"):
            w = _unpermute(w, args.n_heads if kind == "wq" else args.n_kv_heads)
        if kind.endswith("norm") and args.block.norm_shift:
            w = w - args.block.norm_shift  # llama.cpp's converter stores Gemma's 1 + w
        weights[ours] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
    weights.setdefault("output", weights["tok_embeddings"])  # tied embeddings
    return weights


def _fused_part(
    info: GGUFTensor,
    args: ModelArgs,
    kind: str,
    expected: dict[str, tuple[int, ...]],
    path: Path,
    dtype: torch.dtype,
    blocks: bool,
    cache: dict[str, np.ndarray],
) -> Any:
    """Our `kind`'s rows of a fused tensor (Phi-3's attn_qkv: q, k, v; ffn_up: gate, up): with
    `blocks` a BlockWeight over the row range of the mapping (a view), else dequantized."""
    kinds = [k for k, (name, _) in _FUSED.items() if name == _FUSED[kind][0]]
    rows = [expected[k][0] for k in kinds]
    start = sum(rows[: _FUSED[kind][1]])
    n, k = expected[kind]
    shape = tuple(reversed(info.shape))
    if shape != (sum(rows), k):
        raise ModelLoadError(
            f"{path}: tensor {info.name} has shape {shape}, expected {(sum(rows), k)}."
        )
    if blocks:
        if info.type_id not in GGML_TYPES.values():
            raise ModelLoadError(
                f"{path}: tensor {info.name} is {info.tensor_type.name}; the block kernels take "
                f"{', '.join(GGML_TYPES)} (--quant int4 / int8 / none re-quantize it)."
            )
        with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(info.rows())[start : start + n]
        return BlockWeight(data, info.type_id, (n, k), f"{info.name}[{kind}]")
    if info.name not in cache:
        cache.clear()  # NOTE: one fused tensor at a time, its parts are read one after another
        cache[info.name] = _dequantize(info).reshape(shape)
    w = cache[info.name][start : start + n]
    return torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)


def _block_weight(
    info: GGUFTensor, args: ModelArgs, kind: str, want: tuple[int, ...], path: Path
) -> BlockWeight:
    shape = tuple(reversed(info.shape))  # ggml order -> [n, k]
    if shape != want:
        raise ModelLoadError(f"{path}: tensor {info.name} has shape {shape}, expected {want}.")
    if info.type_id not in GGML_TYPES.values():
        raise ModelLoadError(
            f"{path}: tensor {info.name} is {info.tensor_type.name}; the block kernels take "
            f"{', '.join(GGML_TYPES)} (--quant int4 / int8 / none re-quantize it)."
        )
    rows, mapped = info.rows(), True
    if args.arch in _PERMUTED_QK and kind in ("wq", "wk"):
        mapped = False
        heads = args.n_heads if kind == "wq" else args.n_kv_heads
        rows = np.ascontiguousarray(_unpermute(rows, heads))
    with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(rows)
    return BlockWeight(data, info.type_id, (int(shape[0]), int(shape[1])), info.name, mapped)


def _expert_blocks(info: GGUFTensor, want: tuple[int, ...], path: Path) -> list[BlockWeight]:
    """A 3-D ffn_*_exps tensor [E, n, k] -> E BlockWeights, expert e's rows [e n, (e + 1) n)
    of the mapping (views: no copy)."""
    shape = tuple(reversed(info.shape))
    if shape != want:
        raise ModelLoadError(f"{path}: tensor {info.name} has shape {shape}, expected {want}.")
    if info.type_id not in GGML_TYPES.values():
        raise ModelLoadError(
            f"{path}: tensor {info.name} is {info.tensor_type.name}; the block kernels take "
            f"{', '.join(GGML_TYPES)} (--quant int4 / int8 / none re-quantize it)."
        )
    n_experts, n, k = (int(d) for d in shape)
    with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        rows = torch.from_numpy(info.rows())
    return [
        BlockWeight(rows[e * n : (e + 1) * n], info.type_id, (n, k), f"{info.name}[{e}]")
        for e in range(n_experts)
    ]
