"""Zero-filled tensors whose pages the OS maps in when they are first touched.

`torch.zeros` writes every byte at start-up: a 16k-cell cache of an 8B model is 2 GiB, and
writing it took 2.9 s of a 9 s start (2-core Xeon). calloc'd memory (numpy's zeros) is zero
by contract without being written: a large block (past glibc's mmap threshold, at most 32 MiB)
comes straight from the OS, whose fresh pages read as zeros and are faulted in when a step first
writes a cell there (a smaller one may be recycled heap that calloc clears: zero either way).
So start-up does not pay for the cache, and the resident set grows with the cells used.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 4096  # the kernels' aligned 64-byte loads need 64; a page costs nothing more


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zero tensor of `shape` and `dtype`; on the CPU backed by calloc'd, page-aligned memory
    (not written here), elsewhere torch.zeros."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)  # calloc: zero, untouched
    skip = -raw.ctypes.data % _ALIGN
    out = torch.from_numpy(raw[skip : skip + nbytes]).view(dtype).view(shape)
    assert out.data_ptr() % _ALIGN == 0
    return out
