"""The rotation of a quantized K/V cache (llama.cpp's attention rotation, on by default there
for quantized cache types since 2026-04; `CELLSERVE_KV_ROTATION=0` turns it off here, as
`LLAMA_ATTN_ROT_DISABLE=1` does there).

A q8_0 / q4_0 row shares one scale per block of 32 values, so one large value (Qwen2.5's K
rows reach 218 against a row RMS of ~11) coarsens the step of the other 31. The attention
layers store H k and H v instead, H the orthonormal Walsh-Hadamard transform of each run of n
values of a head (K: n the largest power of two dividing head_dim; V: at most 64, llama.cpp's
sizes), which spreads an outlier's energy over the run before it is quantized. H is symmetric
and orthonormal (H H = I), so with q rotated too the scores are unchanged, (H q) . (H k) =
q . k, and the attention's output over H v is H times the output over v: rotated back once
per query head. Float cache types are stored as they are (nothing to gain). The stored rows
are rotated values, so a cell file records the rotation (kvcache/cell_file.py rows_geometry)
and a K-shift undoes it around RoPE (kvcache/storage.py).

A rotation spreads a constant over every block of its run, though, and some K rows carry a
large one: a K bias in RoPE's slowest dims, which barely turn over a context (Qwen2.5-1.5B's
layer 0: values up to 354 in rows of RMS 77). So where a layer's K has a bias, quantized K
rows are also stored less a constant c = the mean over the trained context's positions of
RoPE(b_k) (k_center): q . (k - c) = q . k - q . c, and q . c is the same for every key of a
query, so no softmax changes (not with a soft cap or sinks, which are not shift-invariant:
those layers keep their bias). The K-shift adds c back around RoPE; a cell file records it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kvcache.cache_types import CacheType
from kvcache.rope import RopeConfig, apply_rope

ENV = "CELLSERVE_KV_ROTATION"
_OFF = ("0", "off", "false", "no")
V_MAX = 64


def enabled() -> bool:
    """CELLSERVE_KV_ROTATION: unset or 1 / on: rotate quantized cache types; 0 / off: never."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in _OFF + ("1", "on", "true", "yes"):
        raise ValueError(f"{ENV}={value!r}: use 1 (rotate quantized K/V cells) or 0")
    return value not in _OFF


def rotation_size(t: CacheType, head_dim: int, rotate: bool | None = None, v: bool = False) -> int:
    """n of the transform K rows (V rows: `v`) of type `t` go through (0: stored as they are),
    for a quantized type while rotation is on (`rotate`; None: the environment's): K the
    largest power of two dividing head_dim, V at most 64 (llama.cpp's sizes: its authors
    measured smaller transforms better for V)."""
    if not t.quantized or not (enabled() if rotate is None else rotate):
        return 0
    n = head_dim & -head_dim
    return min(n, V_MAX) if v else n


@functools.cache
def _matrix(n: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """The block-diagonal [head_dim, head_dim] float32 matrix of H_n (Sylvester's order)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = (h / n**0.5).float()
    return torch.block_diag(*[h] * (head_dim // n)).to(device)


def hadamard(x: torch.Tensor, n: int, kernels: Any | None = None) -> torch.Tensor:
    """x [rows, heads, head_dim] with each run of n values of a head transformed by H_n. In
    place through the C++ kernel (`kernels`: the model.kernels module, CPU, bfloat16 or
    float32), which step_layers calls too; else a new tensor (a float32 matmul, rounded once
    to x's dtype: the same values to float32 rounding)."""
    if (
        kernels is not None
        and x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.stride(-1) == 1
        and hasattr(kernels, "hadamard_")
    ):
        return kernels.hadamard_(x, n)
    h = _matrix(n, x.shape[-1], x.device)
    return torch.matmul(x.float(), h).to(x.dtype)


def k_center(bias_k: torch.Tensor, rope: RopeConfig | None, n_positions: int) -> torch.Tensor:
    """c for K rows with bias `bias_k` [n_kv_heads, head_dim]: the mean of RoPE(b_k) over
    positions 0..n_positions-1 (the constant nearest to the bias's part of every row), float32
    [n_kv_heads, head_dim]. The mean of cos / sin(p t) over those positions in closed form:
    sin(n t / 2) / (n sin(t / 2)) times cos / sin((n - 1) t / 2)."""
    b = bias_k.detach().float().cpu()[None]  # [1, n_kv_heads, head_dim]
    if rope is None:  # NoPE: the bias is the same in every row
        return b[0].clone()
    t = rope.inv_freq().double() / 2
    n = float(max(1, n_positions))
    small = t.abs() < 1e-12
    ratio = torch.where(small, 1.0, torch.sin(n * t) / (n * torch.where(small, 1.0, torch.sin(t))))
    cos = (ratio * torch.cos((n - 1) * t)).float()[None]
    sin = (ratio * torch.sin((n - 1) * t)).float()[None]
    return apply_rope(b, cos, sin, rope.layout)[0]
