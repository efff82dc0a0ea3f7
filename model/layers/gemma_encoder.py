"""EmbeddingGemma for /v1/embeddings: Gemma 3's blocks (model/arch/gemma3.py's BLOCK: (1 + w)
RMSNorms before and after attention and MLP, q/k norms, GeGLU, per-layer RoPE bases) read with
bidirectional attention, then sentence-transformers' mean Pooling, its Dense layers and
Normalize.

Attention (transformers' Gemma3TextModel with use_bidirectional_attention, llama.cpp's
LLAMA_SWA_TYPE_SYMMETRIC): a global layer sees every token of the input; a sliding layer with
config.json's window W sees the keys with |q_pos - k_pos| <= W // 2 (transformers keeps
W // 2 + 1 as an exclusive bound, llama.cpp masks |d| > n_swa / 2).

Like the BERT encoder (model/layers/encoder.py) it keeps no KV cache: a batch is a set of whole
inputs, padded to the longest, the padding masked out of the keys and the pooling.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model.arch.embedding_gemma import LAYER_KEYS, GemmaEncoderArgs
from model.layers.encoder import embed_padded


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm in float32; `scale` is (1 + w), as llama.cpp's GGUF stores it."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale.float()
    return out.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, H, L, head_dim], cos / sin [L, head_dim / 2] (float32)."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., 2 * half :]), dim=-1)
    return out.to(x.dtype)


class GemmaEncoder(nn.Module):
    def __init__(self, args: GemmaEncoderArgs, weights: dict[str, torch.Tensor]) -> None:
        """`weights`: tok_embeddings, norm, layers.{i}.{LAYER_KEYS}, dense.{j}; norms as (1 + w)."""
        super().__init__()
        args.check()
        self.args = args
        self.register_buffer("tok_embd", weights["tok_embeddings"])
        self.register_buffer("norm", weights["norm"])
        for i in range(args.n_layers):
            for key in LAYER_KEYS:
                self.register_buffer(f"l{i}_{key}", weights[f"layers.{i}.{key}"])
        for j in range(len(args.dense)):
            self.register_buffer(f"dense{j}", weights[f"dense.{j}"])

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embd.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embd.device

    def _w(self, i: int, key: str) -> torch.Tensor:
        return getattr(self, f"l{i}_{key}")

    def _masks(self, real: torch.Tensor) -> dict[int, torch.Tensor]:
        """Per window (0: global) the [B, 1, L, L] mask of the keys each query reads."""
        n = real.shape[1]
        pos = torch.arange(n, device=real.device)
        # NOTE: every query also sees itself, so a padding query's softmax stays finite
        self_only = pos[:, None] == pos[None, :]
        masks = {}
        for window in set(self.args.model.windows or (0,)):
            near = (pos[:, None] - pos[None, :]).abs() <= window // 2 if window else True
            masks[window] = ((real[:, None, :] & near) | self_only)[:, None]
        return masks

    def _layer(
        self, i: int, x: torch.Tensor, mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        m = self.args.model
        eps = m.norm_eps
        b, n, _ = x.shape
        h = rms_norm(x, self._w(i, "attn_norm"), eps)
        q = F.linear(h, self._w(i, "wq")).view(b, n, m.n_heads, m.head_dim)
        k = F.linear(h, self._w(i, "wk")).view(b, n, m.n_kv_heads, m.head_dim)
        v = F.linear(h, self._w(i, "wv")).view(b, n, m.n_kv_heads, m.head_dim)
        q = rotate(rms_norm(q, self._w(i, "q_norm"), eps).transpose(1, 2), *rope)
        k = rotate(rms_norm(k, self._w(i, "k_norm"), eps).transpose(1, 2), *rope)
        v = v.transpose(1, 2)  # q: [B, n_heads, L, head_dim]; k, v: [B, n_kv_heads, L, head_dim]
        group = m.n_heads // m.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scale = m.attn_scale if m.attn_scale is not None else m.head_dim**-0.5
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        att = F.linear(att.transpose(1, 2).reshape(b, n, -1), self._w(i, "wo"))
        x = x + rms_norm(att, self._w(i, "post_attn_norm"), eps)
        h = rms_norm(x, self._w(i, "ffn_norm"), eps)
        gate = F.gelu(F.linear(h, self._w(i, "w1")), approximate="tanh")
        mlp = F.linear(gate * F.linear(h, self._w(i, "w3")), self._w(i, "w2"))
        return x + rms_norm(mlp, self._w(i, "post_ffn_norm"), eps)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids: [B, L] (padded past each length), lengths: [B] -> vectors [B, args.dim]
        (float32, L2-normalised when args.normalize)."""
        m = self.args.model
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)
        real = pos[None, :] < lengths[:, None]  # [B, L]
        # NOTE: sqrt(dim) rounded to the weights' dtype first, as transformers' Gemma3
        x = self.tok_embd[ids] * torch.tensor(m.dim**0.5, dtype=self.dtype)
        masks = self._masks(real)
        rope_full = m.rope.cos_sin(pos)  # [L, head_dim / 2] each
        rope_swa = m.rope_swa.cos_sin(pos) if m.rope_swa is not None else rope_full
        for i in range(m.n_layers):
            window = m.windows[i] if m.windows else 0
            x = self._layer(i, x, masks[window], rope_swa if window else rope_full)
        x = rms_norm(x, self.norm, m.norm_eps).float()
        keep = real[..., None].to(x.dtype)
        out = (x * keep).sum(1) / lengths[:, None].to(x.dtype)  # [B, dim]: mean pooling
        for j in range(len(self.args.dense)):
            out = F.linear(out, getattr(self, f"dense{j}").float())  # no bias, identity
        if self.args.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One vector per token list: [len(inputs), args.dim] float32 (encoder.embed_padded)."""
        return embed_padded(self, inputs, self.args.n_ctx, self.args.dim)
