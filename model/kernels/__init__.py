"""Optional C++ CPU kernels (attention.cpp, layers.cpp), compiled on first use with
torch.utils.cpp_extension into one module.

`load_kernels()` returns the module (`decode_attention(q, k, v, cells, lens, scale)`,
`prompt_attention(...)` where `has_bf16_kernels()` (AVX-512 BF16), `decode_layers(...)`) or
None when it cannot be built here (no C++ compiler or ninja, CELLSERVE_KERNELS=0): callers
then keep the torch path. The build is cached under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), compiled for this CPU (-march=native, -fopenmp).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("cellserve.model")

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
PromptAttention = DecodeAttention  # (q, k, v, cells [n_kv], lens [L], scale), bfloat16
SOURCES = [pathlib.Path(__file__).with_name(name) for name in ("attention.cpp", "layers.cpp")]


def load_kernels() -> Any | None:
    if os.environ.get("CELLSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name="cellserve_decode",
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001  (any build failure means: use the torch path)
        log.info("C++ decode kernels unavailable (%s); using the torch path", exc)
        return None


def load_decode_attention() -> DecodeAttention | None:
    module = load_kernels()
    return None if module is None else module.decode_attention
