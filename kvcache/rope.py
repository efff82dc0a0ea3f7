"""RoPE: the rotation tables and the two pair layouts (GGUF's interleaved llama, HF's neox).

Used by the layers (rotating q and k before K is stored) and by the storage (the deferred
K-shift, llama.cpp's `build_k_shift`: rotating by `delta` after rotating by `p` equals rotating
by `p + delta`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

RopeLayout = Literal["interleaved", "neox"]


@dataclass(slots=True)
class RopeConfig:
    """`dim` rotated dims (<= head_dim) with base `theta`.

    layout "interleaved": pairs (x[2i], x[2i+1]) (llama.cpp LLAMA_ROPE_TYPE_NORM, GGUF llama);
    layout "neox": pairs (x[i], x[i + dim/2]) (HF rotate_half).
    freq_factors: optional [dim/2] divisors of the inverse frequencies (llama3 scaling).
    attn_factor: scales the rotation tables of q and k (LongRoPE's attention factor, llama.cpp's
    attn_factor), not the K-shift's pure rotations.
    """

    theta: float
    dim: int
    layout: RopeLayout = "neox"
    freq_factors: tuple[float, ...] | None = None
    attn_factor: float = 1.0

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        # NOTE: same float32 arithmetic as HF's _compute_default_rope_parameters.
        exps = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
        inv = 1.0 / (self.theta**exps)
        if self.freq_factors is not None:
            inv = inv / torch.tensor(self.freq_factors, dtype=torch.float32, device=device)
        return inv  # [dim/2] float32

    def cos_sin(
        self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation tables for integer `positions` [n] -> cos, sin: [n, dim/2] float32.

        The angle is formed in float64 so that composing rotations (the K-shift) is exact to
        float32 rounding even at large positions.
        """
        inv = self.inv_freq(positions.device) if inv_freq is None else inv_freq
        angles = positions.to(torch.float64)[:, None] * inv.to(torch.float64)[None, :]
        return angles.cos().float(), angles.sin().float()


def linear_rope(rope: RopeConfig, factor: float) -> RopeConfig:
    """Linear RoPE scaling: positions / factor, i.e. every inverse frequency / factor (on top of
    any divisors `rope` has); transformers' "linear" rope_type, llama.cpp's freq_scale."""
    if factor == 1.0:
        return rope
    base = rope.freq_factors or (1.0,) * (rope.dim // 2)
    return replace(rope, freq_factors=tuple(f * factor for f in base))


def yarn(
    theta: float,
    dim: int,
    factor: float,
    n_ctx_orig: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
    attn_factor: float | None = None,
) -> RopeConfig:
    """YaRN (arXiv:2309.00071) as per-pair divisors of the inverse frequencies: pair i rotates
    at inv_i * (r_i / factor + 1 - r_i), r_i the ramp from the pairs that turn more than
    beta_fast times over `n_ctx_orig` positions (r = 0: kept) to those under beta_slow
    (r = 1: interpolated); q and k scaled by 0.1 ln(factor) + 1 unless `attn_factor` is
    given. Matches transformers' _compute_yarn_parameters and llama.cpp's rope_yarn (its
    corr_dims floor / ceil the bounds: `truncate`)."""
    import math

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = high - low if high != low else 0.001
    factors = []
    for i in range(dim // 2):
        ramp = min(1.0, max(0.0, (i - low) / span))
        factors.append(1.0 / (ramp / factor + 1.0 - ramp))
    if attn_factor is None:
        attn_factor = 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0
    return RopeConfig(theta, dim, "neox", tuple(factors), attn_factor)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout
) -> torch.Tensor:
    """Rotate x: [n, n_heads, head_dim] by cos/sin: [n, dim/2] (computed in float32).

    Dims past `2 * cos.shape[-1]` are left as they are (partial rotary).
    """
    half = cos.shape[-1]
    rot = 2 * half
    xf = x[..., :rot].float()
    c = cos[:, None, :]  # [n, 1, dim/2]
    s = sin[:, None, :]
    if layout == "neox":
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    out = out.to(x.dtype)
    if rot == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot:]), dim=-1)


def rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, head_dim: int, layout: RopeLayout, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [n, dim/2] -> c, s: [n, 1, head_dim] in `dtype` with
    rope(x) = x * c + rope_partner(x) * s (the pass-through dims get c = 1, s = 0).

    Built once per batch, so each layer rotates with three ops instead of apply_rope's ten.
    """
    n, half = cos.shape
    if layout == "neox":
        c, s = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    else:
        c = cos.repeat_interleave(2, dim=-1)
        s = torch.stack((-sin, sin), dim=-1).flatten(-2)
    rest = head_dim - 2 * half
    if rest:
        c = torch.cat((c, c.new_ones(n, rest)), dim=-1)
        s = torch.cat((s, s.new_zeros(n, rest)), dim=-1)
    return c[:, None, :].to(dtype), s[:, None, :].to(dtype)


def rope_partner(x: torch.Tensor, rot: int, layout: RopeLayout) -> torch.Tensor:
    """The element each rotated dim pairs with: x[i + dim/2] / x[i - dim/2] (neox) or x[2i+1] /
    x[2i] (interleaved); the pass-through dims past `rot` are returned as they are."""
    half = rot // 2
    if layout == "neox":
        parts = [x[..., half:rot], x[..., :half]]
    else:
        parts = [x[..., :rot].unflatten(-1, (half, 2)).flip(-1).flatten(-2)]
    if rot < x.shape[-1]:
        parts.append(x[..., rot:])
    return torch.cat(parts, dim=-1)
