"""The Mamba (1) mixer over state slots (transformers' MambaMixer torch path, FalconMambaMixer's
and JambaMambaMixer's dt / B / C norms; llama.cpp's build_mamba_layer; model.arch.MambaArgs has
the per-token math).

Decode rows take one batched recurrence step over their slots; a prompt chunk runs the
selective scan from its slot's state one row after another (A is per channel and state, so
Mamba2's chunked SSD form does not apply), split at its captures. The discretized A and B x of
a whole chunk are computed at once; the loop is one fused multiply-add over [d_inner, N] a row.
The SSM runs in float32 whatever the model dtype; the conv state is kept in the model dtype.

With the C++ kernels (ForwardBatch.fused) the mixer between its two linears is their
mamba_mix (model/kernels/mamba.cpp: the same math with the scans fused, a prompt chunk's
channel by channel with each state kept local over its rows, decode rows' conv summed in
float32), the op the one-call step (model/runner/native.py) calls too, so both paths give the
same bits; without them, the torch ops below (the float32 reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.state_storage import RecurrentStorage
from model.arch import MambaArgs, ModelArgs
from model.layers.batch import ForwardBatch, StatePrompt
from model.layers.blocks import Linear
from model.layers.ggml import BlockWeight, make_linear
from model.layers.mamba2 import _pad_rows

# Rows of a prompt chunk whose discretized A and B x ([rows, d_inner, N] float32 each) are
# held at once: 256 x 8192 x 16 x 4 B = 128 MiB each at Falcon-Mamba-7B's and Jamba's d_inner
SCAN_ROWS = 256
# mamba_mix's limits (model/kernels/mamba.cpp): a model past them keeps the torch ops
KERNEL_MAX_STATE = 256


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    rows: int = SCAN_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = exp(dt_t a) S_{t-1} + (dt_t x_t) (outer) B_t, y_t = S_t C_t, row by row.

    x, dt [L, D], a [D, N], b, c [L, N], state [D, N] (all float32) -> y [L, D] (without the
    D skip), the state after the L rows (a new tensor; `state` is not written)."""
    ys = []
    for lo in range(0, x.shape[0], rows):
        hi = min(lo + rows, x.shape[0])
        decay = torch.exp(dt[lo:hi, :, None] * a)  # [T, D, N]
        states = (dt[lo:hi] * x[lo:hi])[:, :, None] * b[lo:hi, None, :]  # B x, then S
        for t in range(hi - lo):
            state = torch.addcmul(states[t], decay[t], state, out=states[t])
        ys.append(torch.bmm(states, c[lo:hi, :, None])[:, :, 0])
        state = state.clone()  # not a view of `states`, which goes with the chunk
    return torch.cat(ys), state


class MambaMixer(nn.Module):
    """`weights` prefix + ssm_in [2 d_inner, dim] (rows x, z), ssm_conv [d_inner, K], ssm_x
    [dt_rank + 2 N, d_inner], ssm_dt [d_inner, dt_rank], ssm_dt_b, ssm_a (= -exp(A_log))
    [d_inner, N], ssm_d [d_inner], ssm_out [dim, d_inner], and the optional ssm_in_b,
    ssm_conv_b, ssm_out_b and (Jamba) ssm_dt_norm, ssm_b_norm, ssm_c_norm
    (model.arch.weights.layer_weights). ssm_in / ssm_out may be a GGUF's own blocks; the small
    ssm_x and ssm_dt run in float32 (they are 2-6% of the layer)."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        assert args.mamba is not None
        self.m: MambaArgs = args.mamba
        m = self.m

        def param(name: str, float32: bool = False) -> nn.Parameter:
            w = weights[prefix + name]
            return nn.Parameter(w.float() if float32 else w, requires_grad=False)

        w_in, b_in = weights[prefix + "ssm_in"], weights.get(prefix + "ssm_in_b")
        dense = not isinstance(w_in, BlockWeight)  # a GGUF's own blocks take any row count
        self.in_proj = Linear(*_pad_rows(w_in, b_in)) if dense else make_linear([w_in], b_in)
        self.conv_w = param("ssm_conv")  # [d_inner, K]: column K-1 multiplies the newest row
        self.conv_b = param("ssm_conv_b") if m.conv_bias else None
        self.x_w = param("ssm_x", True)
        self.dt_w, self.dt_b = param("ssm_dt", True), param("ssm_dt_b", True)
        self.a, self.d = param("ssm_a", True), param("ssm_d", True)
        self.norms: tuple[torch.Tensor | None, ...] | None = None  # dt, B, C
        if m.dt_b_c_norm == "plain":
            self.norms = (None, None, None)
        elif m.dt_b_c_norm == "weighted":
            self.norms = tuple(param(k, True) for k in ("ssm_dt_norm", "ssm_b_norm", "ssm_c_norm"))
        self.out_proj = make_linear(
            [weights[prefix + "ssm_out"]], weights.get(prefix + "ssm_out_b")
        )
        self._native: Any | None = None  # native_params' StepMamba

    def kernel_takes(self, kernels: Any, state_dtype: torch.dtype) -> bool:
        """Whether `kernels`' mamba_mix runs this mixer over conv states of `state_dtype`."""
        m = self.m
        return (
            hasattr(kernels, "mamba_mix")
            and state_dtype in (torch.bfloat16, torch.float32)
            and self.conv_w.dtype == state_dtype
            and m.d_conv >= 2
            and m.d_state <= KERNEL_MAX_STATE
        )

    def native_params(self, kernels: Any) -> Any:
        """This mixer's parameters and sizes as `kernels`' StepMamba (mamba_mix)."""
        if self._native is None:
            m, p = self.m, kernels.StepMamba()
            p.conv_w, p.conv_b = self.conv_w.detach(), None
            if self.conv_b is not None:
                p.conv_b = self.conv_b.detach()
            p.x_w, p.dt_w, p.dt_b = self.x_w.detach(), self.dt_w.detach(), self.dt_b.detach()
            p.a, p.d = self.a.detach(), self.d.detach()
            p.norm = self.norms is not None
            if self.norms is not None:
                p.dt_norm, p.b_norm, p.c_norm = (
                    None if w is None else w.detach() for w in self.norms
                )
            p.d_inner, p.d_state, p.d_conv, p.dt_rank = m.d_inner, m.d_state, m.d_conv, m.dt_rank
            p.eps = m.norm_eps
            self._native = p
        return self._native

    def forward(
        self, u: torch.Tensor, batch: ForwardBatch, storage: object, layer: int
    ) -> torch.Tensor:
        """u [n, dim] (the normed block input) -> [n, dim]; reads and writes the slots of
        `storage.state` (a kvcache.storage.GroupedKVStorage with a RecurrentStorage)."""
        state = getattr(storage, "state", None)
        assert isinstance(state, RecurrentStorage), "a recurrent layer needs the state storage"
        sb = batch.state
        assert sb is not None, "the worker builds ForwardBatch.state for recurrent layers"
        d_inner = self.m.d_inner
        conv, ssm = state.conv(layer), state.ssm(layer)
        kernels = batch.fused
        if kernels is not None and self.kernel_takes(kernels, conv.dtype):
            params, st = self.native_params(kernels), sb.native_state(kernels)
            return self.out_proj(kernels.mamba_mix(self.in_proj(u), conv, ssm, params, st))
        x, z = self.in_proj(u)[:, : 2 * d_inner].split(d_inner, dim=-1)
        y = sb.run(
            torch.zeros(u.shape[0], d_inner, dtype=torch.float32, device=u.device),
            (x,),
            lambda xs: self._step(xs, conv, ssm, sb.decode_slots, sb.decode_run),
            lambda xs, p: self._scan(xs, conv, ssm, p),
        )
        return self.out_proj((y * F.silu(z.float())).to(u.dtype))

    def _ssm_inputs(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xc [L, d_inner] (after the conv and SiLU, float32) -> dt [L, d_inner] (softplus'd),
        B, C [L, N]."""
        m = self.m
        dt, b, c = F.linear(xc, self.x_w).split((m.dt_rank, m.d_state, m.d_state), dim=-1)
        if self.norms is not None:
            dt, b, c = (self._rms(t, w) for t, w in zip((dt, b, c), self.norms, strict=True))
        return F.softplus(F.linear(dt, self.dt_w, self.dt_b)), b, c

    def _rms(self, t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.m.norm_eps)
        return t if w is None else t * w

    def _conv_out(self, window: torch.Tensor) -> torch.Tensor:
        """window [.., d_inner, K] (oldest first) -> silu(depthwise conv) [.., d_inner] f32."""
        out = (window * self.conv_w).sum(-1)
        return F.silu(out if self.conv_b is None else out + self.conv_b).float()

    def _step(
        self,
        x: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        slots: torch.Tensor,
        run: tuple[int, int] | None,
    ) -> torch.Tensor:
        """One token per sequence: x [B, d_inner] -> y [B, d_inner] float32 (with the D skip);
        the states of `slots` [B] (the range `run` when they are one) move one step."""
        window = torch.cat((conv.index_select(0, slots), x.to(conv.dtype)[:, :, None]), dim=2)
        conv.index_copy_(0, slots, window[:, :, 1:])
        xc = self._conv_out(window)
        dt, b, c = self._ssm_inputs(xc)
        st = ssm[run[0] : run[1]] if run is not None else ssm.index_select(0, slots)
        st.mul_(torch.exp(dt[:, :, None] * self.a))  # [B, D, N]
        st.add_((dt * xc)[:, :, None] * b[:, None, :])
        if run is None:
            ssm.index_copy_(0, slots, st)
        return torch.bmm(st, c[:, :, None])[:, :, 0] + self.d * xc

    def _scan(
        self, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, p: StatePrompt
    ) -> torch.Tensor:
        """A chunk of one sequence: x [L, d_inner] -> y [L, d_inner] float32 (with the D skip);
        p.slot's state moves L steps, each capture's slot gets the state at its row."""
        k1, n = self.m.d_conv - 1, x.shape[0]
        raw = torch.cat((conv[p.slot], x.to(conv.dtype).T), dim=1)  # [d_inner, K-1 + L]
        out = F.conv1d(raw[None], self.conv_w[:, None, :], self.conv_b, groups=raw.shape[0])
        xc = F.silu(out[0]).T.float()
        dt, b, c = self._ssm_inputs(xc)
        st, ys, lo = ssm[p.slot], [], 0
        for r, slot in [*p.captures, (n, p.slot)]:
            if r > lo:
                y, st = selective_scan(xc[lo:r], dt[lo:r], self.a, b[lo:r], c[lo:r], st)
                ys.append(y)
            conv[slot] = raw[:, r : r + k1]  # the last K-1 raw rows consumed at r
            ssm[slot] = st
            lo = r
        return torch.cat(ys) + self.d * xc
