"""Where the process's memory goes (logged at start-up, exported by server/metrics.py as
cellserve_memory_bytes): the weights mapped from the model file, the weights, the KV cache and
the recurrent state slots in process memory (their size, and the pages resident: the OS maps
them in as cells are first written, kvcache/zeros.py), and the rest."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_memory() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process in bytes (/proc/self/status; {} elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def resident_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes of `ranges` (address, length) whose pages are in RAM now (mincore); -1 where the OS
    cannot say."""
    total = 0
    mincore = getattr(_libc, "mincore", None)
    if mincore is None:
        return -1
    for addr, length in ranges:
        if length <= 0:
            continue
        lo = addr // _PAGE * _PAGE
        pages = (addr + length - lo + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * _PAGE), vec) != 0:
            return -1
        flags = np.frombuffer(memoryview(vec), dtype=np.uint8) & 1
        n = int(np.count_nonzero(flags)) * _PAGE
        n -= (addr - lo) * int(flags[0])  # the first and last pages' bytes outside the range
        n -= (lo + pages * _PAGE - addr - length) * int(flags[-1])
        total += n
    return total


def memory_available() -> int:
    """MemAvailable of /proc/meminfo in bytes: what the kernel can give without swapping; -1
    where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    return int(rest.split()[0]) * 1024
    except OSError:
        pass
    return -1


def cache_fits(cache_bytes: int, resident: int) -> str | None:
    """None where the cache's pages not yet resident fit in the memory available now, else the
    warning to log: they are mapped in as the load writes cells (kvcache/zeros.py), so a cache
    larger than the machine fails under load, not at start-up."""
    available = memory_available()
    missing = cache_bytes - max(resident, 0)
    if available < 0 or missing <= available:
        return None
    return (
        f"the KV cache and state slots need {missing / 2**20:.0f} MiB more than is resident, "
        f"and {available / 2**20:.0f} MiB are available: when the load fills the cache the "
        "process will swap or be killed; lower --n-cells (or --n-seq-max on a recurrent model)"
    )


@dataclass(slots=True)
class MemoryParts:
    weights_mapped: int = 0  # bytes of weights that are views of the model file's mapping
    weights_owned: int = 0  # bytes of weights in process memory
    kv_cache: int = 0
    state_slots: int = 0  # a recurrent or hybrid model's state slots
    # the KV cache's and the state slots' (address, length) ranges: their resident pages
    cache_ranges: Callable[[], tuple[list[tuple[int, int]], list[tuple[int, int]]]] | None = None


def memory_breakdown(parts: MemoryParts) -> dict[str, int]:
    """Where the process's memory goes: the weights mapped from the file (their size, and the
    resident file pages, mostly theirs), the weights, the KV cache and the recurrent state slots
    in process memory (their size and, where the ranges are known, their resident pages), the
    rest of the anonymous memory (activations, Python, torch), and the total RSS."""
    proc = process_memory()
    anon = proc.get("RssAnon", 0)
    kv, state = parts.kv_cache, parts.state_slots
    resident: dict[str, int] = {}
    if parts.cache_ranges is not None:
        kv_ranges, state_ranges = parts.cache_ranges()
        kv_res, state_res = resident_bytes(kv_ranges), resident_bytes(state_ranges)
        if kv_res >= 0 and state_res >= 0:
            kv, state = kv_res, state_res
            resident = {"kv_cache_resident": kv_res, "state_slots_resident": state_res}
    return {
        "weights_mapped": parts.weights_mapped,
        "weights_mapped_resident": proc.get("RssFile", 0),
        "weights_owned": parts.weights_owned,
        "kv_cache": parts.kv_cache,
        "state_slots": parts.state_slots,
        **resident,
        "other": max(0, anon - parts.weights_owned - kv - state),
        "rss": proc.get("VmRSS", 0),
    }
