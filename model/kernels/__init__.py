"""Optional C++ CPU kernels, compiled on first use with torch.utils.cpp_extension.

`load_decode_attention()` returns `decode_attention(q, k, v, cells, lens, scale)` (see
decode_attention.cpp) or None when it cannot be built here (no C++ compiler or ninja, a
non-CPU build of torch, CELLSERVE_KERNELS=0): callers then keep the gather + SDPA/bmm path.
The build is cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions).
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Callable

import torch

log = logging.getLogger("cellserve.model")

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
SOURCE = pathlib.Path(__file__).with_name("decode_attention.cpp")


def load_decode_attention() -> DecodeAttention | None:
    if os.environ.get("CELLSERVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name="cellserve_decode_attention",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-ffast-math"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001  (any build failure means: use the torch path)
        log.info("decode attention kernel unavailable (%s); using gather + SDPA", exc)
        return None
    fn: DecodeAttention = module.decode_attention
    return fn
