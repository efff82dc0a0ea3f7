"""The shared blocks the architectures are described over: RMSNorm, Linear, the gated MLP."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.arch import Activation
from model.layers.ggml import make_linear


class RMSNorm(nn.Module):
    """x / rms(x) * (shift + w); `shift` 1.0 is Gemma's (1 + w) (added once, in float32)."""

    def __init__(self, weight: torch.Tensor, eps: float, shift: float = 0.0) -> None:
        super().__init__()
        if shift:
            weight = (weight.float() + shift).to(weight.dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
        if fused is not None:  # one C++ pass (model/kernels/layers.cpp; bfloat16: torch's rounding)
            return fused.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Linear(nn.Module):
    """y = x @ weight.T + bias; model/layers/quant.py swaps these for quantized ones."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x): SwiGLU (act SiLU) or GeGLU (act tanh-GELU)."""

    def __init__(
        self, weights: dict[str, torch.Tensor], prefix: str, activation: Activation = "silu"
    ) -> None:
        super().__init__()
        self.w13 = make_linear([weights[prefix + "w1"], weights[prefix + "w3"]])  # gate, up
        self.w2 = make_linear([weights[prefix + "w2"]])
        self.activation = activation

    def forward(self, x: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
        if self.activation == "silu":
            if fused is not None:
                return self.w2(fused.silu_mul(self.w13(x)))
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.gelu(gate, approximate="tanh") * up)
