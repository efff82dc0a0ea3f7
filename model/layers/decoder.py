"""The decoder-only forward over the cell cache, built from an architecture's description
(model/arch): Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/3, SmolLM3, Gemma 2/3, Phi-3,
OLMo 2, EXAONE 4.0, GLM-4, Granite, the mixture-of-experts families (model/layers/moe.py), and
with Mamba2 mixers (model/layers/mamba2.py) over state slots, Mamba2 and Granite 4.0-H, and
with LFM2's gated short convolutions (model/layers/shortconv.py) over them.

Weights are in Hugging Face layout ([out_features, in_features], rotate-half RoPE, Gemma norms as
w of (1 + w)); the GGUF loader converts llama.cpp's layouts to it. The batch and its attention
groups are model/layers/batch.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.rope import rope_partner
from kvcache.rotation import hadamard
from kvcache.storage import KVStorage
from model.arch import ModelArgs
from model.arch.weights import weight_shapes
from model.kernels import DecodeAttention, PromptAttention
from model.layers.batch import DecodeGroup, ForwardBatch, PromptGroup
from model.layers.blocks import FeedForward, Linear, RMSNorm
from model.layers.ggml import BlockEmbedding, BlockWeight, make_linear
from model.layers.head import ReducedHead
from model.layers.mamba import MambaMixer
from model.layers.mamba2 import Mamba2Mixer
from model.layers.moe import MoEFeedForward
from model.layers.shortconv import ShortConvMixer

__all__ = [
    "Attention",
    "Block",
    "DecodeGroup",
    "FeedForward",
    "ForwardBatch",
    "Linear",
    "ModelArgs",
    "PromptGroup",
    "RMSNorm",
    "Transformer",
    "weight_shapes",
]

# Without the C++ kernel, decode groups of fewer sequences use SDPA (faster than two bmm calls
# for 1-2 sequences), larger ones gather + bmm.
SDPA_MAX_SEQS = 4
# The C++ decode kernel (model/kernels) reads K/V in place and, where it is built, attends every
# decode group: 30 layers of 32 sequences x 330 cells, bfloat16, 14-16 ms against ~100 for
# gather + bmm (the gathers allocate and copy 8 MB a layer); float32 33 vs 50 ms.


LayersFn = Callable[[torch.Tensor, ForwardBatch, KVStorage], torch.Tensor]


class Attention(nn.Module):
    def __init__(
        self, args: ModelArgs, weights: dict[str, torch.Tensor], prefix: str, layer: int = 0
    ) -> None:
        super().__init__()
        desc = args.layer_desc(layer)
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.layout = "neox" if desc.rope is None else desc.rope.layout
        self.rot = 0 if desc.rope is None else desc.rope.dim  # NoPE (Granite 4.0-H): none
        self.swa_rope = desc.swa_rope  # reads ForwardBatch.rope_swa
        self.window = desc.window
        self.scale = desc.scale
        self.sdpa_scale = args.attn_scale  # None: SDPA's own head_dim ** -0.5
        self.softcap = desc.softcap  # > 0: scores capped (Gemma 2): the kernels or _attend, no SDPA
        self.q_norm = self.k_norm = None
        self.qk_norm_full = desc.qk_norm_full
        if desc.qk_norm:
            shift, eps = desc.norm_shift, args.norm_eps
            self.q_norm = RMSNorm(weights[prefix + "q_norm"], eps, shift)
            self.k_norm = RMSNorm(weights[prefix + "k_norm"], eps, shift)
        bqkv = None
        if desc.qkv_bias:
            bqkv = torch.cat([weights[prefix + n] for n in ("bq", "bk", "bv")])
        self.wqkv = make_linear([weights[prefix + n] for n in ("wq", "wk", "wv")], bqkv)
        self.wo = make_linear(
            [weights[prefix + "wo"]], weights[prefix + "bo"] if desc.out_bias else None
        )
        # b_k [h_kv, hd] where the softmax is shift-invariant (no soft cap, no sinks): a quantized
        # cache stores K less a constant from it (kvcache/rotation.py k_center)
        shift_invariant = desc.qkv_bias and not desc.softcap and not desc.sinks
        bk = (
            weights[prefix + "bk"].float().reshape(self.n_kv_heads, -1) if shift_invariant else None
        )
        self.k_bias: torch.Tensor | None = bk
        # gpt-oss: one logit per query head in each softmax's denominator, float32 [h]; as the
        # soft cap: _attend or the kernels (where the build takes sinks: model/runner/paths.py)
        self.sinks: torch.Tensor | None  # [h]
        sinks = weights[prefix + "sinks"].float() if desc.sinks else None
        self.register_buffer("sinks", sinks, persistent=False)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, storage: KVStorage, layer: int
    ) -> torch.Tensor:
        n = x.shape[0]
        h, h_kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)  # [n, (h + 2 h_kv) * hd]
        qk = qkv[:, : (h + h_kv) * hd].view(n, h + h_kv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            fused = batch.fused
            if self.qk_norm_full:  # OLMoE: over the whole projections [n, h * hd], [n, h_kv * hd]
                q, k = qkv[:, : h * hd], qkv[:, h * hd : (h + h_kv) * hd]
                qk = torch.cat((self.q_norm(q, fused), self.k_norm(k, fused)), dim=1)
                qk = qk.view(n, h + h_kv, hd)
            else:
                qk = torch.cat(
                    (self.q_norm(qk[:, :h], fused), self.k_norm(qk[:, h:], fused)), dim=1
                )
        rope_c, rope_s = batch.rope_c, batch.rope_s
        if self.swa_rope:
            assert batch.rope_swa is not None, "the worker builds rope_swa for rope_swa models"
            rope_c, rope_s = batch.rope_swa
        if self.rot and batch.fused is not None and self.rot == hd and self.layout == "neox":
            qk = batch.fused.rope_neox_(qk, rope_c, rope_s)  # in place, as step_layers does
        elif self.rot:
            partner = rope_partner(qk, self.rot, self.layout)
            qk = torch.addcmul(qk * rope_c, partner, rope_s)
        center = storage.k_center(layer, qk.dtype)
        if center is not None:  # q . (k - c) = q . k - q . c: no softmax changes
            qk[:, h:].sub_(center)
        rot_k, rot_v = storage.rot_k, storage.rot_v  # a quantized cache's rotation (or 0)
        if rot_k:  # it stores H k: (H q) . (H k) = q . k (kvcache/rotation.py)
            qk = hadamard(qk, rot_k, batch.fused)
        q, k = qk.split((h, h_kv), dim=1)  # [n, h, hd], [n, h_kv, hd]
        v = qkv[:, (h + h_kv) * hd :].view(n, h_kv, hd)
        if rot_v:
            v = hadamard(v, rot_v, batch.fused)
        storage.write(layer, batch.write_cells(self.window), k, v)

        kernel = batch.decode_kernel
        decodes, prompts = batch.groups(self.window)
        if not prompts and len(decodes) == 1 and decodes[0].rows is None:
            out = self._decode(q, storage, layer, decodes[0], kernel)  # all decode, 1 group
        elif not decodes and len(prompts) == 1 and prompts[0].end == n:
            out = self._prompt(q, storage, layer, prompts[0], batch.prompt_kernel)
        else:
            out = x.new_empty(n, h, hd)
            for g in decodes:
                assert g.rows is not None, "a group of every row takes the branch above"
                out.index_copy_(0, g.rows, self._decode(q, storage, layer, g, kernel))
            for p in prompts:
                out[p.start : p.end] = self._prompt(
                    q[p.start : p.end], storage, layer, p, batch.prompt_kernel
                )
        if rot_v:  # the weighted sum of H v: H out, rotated back
            out = hadamard(out, rot_v, batch.fused)
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
        if kernel is not None and g.lens is not None:  # the worker checked the cache types
            qs = q if g.rows is None else q.index_select(0, g.rows)
            k, v = storage.k[layer], storage.v[layer]
            return kernel(qs, k, v, g.cells, g.lens, self.scale, self.softcap, *self._sinks)
        # GQA without repeat: the h / h_kv query heads of a kv head become its query rows,
        # batched over (kv head, sequence): [h_kv, n_seq, h / h_kv, hd].
        qd = q if g.rows is None else q.index_select(0, g.rows)
        qd = qd.view(n_seq, h_kv, self.n_heads // h_kv, hd).transpose(0, 1)
        k, v = storage.gather_heads(layer, g.kv_index)  # [h_kv, n_seq * max_kv, hd]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        k = k.unflatten(1, (n_seq, g.max_kv))  # a view, also of a slice of the cache
        v = v.unflatten(1, (n_seq, g.max_kv))
        if n_seq < SDPA_MAX_SEQS and not self.softcap and self.sinks is None:
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=g.bias, scale=self.sdpa_scale)
        else:
            # NOTE: two batched matmuls, not SDPA: the CPU flash kernel with 1-3 query rows
            # per head ran 2.6x slower at 32 sequences x 330 cells (bfloat16).
            sinks = None if self.sinks is None else self.sinks.view(h_kv, 1, -1, 1)
            o = self._attend(qd, k, v, g.bias, sinks)
        return o.transpose(0, 1).reshape(n_seq, self.n_heads, hd)

    @property
    def _sinks(self) -> tuple[torch.Tensor, ...]:
        """The kernels' optional last argument: none for a model without sinks (a build from
        before sinks takes none)."""
        return () if self.sinks is None else (self.sinks,)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """softmax(cap(scale q k^T) + bias) v over q [.., g, hd], k and v [.., n_kv, hd]; cap is
        softcap * tanh(s / softcap) (transformers' Gemma 2 eager attention) where softcap > 0.
        `sinks` [.., g, 1] (float32, broadcast over the scores): a last column in the softmax,
        dropped before v (transformers' GptOss eager attention, llama.cpp's soft_max sinks)."""
        scores = torch.matmul(q * self.scale, k.transpose(-1, -2))  # [.., g, n_kv]
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if bias is not None:
            scores = scores + bias
        if sinks is not None:
            col = sinks.expand(*scores.shape[:-1], 1)
            scores = torch.cat((scores.float(), col), dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(probs if probs.dtype == v.dtype else probs.to(v.dtype), v)

    def _prompt(
        self,
        q: torch.Tensor,
        storage: KVStorage,
        layer: int,
        p: PromptGroup,
        kernel: PromptAttention | None = None,
    ) -> torch.Tensor:
        if kernel is not None and p.lens is not None:  # the worker checked dtypes and shapes
            k, v = storage.k[layer], storage.v[layer]
            extra = self._sinks if p.firsts is None else (self.sinks, p.firsts)
            return kernel(q, k, v, p.cells, p.lens, self.scale, self.softcap, *extra)
        k, v = storage.gather_heads(layer, p.kv_index)  # [h_kv, n_kv, hd]
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        if self.softcap or self.sinks is not None:
            # the query heads of a kv head as its rows: [h_kv, group * L, hd]
            h_kv, n_q = self.n_kv_heads, q.shape[0]
            qg = q.view(n_q, h_kv, self.n_heads // h_kv, -1).permute(1, 2, 0, 3).flatten(1, 2)
            bias = torch.zeros(p.mask.shape, device=q.device).masked_fill_(~p.mask, -torch.inf)
            sinks = None
            if self.sinks is not None:  # per row of qg: its head's sink
                sinks = self.sinks.view(h_kv, -1, 1).repeat_interleave(n_q, dim=1)
            bias = bias.repeat(self.n_heads // h_kv, 1).to(q.dtype)
            o = self._attend(qg, k, v, bias, sinks)
            return o.unflatten(1, (self.n_heads // h_kv, n_q)).permute(2, 0, 1, 3).flatten(1, 2)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, h, L, hd]
            k[None],  # [1, h_kv, n_kv, hd]
            v[None],
            attn_mask=p.mask,
            scale=self.sdpa_scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)  # [L, h, hd]


class Block(nn.Module):
    """One layer as its model.arch.LayerDesc describes it: h = x + m * [post_attn_norm](mixer(
    attn_norm(x))); out = h + m * [post_ffn_norm](mlp(ffn_norm(h))), m = residual_mult; the
    mixer is Attention, Mamba2Mixer on a "mamba2" layer, MambaMixer on a "mamba" one,
    ShortConvMixer on a "shortconv" one, Attention + Mamba2Mixer summed on an "attn_mamba2" one;
    no MLP half without `ffn` (Mamba2); the MLP is MoEFeedForward on a `moe` layer
    (model/layers/moe.py).
    model/runner/native.py's C++ step reads the same desc and the same modules' weights."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], layer: int) -> None:
        super().__init__()
        prefix = f"layers.{layer}."
        desc, eps = args.layer_desc(layer), args.norm_eps
        self.desc = desc
        self.layer = layer
        self.residual_mult = desc.residual_mult
        self.attention_norm = None  # no pre-norms (OLMo 2): the sublayers read x and h as they are
        if desc.pre_norms:
            self.attention_norm = RMSNorm(weights[prefix + "attn_norm"], eps, desc.norm_shift)
        self.mixer: Attention | MambaMixer | Mamba2Mixer | ShortConvMixer
        if desc.mixer == "mamba2":
            self.mixer = Mamba2Mixer(args, weights, prefix)
        elif desc.mixer == "mamba":
            self.mixer = MambaMixer(args, weights, prefix)
        elif desc.mixer == "shortconv":
            self.mixer = ShortConvMixer(args, weights, prefix)
        else:
            self.mixer = Attention(args, weights, prefix, layer)
        # Falcon-H1 ("attn_mamba2"): a Mamba2 mixer beside the attention, its state at the
        # memory's state_layer, its output added to the attention's
        self.ssm_mixer: Mamba2Mixer | None = None
        self.state_layer = args.state_layer(layer)
        if desc.mixer == "attn_mamba2":
            self.ssm_mixer = Mamba2Mixer(args, weights, prefix)
        self.ffn_norm = None
        self.feed_forward: FeedForward | MoEFeedForward | None = None
        if desc.ffn and desc.pre_norms:
            self.ffn_norm = RMSNorm(weights[prefix + "ffn_norm"], eps, desc.norm_shift)
        if desc.ffn:
            self.feed_forward = (
                MoEFeedForward(args, weights, prefix, desc.activation)
                if desc.moe
                else FeedForward(weights, prefix, desc.activation)
            )
        self.post_attention_norm = self.post_ffn_norm = None
        if desc.post_norms:
            self.post_attention_norm = RMSNorm(
                weights[prefix + "post_attn_norm"], eps, desc.norm_shift
            )
            self.post_ffn_norm = RMSNorm(weights[prefix + "post_ffn_norm"], eps, desc.norm_shift)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, storage: KVStorage) -> torch.Tensor:
        fused, m = batch.fused, self.residual_mult
        a = x if self.attention_norm is None else self.attention_norm(x, fused)
        if self.ssm_mixer is not None:
            s = self.ssm_mixer(a, batch, storage, self.state_layer)
            a = self.mixer(a, batch, storage, self.layer) + s
        else:
            a = self.mixer(a, batch, storage, self.layer)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a, fused)
        h = x + a if m == 1.0 else x + a * m
        if self.feed_forward is None:
            return h
        f = self.feed_forward(h if self.ffn_norm is None else self.ffn_norm(h, fused), fused)
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f, fused)
        return h + f if m == 1.0 else h + f * m


class Transformer(nn.Module):
    """`weights` (HF layout, serving dtype): tok_embeddings, output, norm, and per layer
    layers.{i}.{...} of model.arch.weights.layer_weights(args): attn_norm, wq, wk, wv, [bq, bk, bv],
    [q_norm, k_norm], wo, [post_attn_norm], ffn_norm, w1 (gate), w3 (up), w2, [post_ffn_norm];
    a mamba2 layer has the ssm_* weights instead of the attention ones, a moe layer moe_router
    and w1_exps, w3_exps, w2_exps (each indexable by expert) instead of w1, w3, w2."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.args = args
        self.norm = RMSNorm(weights["norm"], args.norm_eps, args.block.norm_shift)
        embeddings = weights["tok_embeddings"]
        # GGUF block weights (model/layers/ggml.py): the table stays on its blocks
        self.tok_embeddings: nn.Parameter | BlockEmbedding = (
            BlockEmbedding(embeddings, self.norm.weight.dtype)
            if isinstance(embeddings, BlockWeight)
            else nn.Parameter(embeddings, requires_grad=False)
        )
        self.layers = nn.ModuleList(Block(args, weights, i) for i in range(args.n_layers))
        self.output = make_linear([weights["output"]])
        # NOTE: Gemma multiplies by sqrt(dim) rounded to the model dtype (transformers'
        # Gemma3TextScaledWordEmbedding); a buffer, so .to(dtype) rounds it again the same way.
        scale = torch.tensor(args.dim**0.5 if args.block.embed_scale else 1.0)
        self.register_buffer("embed_scale", scale.to(self.dtype), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.tok_embeddings, BlockEmbedding):
            return self.tok_embeddings(tokens)
        return F.embedding(tokens, self.tok_embeddings)

    def forward(
        self, batch: ForwardBatch, storage: KVStorage, layers: LayersFn | None = None
    ) -> torch.Tensor:
        """-> logits [n_out, vocab] float32 for batch.logit_rows. `layers` (model.runner.native)
        runs all the blocks at once instead of one module call each."""
        return self.logits(self.hidden(batch, storage, layers))

    def keep_head_rows(self, n: int) -> None:
        """Score token ids 0..n-1 only, and on demand the ids a step names (logits'
        `head_ids`): model/layers/head.py. Call before quantize()."""
        if not 0 < n <= self.args.vocab_size:
            raise ValueError(f"a head of {n} rows: the vocabulary has {self.args.vocab_size}")
        self.output = ReducedHead(self.output, n)

    def logits(self, hidden: torch.Tensor, head_ids: torch.Tensor | None = None) -> torch.Tensor:
        """final-norm hidden states [n, dim] -> logits [n, vocab] float32 (Granite divides
        them by logits_scaling; Gemma 2 caps them to c * tanh(logits / c)). A reduced head
        (keep_head_rows) scores its rows and `head_ids` (int64 ids, any order, repeats
        allowed); every other id's logit is -inf."""
        head = self.output
        reduced = isinstance(head, ReducedHead)
        out, ids = head.scored(hidden, head_ids) if reduced else (head(hidden).float(), None)
        scaling, cap = self.args.logits_scaling, self.args.final_softcap
        out = out if scaling == 1.0 else out / scaling
        out = out if not cap else torch.tanh(out / cap) * cap
        return out if ids is None else head.spread(out, ids, self.args.vocab_size)

    def hidden(
        self, batch: ForwardBatch, storage: KVStorage, layers: LayersFn | None = None
    ) -> torch.Tensor:
        """-> the final-norm hidden states [n_out, dim] of batch.logit_rows (what `output`
        projects to logits; an embedding request's pooled vector)."""
        x = self.embed(batch.tokens)  # [n, dim]
        if self.args.block.embed_scale:
            x = x * self.embed_scale
        if self.args.embed_mult != 1.0:
            x = x * self.args.embed_mult
        if layers is not None:
            x = layers(x, batch, storage)
        else:
            for block in self.layers:
                x = block(x, batch, storage)
        return self.norm(x.index_select(0, batch.logit_rows), batch.fused)
