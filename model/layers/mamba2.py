"""The Mamba2 mixer over state slots (transformers' Mamba2Mixer torch path, llama.cpp's
build_mamba2_layer; model.arch.SSMArgs has the per-token math).

Decode rows take one batched recurrence step over their slots; a prompt chunk runs the
chunked SSD scan (Mamba2 paper, section 6: quadratic inside a chunk, the state carried
between chunks) from its slot's state, split at its captures; a short chunk, or one cut at
most of its rows (a verification's drafts), steps row by row instead (BY_ROWS). Any split of
a prompt gives the same state up to float rounding: it is one linear recurrence. The SSM runs
in float32 whatever the model dtype; the conv state is kept in the model dtype.

With the C++ kernels (ForwardBatch.fused) the mixer between its two linears is their
mamba2_mix (model/kernels/mamba2.cpp: these torch ops, one for one, in ATen), the op the
one-call step (model/runner/native.py) calls too, so both paths give the same bits; without
them, the torch ops below (the float32 reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.state_storage import RecurrentStorage
from model.arch import ModelArgs, SSMArgs
from model.layers.batch import ForwardBatch, StatePrompt
from model.layers.blocks import Linear
from model.layers.ggml import BlockWeight, make_linear

# Rows per SSD chunk: the intra-chunk part costs H * T^2 * (N + P), the state part
# H * T * P * N per chunk; 64 balances them for P = 64, N = 128 (Granite 4.0-H, Mamba2-2.7B).
SCAN_CHUNK = 64
# Rows up to which a chunk runs the decode recurrence row by row instead of the SSD scan, as do
# chunks cut at half their rows or more (speculative decoding's verification captures the state
# before every drafted row): a pass over the state per row against ~20 ops per scanned segment
# (bench/recurrent_spec_bench.py). model/kernels/mamba2.cpp's kByRows.
BY_ROWS = 16
# NOTE: ssm_in has 2 d_inner + 2 G N + H rows, and H need not be a multiple of 16, which
# model/layers/quant.py's int4 packing needs: the projection gets zero rows up to a multiple of it.
PROJ_ROWS = 16


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int = SCAN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence S_t = exp(dt_t a) S_{t-1} + dt_t x_t (outer) B_t, y_t = S_t C_t, in chunks;
    head h reads group h // (H / G) of B and C.

    x [L, H, P], dt [L, H], a [H], b, c [L, G, N], state [H, P, N] (all float32)
    -> y [L, H, P] (without the D skip), the state after the L rows.

    NOTE: the heads of a group share B and C, so C B^T and the state products run per group
    with the group's heads folded into P (2.5x faster than per head at H 48, G 1)."""
    n_rows, h, p = x.shape
    g, n = b.shape[1:]
    hg = h // g
    xh, dth = x.permute(1, 0, 2), dt.T  # [H, L, P], [H, L]
    bg, cg = b.permute(1, 0, 2), c.permute(1, 0, 2)  # [G, L, N]
    ys = []
    for lo in range(0, n_rows, chunk):
        hi = min(lo + chunk, n_rows)
        t = hi - lo
        acum = torch.cumsum(dth[:, lo:hi] * a[:, None], dim=1)  # [H, T]: log decay from start
        seg = acum[:, :, None] - acum[:, None, :]  # [H, T(t), T(s)]: log decay from s to t
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril_()
        decay = torch.exp(seg.masked_fill_(~causal, float("-inf")))
        bc, cc = bg[:, lo:hi], cg[:, lo:hi]  # [G, T, N]
        scores = decay.view(g, hg, t, t) * torch.bmm(cc, bc.transpose(1, 2))[:, None]
        xdt = xh[:, lo:hi] * dth[:, lo:hi, None]  # [H, T, P]
        y = torch.bmm(scores.view(h, t, t), xdt)  # [H, T, P]
        from_state = torch.bmm(cc, state.view(g, hg * p, n).transpose(1, 2))  # [G, T, hg P]
        from_state = from_state.view(g, t, hg, p).transpose(1, 2).reshape(h, t, p)
        ys.append(y + from_state * torch.exp(acum)[:, :, None])
        to_end = torch.exp(acum[:, -1:] - acum)  # [H, T]
        w = (xdt * to_end[:, :, None]).view(g, hg, t, p).transpose(2, 3).reshape(g, hg * p, t)
        state = state * torch.exp(acum[:, -1])[:, None, None] + torch.bmm(w, bc).view(h, p, n)
    return torch.cat(ys, dim=1).transpose(0, 1), state


def _pad_rows(
    w: torch.Tensor, b: torch.Tensor | None, multiple: int = PROJ_ROWS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero rows up to a multiple of `multiple` output features (forward drops them)."""
    pad = -w.shape[0] % multiple
    if pad == 0:
        return w, b
    w = torch.cat((w, w.new_zeros(pad, w.shape[1])))
    return w, None if b is None else torch.cat((b, b.new_zeros(pad)))


class Mamba2Mixer(nn.Module):
    """`weights` prefix + ssm_in [d_in_proj, dim] (rows z, xBC, dt), ssm_conv [conv_dim, K],
    ssm_dt_b, ssm_a (= -exp(A_log)), ssm_d [H], ssm_norm [d_inner] (not with SSMArgs.norm
    "none"), ssm_out [dim, d_inner],
    and the optional biases ssm_in_b, ssm_conv_b, ssm_out_b (model.arch.weights.layer_weights)."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        assert args.ssm is not None
        self.ssm: SSMArgs = args.ssm
        s = self.ssm
        assert s.n_heads % s.n_groups == 0, "n_groups divides n_heads"

        def param(name: str) -> nn.Parameter:
            return nn.Parameter(weights[prefix + name], requires_grad=False)

        w_in, b_in = weights[prefix + "ssm_in"], weights.get(prefix + "ssm_in_b")
        # a GGUF's own blocks (BlockLinear) take any row count: no padding
        dense = not isinstance(w_in, BlockWeight)
        self.in_proj = Linear(*_pad_rows(w_in, b_in)) if dense else make_linear([w_in], b_in)
        self.conv_w = param("ssm_conv")  # [conv_dim, K]: column K-1 multiplies the newest row
        self.conv_b = param("ssm_conv_b") if s.conv_bias else None
        self.dt_bias = param("ssm_dt_b")
        self.a = param("ssm_a")
        self.d = param("ssm_d")
        self.norm_w = None if s.norm == "none" else param("ssm_norm")
        self.out_proj = make_linear(
            [weights[prefix + "ssm_out"]], weights.get(prefix + "ssm_out_b")
        )
        self._native: Any | None = None  # native_params' StepMamba2

    def native_params(self, kernels: Any) -> Any:
        """This mixer's parameters and sizes as `kernels`' StepMamba2 (mamba2_mix)."""
        if self._native is None:
            s, m = self.ssm, kernels.StepMamba2()
            m.conv_w, m.conv_b = self.conv_w.detach(), None
            if self.conv_b is not None:
                m.conv_b = self.conv_b.detach()
            m.dt_bias, m.a, m.d = self.dt_bias.detach(), self.a.detach(), self.d.detach()
            if self.norm_w is not None:
                m.norm_w = self.norm_w.detach()
            if s.norm != "after_gate":  # kernel_takes checked that the build has the field
                m.norm = ("after_gate", "before_gate", "none").index(s.norm)
            m.n_heads, m.head_dim, m.n_groups = s.n_heads, s.head_dim, s.n_groups
            m.d_state, m.d_inner, m.conv_dim, m.d_conv = s.d_state, s.d_inner, s.conv_dim, s.d_conv
            m.scan_chunk, m.eps = SCAN_CHUNK, s.norm_eps
            self._native = m
        return self._native

    def kernel_takes(self, kernels: Any) -> bool:
        """Whether `kernels`' mamba2_mix computes this mixer (a build from before the norm
        variants does Mamba2's gated norm only)."""
        if not hasattr(kernels, "mamba2_mix"):
            return False
        return self.ssm.norm == "after_gate" or hasattr(kernels.StepMamba2(), "norm")

    def forward(
        self, u: torch.Tensor, batch: ForwardBatch, storage: object, layer: int
    ) -> torch.Tensor:
        """u [n, dim] (the normed block input) -> [n, dim]; reads and writes the slots of
        `storage.state` (a kvcache.storage.GroupedKVStorage with a RecurrentStorage)."""
        state = getattr(storage, "state", None)
        assert isinstance(state, RecurrentStorage), "a recurrent layer needs the state storage"
        assert batch.state is not None, "the worker builds ForwardBatch.state for mamba2 layers"
        s, n = self.ssm, u.shape[0]
        kernels = batch.fused
        if kernels is not None and self.kernel_takes(kernels):
            conv, ssm = state.conv(layer), state.ssm(layer)
            params, st = self.native_params(kernels), batch.state.native_state(kernels)
            mixed = kernels.mamba2_mix(self.in_proj(u), conv, ssm, params, st)
            return self.out_proj(mixed.to(u.dtype))
        zxbcdt = self.in_proj(u)[:, : s.d_in_proj]
        z, xbc, dt = zxbcdt.split((s.d_inner, s.conv_dim, s.n_heads), dim=-1)
        conv, ssm = state.conv(layer), state.ssm(layer)
        sb = batch.state
        y = sb.run(
            torch.zeros(n, s.n_heads, s.head_dim, dtype=torch.float32, device=u.device),
            (xbc, dt),
            lambda xs, dts: self._step(xs, dts, conv, ssm, sb.decode_slots, sb.decode_run),
            lambda xs, dts, p: self._scan(xs, dts, conv, ssm, p),
        )
        return self.out_proj(self._gated_norm(y.view(n, s.d_inner), z).to(u.dtype))

    def _conv_out(self, window: torch.Tensor) -> torch.Tensor:
        """window [.., conv_dim, K] (oldest first) -> silu(depthwise conv) [.., conv_dim]."""
        out = (window * self.conv_w).sum(-1)
        return F.silu(out if self.conv_b is None else out + self.conv_b)

    def _ssm_inputs(
        self, xbc: torch.Tensor, dt: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """xbc [L, conv_dim] (after the conv), dt [L, H] raw -> x [L, H, P], B, C [L, G, N]
        (head h reads group h // (H / G)), dt [L, H], all float32."""
        s = self.ssm
        gn = s.n_groups * s.d_state
        x, b, c = xbc.float().split((s.d_inner, gn, gn), dim=-1)
        b = b.unflatten(-1, (s.n_groups, s.d_state))
        c = c.unflatten(-1, (s.n_groups, s.d_state))
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return x.unflatten(-1, (s.n_heads, s.head_dim)), b, c, dt

    def _step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        slots: torch.Tensor,
        run: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """One token per sequence: xbc [B, conv_dim], dt [B, H] -> y [B, H, P] float32;
        the states of `slots` [B] (the range `run` when they are one) move one step.

        NOTE: the state is the step's largest operand (Mamba2-130M: 18 MB a sequence,
        float32): it is updated in place, once, where the slots allow."""
        window = torch.cat((conv.index_select(0, slots), xbc.to(conv.dtype)[:, :, None]), dim=2)
        conv.index_copy_(0, slots, window[:, :, 1:])
        x, b, c, dt = self._ssm_inputs(self._conv_out(window), dt)
        return self._ssm_step(x, b, c, dt, ssm, slots, run)

    def _ssm_step(
        self,
        x: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        dt: torch.Tensor,
        ssm: torch.Tensor,
        slots: torch.Tensor | None,
        run: tuple[int, int] | None,
    ) -> torch.Tensor:
        """The SSM of _step (x [B, H, P], B, C [B, G, N], dt [B, H], float32) -> y [B, H, P],
        the D skip included."""
        s = self.ssm
        n_seq, g, hgp = x.shape[0], s.n_groups, s.d_inner // s.n_groups
        if run is not None:
            st = ssm[run[0] : run[1]]
        else:
            assert slots is not None, "the slots, or the one run of them"
            st = ssm.index_select(0, slots)
        st.mul_(torch.exp(dt * self.a.float())[:, :, None, None])  # [B, H, P, N]
        grouped = st.view(n_seq * g, hgp, s.d_state)
        xdt = (dt[:, :, None] * x).reshape(n_seq * g, hgp, 1)
        grouped.baddbmm_(xdt, b.reshape(n_seq * g, 1, s.d_state))  # + dt x (outer) B
        if slots is not None and run is None:
            ssm.index_copy_(0, slots, st)
        # NOTE: vecdot, not bmm: a batched matrix-vector product took 2.6 ms in bmm, 0.37 here
        y = torch.linalg.vecdot(grouped, c.reshape(n_seq * g, 1, s.d_state))
        return y.view_as(x) + self.d.float()[:, None] * x

    def _scan(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        p: StatePrompt,
    ) -> torch.Tensor:
        """A chunk of one sequence: xbc [L, conv_dim], dt [L, H] -> y [L, H, P] float32;
        p.slot's state moves L steps, each capture's slot gets the state at its row."""
        k1, n = self.ssm.d_conv - 1, xbc.shape[0]
        raw = torch.cat((conv[p.slot], xbc.to(conv.dtype).T), dim=1)  # [conv_dim, K-1 + L]
        out = F.conv1d(raw[None], self.conv_w[:, None, :], self.conv_b, groups=raw.shape[0])
        x, b, c, dt = self._ssm_inputs(F.silu(out[0]).T, dt)
        if n <= BY_ROWS or 2 * len(p.captures) >= n:  # the decode recurrence, row by row
            caps, ys = sorted(p.captures), []
            run = (p.slot, p.slot + 1)
            for r in range(n + 1):
                for slot in [slot for at, slot in caps if at == r]:
                    conv[slot] = raw[:, r : r + k1]
                    ssm[slot] = ssm[p.slot]
                if r < n:
                    rows = slice(r, r + 1)
                    ys.append(self._ssm_step(x[rows], b[rows], c[rows], dt[rows], ssm, None, run))
            conv[p.slot] = raw[:, n : n + k1]
            return torch.cat(ys)
        a = self.a.float()
        st, ys, lo = ssm[p.slot], [], 0
        for r, slot in [*p.captures, (n, p.slot)]:
            if r > lo:
                y, st = ssd_scan(x[lo:r], dt[lo:r], a, b[lo:r], c[lo:r], st)
                ys.append(y)
            conv[slot] = raw[:, r : r + k1]  # the last K-1 raw rows consumed at r
            ssm[slot] = st
            lo = r
        return torch.cat(ys) + self.d.float()[:, None] * x

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each of the G groups of y * silu(z) (norm_before_gate=False), of y then
        gated (Falcon-H1's norm_before_gate), or the gate alone (no norm); float32."""
        s, gate = self.ssm, F.silu(z.float())
        if self.norm_w is None:
            return y * gate
        g = y * gate if s.norm == "after_gate" else y
        g = g.unflatten(-1, (s.n_groups, s.d_inner // s.n_groups))
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.norm_eps)).flatten(-2)
        g = g * self.norm_w.float()
        return g * gate if s.norm == "before_gate" else g
