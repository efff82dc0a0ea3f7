"""The serving dtypes by name."""

from __future__ import annotations

import torch

from model.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (use one of {', '.join(DTYPES)}).")
    return DTYPES[dtype]
