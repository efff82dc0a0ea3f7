"""Zero-filled tensors whose pages the OS maps in when they are first touched.

`torch.zeros` writes every byte at start-up: a 16k-cell cache of an 8B model is 2 GiB, and
writing it took 2.9 s of a 9 s start (2-core Xeon). A private anonymous mapping is zero by the
OS's contract without being written: its pages are faulted in when a step first writes a cell
there. So start-up does not pay for the cache, and the resident set grows with the cells used.
Its own mapping, not calloc: glibc serves even a 64 MiB calloc from a recycled heap (and clears
it) once its mmap threshold has moved, which a CI run showed.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zero tensor of `shape` and `dtype`; on the CPU backed by a private anonymous mapping of
    its own (page-aligned, not written here, unmapped when the tensor goes), elsewhere
    torch.zeros."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # (Windows has no flags: an anonymous mapping of the paging file, zero too)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    region = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 1 << 22:
        region.madvise(mmap.MADV_HUGEPAGE)  # fewer faults and TLB misses; THP's madvise mode
    # numpy keeps the mapping alive (its base) and torch keeps the array
    out = torch.from_numpy(np.frombuffer(region, dtype=np.uint8)).view(dtype).view(shape)
    assert out.data_ptr() % mmap.PAGESIZE == 0
    return out
