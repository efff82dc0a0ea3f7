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
    """w2(act(w1 x [+ b1]) * w3 x [+ b3]) [+ b2]: SwiGLU (act SiLU), GeGLU (act tanh-GELU), or
    gpt-oss's clamped SwiGLU ("swiglu_oai": swiglu_oai below; the biases are its experts')."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        prefix: str,
        activation: Activation = "silu",
        swiglu: tuple[float, float] = (1.702, 7.0),  # "swiglu_oai"'s (alpha, limit)
    ) -> None:
        super().__init__()
        b13 = b2 = None
        if prefix + "b1" in weights:
            b13 = torch.cat([weights[prefix + "b1"], weights[prefix + "b3"]])
            b2 = weights[prefix + "b2"]
        self.w13 = make_linear([weights[prefix + "w1"], weights[prefix + "w3"]], b13)  # gate, up
        self.w2 = make_linear([weights[prefix + "w2"]], b2)
        self.activation = activation
        self.swiglu = swiglu

    def forward(self, x: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
        if self.activation == "silu":
            if fused is not None:
                return self.w2(fused.silu_mul(self.w13(x)))
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        gate, up = self.w13(x).chunk(2, dim=-1)
        if self.activation == "swiglu_oai":
            return self.w2(swiglu_oai(gate, up, *self.swiglu))
        return self.w2(F.gelu(gate, approximate="tanh") * up)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation (transformers' GptOssExperts._apply_gate, llama.cpp's swiglu_oai):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
