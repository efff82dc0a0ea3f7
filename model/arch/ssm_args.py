"""The sizes of the recurrent mixers a ModelArgs names (model/arch/args.py re-exports them):
Mamba2's (Mamba2, Granite 4.0-H, Bamba, Falcon-H1) and Mamba (1)'s (Mamba, Falcon-Mamba, Jamba)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class SSMArgs:
    """Sizes of a Mamba2 mixer (transformers' Mamba2Mixer, llama.cpp's build_mamba2_layer).

    Per token u: z, xBC, dt = split(ssm_in u, [d_inner, conv_dim, n_heads]); xBC goes through
    the causal depthwise conv (kernel d_conv) and SiLU, then splits into x [n_heads, head_dim],
    B, C [n_groups, d_state] (head h reads group h // (n_heads / n_groups)); dt = softplus(dt +
    dt_bias); S = exp(dt A) S + dt x (outer) B; y = S C + D x; y = rmsnorm_groups(y * silu(z));
    out = ssm_out y. State per sequence: conv [conv_dim, d_conv - 1], ssm [n_heads, head_dim,
    d_state] (float32)."""

    n_heads: int  # H
    head_dim: int  # P: d_inner = H * P
    d_state: int  # N
    n_groups: int  # G, divides H
    d_conv: int  # K
    conv_bias: bool = True
    proj_bias: bool = False  # bias on ssm_in and ssm_out (Mamba2Config.use_bias)
    norm_eps: float = 1e-5  # of the gated group RMSNorm
    # where the group RMSNorm (ssm_norm) goes: Mamba2's norm(y * silu(z)); Falcon-H1's
    # mamba_norm_before_gate norm(y) * silu(z); "none": y * silu(z) (no mamba_rms_norm)
    norm: Literal["after_gate", "before_gate", "none"] = "after_gate"

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def d_in_proj(self) -> int:
        return self.d_inner + self.conv_dim + self.n_heads

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.conv_dim, self.d_conv - 1), (self.n_heads, self.head_dim, self.d_state))


@dataclass(frozen=True, slots=True)
class MambaArgs:
    """Sizes of a Mamba (1) mixer (transformers' MambaMixer, FalconMambaMixer and JambaMambaMixer,
    llama.cpp's build_mamba_layer).

    Per token u: x, z = split(ssm_in u, [d_inner, d_inner]); x goes through the causal
    depthwise conv (kernel d_conv) and SiLU; dt, B, C = split(ssm_x x, [dt_rank, N, N]), each
    RMS-normed where `dt_b_c_norm` says (Falcon-Mamba: without weights; Jamba: with ssm_dt_norm,
    ssm_b_norm, ssm_c_norm); dt = softplus(ssm_dt dt + ssm_dt_b) [d_inner]; per channel d and
    state n: S[d, n] = exp(dt[d] A[d, n]) S[d, n] + dt[d] x[d] B[n]; y = S C + D x;
    out = ssm_out(y * silu(z)). State per sequence: conv [d_inner, d_conv - 1], ssm [d_inner,
    d_state] (float32). Unlike Mamba2, A is per channel and state, not a scalar per head."""

    d_inner: int
    d_state: int  # N
    d_conv: int  # K
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False  # bias on ssm_in and ssm_out (MambaConfig.use_bias)
    dt_b_c_norm: Literal["none", "plain", "weighted"] = "none"
    norm_eps: float = 1e-6  # of the dt / B / C norms

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.d_inner, self.d_conv - 1), (self.d_inner, self.d_state))
