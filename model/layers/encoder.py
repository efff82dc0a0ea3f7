"""BERT-style encoder for /v1/embeddings: absolute positions, post-norm blocks, bidirectional
attention over each whole input, then pooling (sentence-transformers' Pooling module) and an
optional L2 normalisation (its Normalize module).

An encoder keeps no KV cache: every input is read whole in one forward, so a batch is a set of
independent token lists (padded here to the longest, the padding masked out of the keys and of
the pooling).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model.arch.bert import EMBED_NAMES, EncoderArgs, layer_names


class EncoderLayer(nn.Module):
    def __init__(self, args: EncoderArgs, w: dict[str, torch.Tensor], i: int) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.eps = args.norm_eps
        for key, module in layer_names(i).items():
            self.register_buffer(key, w[module + ".weight"])
            self.register_buffer(key + "_b", w[module + ".bias"])

    def _lin(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return F.linear(x, getattr(self, key), getattr(self, key + "_b"))

    def _norm(self, x: torch.Tensor, key: str) -> torch.Tensor:
        w = getattr(self, key)
        return F.layer_norm(x, w.shape, w, getattr(self, key + "_b"), self.eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # x: [B, L, dim]; key_mask: [B, 1, 1, L] True where the key is a real token
        b, n, dim = x.shape
        q, k, v = (
            self._lin(x, name).view(b, n, self.n_heads, -1).transpose(1, 2)
            for name in ("wq", "wk", "wv")
        )  # [B, n_heads, L, head_dim]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        att = att.transpose(1, 2).reshape(b, n, dim)
        x = self._norm(x + self._lin(att, "wo"), "attn_norm")
        h = F.gelu(self._lin(x, "w_up"))  # BERT's "gelu": the exact (erf) one
        return self._norm(x + self._lin(h, "w_down"), "ffn_norm")


class Encoder(nn.Module):
    def __init__(self, args: EncoderArgs, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        args.check()
        self.args = args
        for key, name in EMBED_NAMES.items():
            if key == "norm":
                self.register_buffer("norm_w", weights[name + ".weight"])
                self.register_buffer("norm_b", weights[name + ".bias"])
            else:
                self.register_buffer(key, weights[name])
        self.layers = nn.ModuleList(EncoderLayer(args, weights, i) for i in range(args.n_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embd.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embd.device

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """ids: [B, L] (padded past each length), lengths: [B] -> pooled vectors [B, dim]
        (float32, L2-normalised when args.normalize)."""
        b, n = ids.shape
        pos = torch.arange(n, device=ids.device)
        real = pos[None, :] < lengths[:, None]  # [B, L]
        # NOTE: token type 0 for every token: one input is one segment ("sequence A")
        x = self.tok_embd[ids] + self.pos_embd[pos][None] + self.type_embd[0]
        x = F.layer_norm(x, self.norm_w.shape, self.norm_w, self.norm_b, self.args.norm_eps)
        key_mask = real[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        return self._pool(x.float(), real, lengths)

    def _pool(self, x: torch.Tensor, real: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pooling = self.args.pooling
        if pooling == "mean":
            keep = real[..., None].to(x.dtype)
            out = (x * keep).sum(1) / lengths[:, None].to(x.dtype)
        elif pooling == "cls":
            out = x[:, 0]
        else:  # "last"
            out = x[torch.arange(x.shape[0], device=x.device), lengths - 1]
        if self.args.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One pooled vector per token list: [len(inputs), dim] float32 (embed_padded)."""
        return embed_padded(self, inputs, self.args.n_ctx, self.args.dim)


class PaddedEncoder(Protocol):
    @property
    def device(self) -> torch.device: ...

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...


@torch.inference_mode()
def embed_padded(model: PaddedEncoder, inputs: list[list[int]], n_ctx: int, dim: int) -> np.ndarray:
    """One vector per token list through `model.forward(ids [B, n], lengths [B]) -> [B, dim]`:
    [len(inputs), dim] float32; inputs of similar lengths share a padded forward (length_groups)."""
    lengths = [len(ids) for ids in inputs]
    if min(lengths) < 1 or max(lengths) > n_ctx:
        raise ValueError(f"an input has {max(lengths)} tokens; at most {n_ctx}")
    out = np.empty((len(inputs), dim), dtype=np.float32)
    for group in length_groups(lengths):
        n = lengths[group[0]]  # the longest first
        ids = torch.zeros(len(group), n, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = torch.as_tensor(inputs[i], dtype=torch.long)
        sizes = torch.as_tensor([lengths[i] for i in group], device=model.device)
        out[group] = model.forward(ids.to(model.device), sizes).cpu().numpy()
    return out


def length_groups(lengths: list[int], slack: float = 1.5, pad_free: int = 64) -> list[list[int]]:
    """Indices of `lengths`, longest first, cut into groups that each pad to their longest with
    at most `slack` times their real tokens (or `pad_free` padded tokens per row at least):
    one 250-token input beside sixty 5-token ones would otherwise pad 61 x 250."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * lengths[group[0]]
            if padded <= max(slack * (real + lengths[i]), pad_free * (len(group) + 1)):
                group.append(i)
                real += lengths[i]
                continue
        groups.append([i])
        real = lengths[i]
    return groups
