"""The layers of a step in one C++ call (model/kernels step_layers, step.cpp).

A step through the Python layers is ~1,000 small torch calls; from Python each costs a few
microseconds more than the op itself. For int4 or int8 models with bfloat16 activations (the
AVX-512 BF16 default) or float32 ones (the default elsewhere, e.g. AVX2) the C++ side runs the
same ops in the same order as model/llama.py's Block (the quantized GEMMs, the fused RMSNorm /
SiLU-mul / RoPE kernels the Python layers call too through ForwardBatch.fused, the attention
kernels, and raw passes for the K/V writes and residual adds that give torch's bits), so the
logits equal the Python path's bit for bit: tests/model/test_native.py. It takes decode steps,
prompt chunks and steps that mix both, wherever every attention group has the C++ kernels'
cells and lens (the prompt kernel: float32 with AVX2, bfloat16 with AVX-512 BF16) and covers
its rows.
Each linear picks its kernel by row count as QuantLinear does (int4: torch's for bfloat16
activations, model/kernels/int4.cpp up to small_rows float32 rows and gemm.cpp past them;
int8: torch's, on bfloat16 rows; past small_rows the dense copy, oneDNN-packed where it can).
Decode steps, int4 + bfloat16, 300 cached tokens, native vs Python (before the packed weights
and the fused kernels): 8.1 vs 11.8 ms at 1 sequence, 12.5 vs 16.0 at 2, 18.2 vs 23.3 at 4,
30.6 vs 33.7 at 8. Taking the per-layer ATen calls out (in-place RoPE, raw K/V copies,
in-place adds, reused buffers; ~20 calls a layer before) cut the step at 300 cached tokens by
~8% (AVX2, float32: 8.5 -> 7.8 ms at 1 sequence, 87 -> 81 at 32) and 7-14% (AVX-512 BF16:
10.6 -> 9.1 ms, 43 -> 40 at 32), best of 25 interleaved runs on a loaded 2-core Zen 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvcache.storage import KVStorage
from model.llama import ForwardBatch, Transformer
from model.quant import INT4_GROUP, QuantLinear


@dataclass(slots=True)
class NativeDecoder:
    """Flattened per-layer weights for step_layers; `build` says whether a model qualifies."""

    kernels: Any  # the model.kernels module
    weights: list[torch.Tensor]
    n_heads: int
    eps: float
    scale: float
    packed: bool  # the dense copies are prepacked for oneDNN
    small_rows: int  # up to this many rows the quantized kernel, past it the dense copy
    int8: bool  # QuantLinear "int8" weights (else "int4")

    @staticmethod
    def build(model: Transformer, storage: KVStorage, kernels: Any) -> NativeDecoder | None:
        args = model.args
        f32 = model.dtype == torch.float32
        if (
            kernels is None
            or model.dtype not in (torch.bfloat16, torch.float32)
            or storage.dtype != model.dtype
            or not args.plain_llama  # the C++ step implements the Llama block only
            or args.rope.layout != "neox"
            or args.rope.dim != args.head_dim
        ):
            return None
        linears = [m for block in model.layers for m in _linears(block)]
        kinds = {m.kind if isinstance(m, QuantLinear) else None for m in linears}
        if len(kinds) != 1 or kinds & {None, "fbgemm8"}:
            return None
        int8 = kinds == {"int8"}
        if any(m.bias is not None for m in linears):
            return None
        if f32 and not int8 and any(m.kernels is None for m in linears):
            return None  # int4 with float32 rows needs int4_mm's copy (model/quant.py)
        weights: list[torch.Tensor] = []
        for block in model.layers:
            norms = (block.attention_norm.weight, None, block.ffn_norm.weight, None)
            for norm, lin in zip(norms, _linears(block), strict=True):
                if norm is not None:
                    weights.append(norm.detach())
                if f32 and not int8:
                    weights += [lin.q4, lin.q4_scale_min, lin.q4_gemm]
                else:
                    weights += [lin.packed, lin.scales, lin.dense]
        packed = {m.dense_packed for b in model.layers for m in _linears(b)}
        small = {m.small_rows for m in linears}
        if len(packed) != 1 or len(small) != 1:
            return None
        return NativeDecoder(
            kernels,
            weights,
            args.n_heads,
            args.norm_eps,
            args.head_dim**-0.5,
            packed.pop(),
            small.pop(),
            int8,
        )

    def runs(self, batch: ForwardBatch) -> bool:
        """Every attention group kernel-ready (cells and lens set; prompts only where the
        prompt kernel runs), together covering the batch's rows."""
        if batch.windowed or batch.state is not None:
            return False
        covered = 0
        for g in batch.decodes:
            if g.lens is None or g.cells is None:
                return False
            covered += batch.tokens.shape[0] if g.rows is None else g.rows.shape[0]
        for p in batch.prompts:
            if p.lens is None or p.cells is None:
                return False
            covered += p.end - p.start
        return covered == batch.tokens.shape[0]

    def layers(self, x: torch.Tensor, batch: ForwardBatch, storage: KVStorage) -> torch.Tensor:
        decodes, prompts = batch.decodes, batch.prompts
        bounds = [b for p in prompts for b in (p.start, p.end)]
        out: torch.Tensor = self.kernels.step_layers(
            x,
            self.weights,
            storage.k,
            storage.v,
            batch.cells,
            batch.rope_c,
            batch.rope_s,
            [_EVERY_ROW if g.rows is None else g.rows for g in decodes],
            [g.cells for g in decodes],
            [g.lens for g in decodes],
            bounds,
            [p.cells for p in prompts],
            [p.lens for p in prompts],
            self.n_heads,
            self.eps,
            self.scale,
            INT4_GROUP,
            self.small_rows,
            self.packed,
            self.int8,
        )
        return out


_EVERY_ROW = torch.empty(0, dtype=torch.int64)  # step_layers: a decode group of every row


def _linears(block: Any) -> tuple[Any, ...]:
    a, f = block.attention, block.feed_forward
    return (a.wqkv, a.wo, f.w13, f.w2)
