"""Read a GGUF file's tensors (llama.cpp's format) into HF-layout weights (its metadata:
model/load/gguf_args.py).

The file is memory-mapped (model/load/gguf_file.py). `read_weights(..., blocks=True)` keeps the
linear and embedding weights as the file stores them (model/layers/ggml.py BlockWeight, views
of the mapping); otherwise every tensor is dequantized to the serving dtype."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.arch import FAMILIES, ModelArgs, family_of_gguf
from model.arch.weights import FLOAT32_KINDS, layer_weights, weight_shapes
from model.errors import ModelLoadError
from model.layers.ggml import GGML_TYPES, BlockWeight
from model.load.gguf_args import (  # the metadata half, re-exported: the loaders' one import
    SUPPORTED_ARCHS,
    dequantize,
    field_value,
    open_gguf,
    read_args,
    tensor_info,
)
from model.load.gguf_file import GGUFFile, GGUFTensor

__all__ = ["SUPPORTED_ARCHS", "field_value", "open_gguf", "read_args", "read_weights"]

# fused tensors (llama.cpp's phi3: attn_qkv, and ffn_up holding gate then up; glm4: ffn_up),
# split into our kinds by rows: kind -> (tensor, index of the part); Family.gguf_fused says which
_FUSED = {"wq": ("attn_qkv.weight", 0), "wk": ("attn_qkv.weight", 1), "wv": ("attn_qkv.weight", 2)}
_FUSED |= {"w1": ("ffn_up.weight", 0), "w3": ("ffn_up.weight", 1)}

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
    "bo": "attn_output.bias",
    "sinks": "attn_sinks.weight",
    "moe_router_b": "ffn_gate_inp.bias",
    "b1_exps": "ffn_gate_exps.bias",  # [n_expert, n_ff_exp]
    "b3_exps": "ffn_up_exps.bias",
    "b2_exps": "ffn_down_exps.bias",
    "w1_shexp": "ffn_gate_shexp.weight",  # Qwen2-MoE's shared expert
    "w3_shexp": "ffn_up_shexp.weight",
    "w2_shexp": "ffn_down_shexp.weight",
    "shexp_gate": "ffn_gate_inp_shexp.weight",  # [n_embd]
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp convert's permute (interleaved-pair RoPE -> HF rotate-half rows)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# the architectures whose linears take BlockLinears: every generative family (the recurrent
# mixers' projections too; their small conv, SSM and norm tensors are dequantized); not the
# encoders (model/load/encoder.py)
BLOCK_ARCHS = tuple(f.arch for f in FAMILIES)
# the weights a BlockLinear / BlockEmbedding takes on the file's own blocks
BLOCK_KINDS = frozenset(
    ("wq", "wk", "wv", "wo", "w1", "w3", "w2", "output", "tok_embeddings")
    + ("shortconv_in", "shortconv_out", "ssm_in", "ssm_out")  # the recurrent mixers' linears
    + ("w1_shexp", "w3_shexp", "w2_shexp")  # Qwen2-MoE's shared expert
)
EXPERT_KINDS = frozenset(("w1_exps", "w3_exps", "w2_exps"))  # one BlockWeight per expert


def read_weights(
    reader: GGUFFile, args: ModelArgs, path: Path, dtype: torch.dtype, blocks: bool = False
) -> dict[str, Any]:
    """HF-layout weights by our names: torch tensors in `dtype`, or with `blocks` the linears
    and the embedding table as BlockWeights (the file's bytes; a row permutation copies)."""
    names: dict[str, str] = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight"}
    present = {t.name for t in reader.tensors}
    if args.arch in ("lfm2", "lfm2moe") and "token_embd_norm.weight" in present:
        names["norm"] = "token_embd_norm.weight"  # llama.cpp's lfm2: the final norm's name
    if "output.weight" in present:
        names["output"] = "output.weight"
    family = family_of_gguf(args.arch)
    assert family is not None, args.arch  # read_args refused the others
    fused = family.gguf_fused
    table = _LAYER_TENSORS | family.gguf_names
    for i in range(args.n_layers):
        for ours in layer_weights(args, i):
            theirs = _FUSED[ours][0] if ours in fused else table[ours]
            names[f"layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
    if family.recurrent:
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
        info = tensor_info(reader, theirs, path)
        kind = ours.rsplit(".", 1)[-1]
        if kind in fused:
            weights[ours] = _fused_part(info, args, kind, expected, path, dtype, blocks, cache)
            continue
        if blocks and kind in EXPERT_KINDS:
            weights[ours] = _expert_blocks(info, expected[kind], path)
            continue
        if blocks and kind in BLOCK_KINDS:
            weights[ours] = _block_weight(
                info, args, kind, expected[kind], path, family.gguf_permuted_qk
            )
            continue
        try:
            w = dequantize(info).reshape(tuple(reversed(info.shape)))
        except Exception as e:
            raise ModelLoadError(
                f"{path}: tensor {theirs} of type {info.tensor_type.name} cannot be "
                f"dequantized ({type(e).__name__}: {e})."
            ) from e
        if family.gguf_convert is not None:
            try:
                w = family.gguf_convert(kind, w, args)
            except ValueError as e:
                raise ModelLoadError(f"{path}: tensor {theirs} {e}.") from e
        want = expected[kind]
        if kind == "shexp_gate" and w.size == want[0]:  # llama.cpp's converter: [1, n_embd]
            w = w.reshape(want)
        if tuple(w.shape) != want:
            raise ModelLoadError(
                f"{path}: tensor {theirs} has shape {tuple(w.shape)}, expected {want}."
            )
        if family.gguf_permuted_qk and kind in ("wq", "wk", "bq", "bk"):  # biases too
            w = _unpermute(w, args.n_heads if kind in ("wq", "bq") else args.n_kv_heads)
        if kind.endswith("norm") and args.block.norm_shift:
            w = w - args.block.norm_shift  # llama.cpp's converter stores Gemma's 1 + w
        as_float = torch.from_numpy(np.array(w, dtype=np.float32))
        weights[ours] = as_float if kind in FLOAT32_KINDS else as_float.to(dtype)
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
        return BlockWeight(data, info.type_id, (n, k), f"{info.name}[{kind}]", mapped=True)
    if info.name not in cache:
        cache.clear()  # NOTE: one fused tensor at a time, its parts are read one after another
        cache[info.name] = dequantize(info).reshape(shape)
    w = cache[info.name][start : start + n]
    return torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)


def _block_weight(
    info: GGUFTensor, args: ModelArgs, kind: str, want: tuple[int, ...], path: Path, permuted: bool
) -> BlockWeight:
    """`permuted`: q/k rows as llama.cpp's converter permuted them (Family.gguf_permuted_qk)."""
    shape = tuple(reversed(info.shape))  # ggml order -> [n, k]
    if shape != want:
        raise ModelLoadError(f"{path}: tensor {info.name} has shape {shape}, expected {want}.")
    if info.type_id not in GGML_TYPES.values():
        raise ModelLoadError(
            f"{path}: tensor {info.name} is {info.tensor_type.name}; the block kernels take "
            f"{', '.join(GGML_TYPES)} (--quant int4 / int8 / none re-quantize it)."
        )
    rows, mapped = info.rows(), True
    if permuted and kind in ("wq", "wk"):
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
        BlockWeight(rows[e * n : (e + 1) * n], info.type_id, (n, k), f"{info.name}[{e}]", True)
        for e in range(n_experts)
    ]
