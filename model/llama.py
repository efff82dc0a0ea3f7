"""The Llama-family forward (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over the cell cache.

Weights are in Hugging Face layout ([out_features, in_features], rotate-half RoPE); the GGUF
loader un-permutes llama Q/K to it. A batch is flat: row i is one token at `positions[i]`
whose K/V goes into cell `cells[i]`; attention groups say which cells each row may read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.spec import Attention as AttentionSpec
from kvcache.spec import MemorySpec
from kvcache.storage import KVStorage, RopeConfig, rope_partner
from model.kernels import DecodeAttention, PromptAttention


@dataclass(slots=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope: RopeConfig
    n_ctx_train: int
    qkv_bias: bool = False

    @property
    def memory_spec(self) -> MemorySpec:
        """What each layer keeps per sequence (kvcache/spec.py): K/V of every token."""
        layer = AttentionSpec(self.n_kv_heads, self.head_dim)
        return MemorySpec.of([layer] * self.n_layers)


def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Expected shape of each weight kind (the last part of its name)."""
    d, f = args.dim, args.hidden_dim
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {
        "tok_embeddings": (args.vocab_size, d),
        "output": (args.vocab_size, d),
        "norm": (d,),
        "attn_norm": (d,),
        "ffn_norm": (d,),
        "wq": (q_dim, d),
        "wk": (kv_dim, d),
        "wv": (kv_dim, d),
        "wo": (d, q_dim),
        "bq": (q_dim,),
        "bk": (kv_dim,),
        "bv": (kv_dim,),
        "w1": (f, d),
        "w3": (f, d),
        "w2": (d, f),
    }


# Without the C++ kernel, decode groups of fewer sequences use SDPA (faster than two bmm calls
# for 1-2 sequences), larger ones gather + bmm.
SDPA_MAX_SEQS = 4
# The C++ decode kernel (model/kernels) reads K/V in place and, where it is built, attends every
# decode group: 30 layers of 32 sequences x 330 cells, bfloat16, 14-16 ms against ~100 for
# gather + bmm (the gathers allocate and copy 8 MB a layer); float32 33 vs 50 ms.


@dataclass(slots=True)
class DecodeGroup:
    """Rows with one new token each, attended together over padded kv."""

    rows: torch.Tensor | None  # [n_seq] int64; None: every row of the batch, in order
    kv_index: torch.Tensor | slice  # KVStorage.read_index of [n_seq * max_kv] cells (pad: any)
    bias: torch.Tensor | None  # [n_seq, 1, max_kv] model dtype: 0 visible, -inf not; None: all
    max_kv: int
    # for the C++ kernels, set together when each seq sees exactly cells[i, :lens[i]]:
    cells: torch.Tensor | None = None  # [n_seq, max_kv] int64
    lens: torch.Tensor | None = None  # [n_seq] int64


@dataclass(slots=True)
class PromptGroup:
    """Contiguous rows [start, end) of one sequence (a prompt chunk)."""

    start: int
    end: int
    kv_index: torch.Tensor | slice  # KVStorage.read_index of the [n_kv] cells it reads
    mask: torch.Tensor  # [end - start, n_kv] bool
    # for the C++ prompt kernel: the cells in position order, and how many of them each row sees
    cells: torch.Tensor | None = None  # [n_kv] int64
    lens: torch.Tensor | None = None  # [end - start] int64


@dataclass(slots=True)
class ForwardBatch:
    tokens: torch.Tensor  # [n] int64
    cells: torch.Tensor  # [n] int64
    rope_c: torch.Tensor  # [n, 1, head_dim] model dtype (kvcache.storage.rope_tables)
    rope_s: torch.Tensor  # [n, 1, head_dim]
    decodes: list[DecodeGroup]
    prompts: list[PromptGroup]
    logit_rows: torch.Tensor  # [n_out] int64
    decode_kernel: DecodeAttention | None = None  # model.kernels.load_decode_attention()
    prompt_kernel: PromptAttention | None = None  # kernels.prompt_attention (bfloat16 only)
    fused: Any | None = None  # the kernels module for bfloat16 RMSNorm / SiLU-mul (rms_norm_bf16)


LayersFn = Callable[[torch.Tensor, ForwardBatch, KVStorage], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
        if fused is not None:  # one C++ pass, torch's rounding (model/kernels/layers.cpp)
            return fused.rms_norm_bf16(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Linear(nn.Module):
    """y = x @ weight.T + bias; model/quant.py swaps these for quantized ones."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.layout = args.rope.layout
        self.rot = args.rope.dim
        self.scale = args.head_dim**-0.5
        wqkv = torch.cat([weights[prefix + n] for n in ("wq", "wk", "wv")])
        bqkv = None
        if args.qkv_bias:
            bqkv = torch.cat([weights[prefix + n] for n in ("bq", "bk", "bv")])
        self.wqkv = Linear(wqkv, bqkv)
        self.wo = Linear(weights[prefix + "wo"])

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, storage: KVStorage, layer: int
    ) -> torch.Tensor:
        n = x.shape[0]
        h, h_kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)  # [n, (h + 2 h_kv) * hd]
        qk = qkv[:, : (h + h_kv) * hd].view(n, h + h_kv, hd)
        partner = rope_partner(qk, self.rot, self.layout)
        qk = torch.addcmul(qk * batch.rope_c, partner, batch.rope_s)
        q, k = qk.split((h, h_kv), dim=1)  # [n, h, hd], [n, h_kv, hd]
        v = qkv[:, (h + h_kv) * hd :].view(n, h_kv, hd)
        storage.write(layer, batch.cells, k, v)

        kernel = batch.decode_kernel
        if not batch.prompts and len(batch.decodes) == 1 and batch.decodes[0].rows is None:
            out = self._decode(q, storage, layer, batch.decodes[0], kernel)  # all decode, 1 group
        elif not batch.decodes and len(batch.prompts) == 1 and batch.prompts[0].end == n:
            out = self._prompt(q, storage, layer, batch.prompts[0], batch.prompt_kernel)
        else:
            out = x.new_empty(n, h, hd)
            for g in batch.decodes:
                assert g.rows is not None, "a group of every row takes the branch above"
                out.index_copy_(0, g.rows, self._decode(q, storage, layer, g, kernel))
            for p in batch.prompts:
                out[p.start : p.end] = self._prompt(
                    q[p.start : p.end], storage, layer, p, batch.prompt_kernel
                )
        return self.wo(out.reshape(n, h * hd))

    def _decode(
        self,
        q: torch.Tensor,
        storage: KVStorage,
        layer: int,
        g: DecodeGroup,
        kernel: DecodeAttention | None = None,
    ) -> torch.Tensor:
        n_seq = q.shape[0] if g.rows is None else g.rows.shape[0]
        h_kv, hd = self.n_kv_heads, self.head_dim
        if kernel is not None and g.lens is not None and storage.dtype == q.dtype:
            qs = q if g.rows is None else q.index_select(0, g.rows)
            return kernel(qs, storage.k[layer], storage.v[layer], g.cells, g.lens, self.scale)
        # GQA without repeat: the h / h_kv query heads of a kv head become its query rows,
        # batched over (kv head, sequence): [h_kv, n_seq, h / h_kv, hd].
        qd = q if g.rows is None else q.index_select(0, g.rows)
        qd = qd.view(n_seq, h_kv, self.n_heads // h_kv, hd).transpose(0, 1)
        k, v = storage.gather_heads(layer, g.kv_index)  # [h_kv, n_seq * max_kv, hd]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        k = k.unflatten(1, (n_seq, g.max_kv))  # a view, also of a slice of the cache
        v = v.unflatten(1, (n_seq, g.max_kv))
        if n_seq < SDPA_MAX_SEQS:
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=g.bias)
        else:
            # NOTE: two batched matmuls, not SDPA: the CPU flash kernel with 1-3 query rows
            # per head ran 2.6x slower at 32 sequences x 330 cells (bfloat16).
            scores = torch.matmul(qd * self.scale, k.transpose(-1, -2))  # [.., g, max_kv]
            if g.bias is not None:
                scores = scores + g.bias
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            o = torch.matmul(probs if probs.dtype == v.dtype else probs.to(v.dtype), v)
        return o.transpose(0, 1).reshape(n_seq, self.n_heads, hd)

    def _prompt(
        self,
        q: torch.Tensor,
        storage: KVStorage,
        layer: int,
        p: PromptGroup,
        kernel: PromptAttention | None = None,
    ) -> torch.Tensor:
        if kernel is not None and p.lens is not None:  # the worker checked dtypes and shapes
            return kernel(q, storage.k[layer], storage.v[layer], p.cells, p.lens, self.scale)
        k, v = storage.gather_heads(layer, p.kv_index)  # [h_kv, n_kv, hd]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, h, L, hd]
            k[None],  # [1, h_kv, n_kv, hd]
            v[None],
            attn_mask=p.mask,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)  # [L, h, hd]


class FeedForward(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        w13 = torch.cat([weights[prefix + "w1"], weights[prefix + "w3"]])  # gate, up
        self.w13 = Linear(w13)
        self.w2 = Linear(weights[prefix + "w2"])

    def forward(self, x: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
        if fused is not None:
            return self.w2(fused.silu_mul_bf16(self.w13(x)))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], layer: int) -> None:
        super().__init__()
        prefix = f"layers.{layer}."
        self.layer = layer
        self.attention_norm = RMSNorm(weights[prefix + "attn_norm"], args.norm_eps)
        self.attention = Attention(args, weights, prefix)
        self.ffn_norm = RMSNorm(weights[prefix + "ffn_norm"], args.norm_eps)
        self.feed_forward = FeedForward(weights, prefix)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, storage: KVStorage) -> torch.Tensor:
        fused = batch.fused
        h = x + self.attention(self.attention_norm(x, fused), batch, storage, self.layer)
        return h + self.feed_forward(self.ffn_norm(h, fused), fused)


class Transformer(nn.Module):
    """`weights` (HF layout, serving dtype): tok_embeddings, output, norm, and per layer
    layers.{i}.{attn_norm, wq, wk, wv, [bq, bk, bv], wo, ffn_norm, w1 (gate), w3 (up), w2}."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Parameter(weights["tok_embeddings"], requires_grad=False)
        self.layers = nn.ModuleList(Block(args, weights, i) for i in range(args.n_layers))
        self.norm = RMSNorm(weights["norm"], args.norm_eps)
        self.output = Linear(weights["output"])

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.device

    def forward(
        self, batch: ForwardBatch, storage: KVStorage, layers: LayersFn | None = None
    ) -> torch.Tensor:
        """-> logits [n_out, vocab] float32 for batch.logit_rows. `layers` (model.native) runs
        all the blocks at once instead of one module call each."""
        return self.output(self.hidden(batch, storage, layers)).float()

    def hidden(
        self, batch: ForwardBatch, storage: KVStorage, layers: LayersFn | None = None
    ) -> torch.Tensor:
        """-> the final-norm hidden states [n_out, dim] of batch.logit_rows (what `output`
        projects to logits; an embedding request's pooled vector)."""
        x = F.embedding(batch.tokens, self.tok_embeddings)  # [n, dim]
        if layers is not None:
            x = layers(x, batch, storage)
        else:
            for block in self.layers:
                x = block(x, batch, storage)
        return self.norm(x.index_select(0, batch.logit_rows), batch.fused)
