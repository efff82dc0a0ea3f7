"""Linears and embeddings on a GGUF file's own blocks (`--quant gguf`, the CPU default for a
quantized GGUF where the C++ kernels are built).

A BlockWeight is a tensor as the file stores it: rows of ggml blocks (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, MXFP4, Q4_K, Q5_K, Q6_K) or float rows (F32, F16, BF16), a view of the memory-mapped file
(model/load/gguf_file.py): nothing is dequantized or re-quantized, and the pages are shared
with the page cache. Where the build has a layout of its own for a type (Q4_K on the AVX2 and
AVX-512 builds: 16 or 8 rows a group, ggml_krepack.h), BlockLinear moves the same bytes into it
once at load and the file's pages are released (`repack`). BlockLinear multiplies by one or
several of them (a fused q|k|v or gate|up whose parts have different types, as Q4_K_M files mix
Q4_K and Q6_K) through the kernels' `ggml_linear` (model/kernels/ggml_blocks.cpp, the K-quants
in ggml_kquants.cpp: int8 activations per 32 or 256, integer dot products per block), at every
row count: no dense copy for large batches. BlockEmbedding dequantizes only the rows a step
looks up (`ggml_get_rows`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model.kernels import load_kernels

# GGML type ids (ggml.h enum ggml_type) of the formats the kernels compute on
GGML_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "BF16": 30,
    "MXFP4": 39,
}
GGML_TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}
# not GGML types: a file's blocks moved into a layout of the kernels' own at load (ggml_repack)
GGML_TYPE_NAMES.update({1012: "Q4_Kx16", 2012: "Q4_Kx8"})


@dataclass(frozen=True, slots=True)
class BlockWeight:
    """An [n, k] weight as GGUF rows: `data` uint8 [n, row_bytes] of type `ggml_type`."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]  # (out_features n, in_features k)
    name: str = ""
    # a view of the file's read-only mapping (False: a copy, e.g. rows permuted): only then may a
    # repack release its pages (ggml_repack)
    mapped: bool = False

    @property
    def type_name(self) -> str:
        return GGML_TYPE_NAMES.get(self.ggml_type, str(self.ggml_type))

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def has_block_kernels(kernels: Any | None) -> bool:
    return kernels is not None and hasattr(kernels, "ggml_linear")


def repack(kernels: Any, weight: BlockWeight) -> tuple[torch.Tensor, int]:
    """`weight`'s blocks as this build's kernels read them fastest -> (data, type id): the file's
    own where the build has no layout of its own for the type. ggml_repack moves the same bytes
    16 rows a group with AVX-512 VNNI, 8 on the other AVX2 builds (Q4_K:
    model/kernels/ggml_krepack.h), so that the tiles do not interleave them on every call; the
    copy replaces the file's pages in memory (those are released), it does not sit beside them.
    CELLSERVE_GGML_REPACK=0 computes on the file's layout (the same bits, slower)."""
    if (
        os.environ.get("CELLSERVE_GGML_REPACK", "1") == "0"
        or not hasattr(kernels, "ggml_repack")
        or weight.ggml_type not in kernels.ggml_repack_types()
        or weight.shape[0] % 16  # (a multiple of either group)
    ):
        return weight.data, weight.ggml_type
    w = weight
    data, ggml_type = kernels.ggml_repack(w.data, w.ggml_type, w.shape[1], w.mapped)
    return data, int(ggml_type)


class BlockLinear(nn.Module):
    """y = x @ cat(parts).T + bias, on the parts' own blocks."""

    def __init__(
        self, parts: list[BlockWeight], bias: torch.Tensor | None, kernels: Any | None = None
    ) -> None:
        super().__init__()
        kernels = kernels or load_kernels()
        if not has_block_kernels(kernels):
            raise ValueError("GGUF block weights need the C++ kernels' ggml_linear")
        ks = {p.shape[1] for p in parts}
        if len(ks) != 1:
            raise ValueError(f"fused parts with different in_features {sorted(ks)}")
        self.kernels = kernels
        self.weights = list(parts)
        self.in_features = ks.pop()
        self.parts, self.types = [], []
        for p in parts:
            data, ggml_type = repack(kernels, p)
            self.parts.append(data)
            self.types.append(ggml_type)
        self.names = [p.name for p in parts]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else bias.detach().float()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    def held(self) -> list[tuple[BlockWeight, torch.Tensor]]:
        """(the file's weight, the bytes computed on) of each part."""
        return list(zip(self.weights, self.parts, strict=True))

    def repacked(self) -> list[tuple[BlockWeight, torch.Tensor]]:
        """(the file's weight, its copy) of each part ggml_repack moved."""
        return [(w, d) for w, d in self.held() if d is not w.data]

    def first_rows(self, n: int) -> BlockLinear:
        """The same linear over its first `n` outputs (views of the file's rows; a repacked part
        is repacked again from them)."""
        if len(self.weights) != 1:
            raise ValueError(f"first_rows of a linear fused from {len(self.weights)} parts")
        w = self.weights[0]
        if not 0 < n <= w.shape[0]:
            raise ValueError(f"first_rows({n}) of {w.shape[0]} rows")
        kept = BlockWeight(w.data[:n], w.ggml_type, (n, w.shape[1]), w.name, w.mapped)
        bias = None if self.bias is None else self.bias[:n]
        return BlockLinear([kept], bias, self.kernels)

    def step_kind(self, dtype: torch.dtype) -> str:
        """The kind model/kernels' quant_linear and step_layers run it as (kernels.h StepLinear)."""
        return "ggml"

    def step_linear(self, kernels: Any, dtype: torch.dtype) -> Any:
        """Its parts and their ggml types as `kernels`' StepLinear for `dtype` rows."""
        w = kernels.StepLinear()
        w.kind = self.step_kind(dtype)
        w.parts, w.types = self.parts, self.types
        w.bias = None if self.bias is None else self.bias.to(dtype)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.ggml_linear(x.contiguous(), self.parts, self.types, self.in_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        kinds = ",".join(GGML_TYPE_NAMES.get(t, str(t)) for t in self.types)
        return f"in={self.in_features}, out={self.out_features}, blocks={kinds}"


class BlockEmbedding(nn.Module):
    """The token embedding table on its own blocks: a step dequantizes only its tokens' rows."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype, kernels: Any | None = None) -> None:
        super().__init__()
        kernels = kernels or load_kernels()
        if not has_block_kernels(kernels):
            raise ValueError("GGUF block weights need the C++ kernels' ggml_get_rows")
        self.kernels = kernels
        self.weight = weight
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = self.kernels.ggml_get_rows(w.data, w.ggml_type, tokens, w.shape[1])
        return rows.to(self.dtype)


def make_linear(parts: list[Any], bias: torch.Tensor | None = None) -> nn.Module:
    """One Linear over `parts` concatenated along the outputs: dense tensors -> Linear (which
    model/layers/quant.py may quantize), GGUF block weights -> BlockLinear."""
    from model.layers.blocks import Linear

    if all(isinstance(p, BlockWeight) for p in parts):
        return BlockLinear(parts, bias)
    if any(isinstance(p, BlockWeight) for p in parts):
        raise ValueError("a linear mixes GGUF block weights and dense ones")
    return Linear(parts[0] if len(parts) == 1 else torch.cat(parts), bias)


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of weights mapped from the model file, bytes of weights in process memory):
    parameters, buffers and the tensors quantized linears keep, each storage counted once."""
    seen: set[int] = set()
    mapped = owned = 0
    for module in model.modules():
        held: list[tuple[torch.Tensor, bool]] = []  # (the data computed on, a view of the file)
        if isinstance(module, BlockLinear):  # a repacked part is a copy, its file pages released
            moved = {id(d) for _, d in module.repacked()}
            held = [(d, w.mapped and id(d) not in moved) for w, d in module.held()]
        if isinstance(module, BlockEmbedding):
            held = [(module.weight.data, module.weight.mapped)]
        for data, is_mapped in held:
            ptr = data.data_ptr()  # NOTE: the experts of a 3-D tensor share one storage
            if ptr not in seen:
                seen.add(ptr)
                if is_mapped:
                    mapped += data.numel()
                else:
                    owned += data.numel()
        for value in vars(module).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    try:
                        storage = t.untyped_storage()
                        key, size = storage.data_ptr(), storage.nbytes()
                    except (NotImplementedError, RuntimeError):  # oneDNN-packed (opaque)
                        key, size = id(t), t.numel() * t.element_size()
                    if key not in seen:
                        seen.add(key)
                        owned += size
    return mapped, owned
