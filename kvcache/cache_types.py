"""How a K or V row is stored: llama.cpp's cache types (`--cache-type-k` / `--cache-type-v`).

f32, f16, bf16: the row as floats. q8_0, q4_0: blocks of 32 values along head_dim, each block
as ggml stores it (ggml-common.h block_q8_0 / block_q4_0): an fp16 scale d, then 32 int8
values (q8_0: x = d * q) or 16 bytes of nibbles (q4_0: byte j holds element j in its low and
element j + 16 in its high nibble, x = d * (nibble - 8)). A quantized row is stored as uint8
[..., row_bytes], so the cache stays indexable by cell whatever the type. Quantization follows
ggml's reference (quantize_row_q8_0_ref / quantize_row_q4_0_ref): the C++ kernels
(model/kernels/kv_rows.cpp) store the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # values per block (ggml's QK8_0 = QK4_0)


@dataclass(frozen=True, slots=True)
class CacheType:
    """One row format. `dtype`: the float dtype of a float type, None for a quantized one;
    `block_bytes`: bytes per block of 32 values (quantized types)."""

    name: str
    dtype: torch.dtype | None
    block_bytes: int = 0

    @property
    def quantized(self) -> bool:
        return self.dtype is None

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.dtype is None else self.dtype

    def row_len(self, head_dim: int) -> int:
        """The stored row's last dim: head_dim values, or row bytes of a quantized type."""
        if self.dtype is not None:
            return head_dim
        return head_dim // QK * self.block_bytes

    def row_bytes(self, head_dim: int) -> int:
        if self.dtype is not None:
            return head_dim * self.dtype.itemsize
        return self.row_len(head_dim)

    def check(self, head_dim: int) -> None:
        if self.quantized and head_dim % QK:
            raise ValueError(
                f"cache type {self.name} stores blocks of {QK} values: head_dim {head_dim} is not "
                f"a multiple of {QK}"
            )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] (any float dtype) -> the stored rows [..., row_len]."""
        if self.dtype is not None:
            return x if x.dtype == self.dtype else x.to(self.dtype)
        if self.name == "q8_0":
            return _quantize_q8_0(x)
        return _quantize_q4_0(x)

    def decode(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """stored rows [..., row_len] -> [..., head_dim] in `dtype`."""
        if self.dtype is not None:
            return raw if raw.dtype == dtype else raw.to(dtype)
        blocks = raw.reshape(*raw.shape[:-1], -1, self.block_bytes)  # [..., n_blocks, bytes]
        d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., n_blocks, 1]
        if self.name == "q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
        else:
            nib = blocks[..., 2:]
            q = torch.cat((nib & 0x0F, nib >> 4), dim=-1).float() - 8.0
        return (q * d).flatten(-2).to(dtype)


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    t = torch.trunc(v)
    return torch.where((v - t).abs() == 0.5, t + torch.sign(v), torch.round(v))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], -1, QK)  # [..., n_blocks, 32]


def _pack(d: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """d [..., n_blocks] float32, qs [..., n_blocks, m] uint8 -> [..., n_blocks * (2 + m)]."""
    scale = d.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [..., n_blocks, 2]
    return torch.cat((scale, qs), dim=-1).flatten(-2)


def _quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x)
    d = b.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = _round_away(b * inv.unsqueeze(-1)).to(torch.int8)
    return _pack(d, q.view(torch.uint8))


def _quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x)
    idx = b.abs().argmax(dim=-1, keepdim=True)  # the first largest |x|, as ggml's loop keeps
    d = b.gather(-1, idx).squeeze(-1) / -8.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.floor(b * inv.unsqueeze(-1) + 8.5).clamp(0, 15).to(torch.uint8)
    return _pack(d, q[..., : QK // 2] | (q[..., QK // 2 :] << 4))


CACHE_TYPES: dict[str, CacheType] = {
    "f32": CacheType("f32", torch.float32),
    "f16": CacheType("f16", torch.float16),
    "bf16": CacheType("bf16", torch.bfloat16),
    "q8_0": CacheType("q8_0", None, 2 + QK),
    "q4_0": CacheType("q4_0", None, 2 + QK // 2),
}

_BY_DTYPE = {t.dtype: t for t in CACHE_TYPES.values() if t.dtype is not None}


def cache_type(name: str | torch.dtype | CacheType) -> CacheType:
    """A type by its llama.cpp name (or a float dtype); a clear error for any other name."""
    if isinstance(name, CacheType):
        return name
    if isinstance(name, torch.dtype):
        if name not in _BY_DTYPE:
            raise ValueError(f"no cache type stores {name}")
        return _BY_DTYPE[name]
    found = CACHE_TYPES.get(name.strip().lower())
    if found is None:
        raise ValueError(f"unknown cache type {name!r}: one of {', '.join(CACHE_TYPES)}")
    return found
