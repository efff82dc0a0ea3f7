"""LFM2's gated short convolution over state slots (transformers' Lfm2ShortConv, llama.cpp's
build_shortconv_block).

Per token u: B, C, x = split(in_proj u, 3); v = B * x; w = causal depthwise conv of v over the
last L tokens (kernel L, no bias); out = out_proj(C * w). The state of a sequence is its last
L - 1 values of v, oldest first (kvcache/state_storage.py's conv; the ssm part is empty).

With the C++ kernels (ForwardBatch.fused) the convolution is their short_conv, the op the
one-call step (model/runner/native.py) calls too, so both paths give the same bits; without
them, the torch ops below (the float32 reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.state_storage import RecurrentStorage
from model.arch import ModelArgs
from model.layers.batch import ForwardBatch, StatePrompt
from model.layers.ggml import make_linear


class ShortConvMixer(nn.Module):
    """`weights` prefix + shortconv_in [3 dim, dim] (rows B, C, x), shortconv_conv [dim, L]
    (column L - 1 multiplies the newest token), shortconv_out [dim, dim]; the projections may
    be a GGUF's own blocks (model/layers/ggml.py)."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.in_proj = make_linear([weights[prefix + "shortconv_in"]])
        self.conv_w = nn.Parameter(weights[prefix + "shortconv_conv"], requires_grad=False)
        self.out_proj = make_linear([weights[prefix + "shortconv_out"]])

    def forward(
        self, u: torch.Tensor, batch: ForwardBatch, storage: object, layer: int
    ) -> torch.Tensor:
        """u [n, dim] (the normed block input) -> [n, dim]; reads and writes the slots of
        `storage.state` (a kvcache.storage.GroupedKVStorage with a RecurrentStorage)."""
        state = getattr(storage, "state", None)
        assert isinstance(state, RecurrentStorage), "a recurrent layer needs the state storage"
        sb = batch.state
        assert sb is not None, "the worker builds ForwardBatch.state for recurrent layers"
        b, c, x = self.in_proj(u).chunk(3, dim=-1)
        conv = state.conv(layer)  # [n_slots, dim, L - 1]
        v = (b * x).to(conv.dtype)  # [n, dim]
        kernels = batch.fused
        if kernels is not None and v.dtype in (torch.bfloat16, torch.float32):
            w = kernels.short_conv(v, conv, self.conv_w, sb.native_state(kernels))
            return self.out_proj(c * w.to(c.dtype))
        w = sb.run(  # rows in no group (batch-invariant padding) stay 0
            torch.zeros_like(v),
            (v,),
            lambda vs: self._step(vs, conv, sb.decode_slots),
            lambda vs, p: self._scan(vs, conv, p),
        )
        return self.out_proj(c * w.to(c.dtype))

    def _step(self, v: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per sequence: v [B, dim] -> [B, dim]; the states of `slots` [B] move."""
        window = torch.cat((conv.index_select(0, slots), v[:, :, None]), dim=2)  # [B, dim, L]
        conv.index_copy_(0, slots, window[:, :, 1:])
        return (window * self.conv_w).sum(-1)

    def _scan(self, v: torch.Tensor, conv: torch.Tensor, p: StatePrompt) -> torch.Tensor:
        """A chunk of one sequence: v [n, dim] -> [n, dim] from p.slot's state, which moves n
        steps; each capture's slot gets the state at its row."""
        k1 = conv.shape[-1]
        raw = torch.cat((conv[p.slot], v.T), dim=1)  # [dim, L - 1 + n]
        out = F.conv1d(raw[None], self.conv_w[:, None, :], groups=raw.shape[0])[0]
        for r, slot in [*p.captures, (v.shape[0], p.slot)]:
            conv[slot] = raw[:, r : r + k1]  # the last L - 1 values consumed at row r
        return out.T
