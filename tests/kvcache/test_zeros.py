"""kvcache/zeros.py: the cache's zero tensors are not written at start-up; the resident pages
that /metrics reports (server/process_memory.resident_bytes) follow what the steps write."""

from __future__ import annotations

import pytest
import torch

from kvcache.state_storage import RecurrentStorage
from kvcache.storage import KVStorage
from kvcache.zeros import lazy_zeros
from server import process_memory
from server.process_memory import MemoryParts, cache_fits, memory_breakdown, resident_bytes

MIB = 1 << 20


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float16])
def test_lazy_zeros_is_a_zero_aligned_writable_tensor(dtype):
    t = lazy_zeros((3, 5, 7, 64), dtype)
    assert t.shape == (3, 5, 7, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    assert not t.any()
    t[1, 2, 3] = 1
    assert int(t.sum()) == 64
    assert lazy_zeros((0, 4), dtype).shape == (0, 4)


def test_pages_become_resident_as_they_are_written():
    t = lazy_zeros((64, 1024, 1024), torch.uint8)  # 64 MiB
    assert resident_bytes([span(t)]) < 4 * MIB  # nothing written yet
    t[:16].fill_(1)
    assert 16 * MIB <= resident_bytes([span(t)]) < 24 * MIB
    t.fill_(2)
    assert resident_bytes([span(t)]) == 64 * MIB
    assert resident_bytes([]) == 0


def test_storages_start_unwritten_and_the_breakdown_counts_what_is_resident():
    # 64 MiB a tensor: each its own fresh anonymous mapping (kvcache/zeros.py)
    kv = KVStorage(n_layers=4, n_cells=65536, n_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    state = RecurrentStorage((1, 3), 16, (96, 3), (8, 16, 64), dtype=torch.bfloat16)
    kv_ranges = [span(kv.k), span(kv.v)]
    state_ranges = [span(t) for t in state.tensors()]
    kv_bytes = sum(n for _, n in kv_ranges)
    assert kv_bytes == kv.bytes_per_cell * 65536 == 128 * MIB
    assert sum(n for _, n in state_ranges) == state.num_bytes
    assert resident_bytes(kv_ranges) < kv_bytes // 4
    kv.k.fill_(1)  # every cell of K written
    assert resident_bytes(kv_ranges) >= kv_bytes // 2
    parts = MemoryParts(0, 0, kv_bytes, state.num_bytes, lambda: (kv_ranges, state_ranges))
    out = memory_breakdown(parts)
    assert out["kv_cache"] == kv_bytes and out["state_slots"] == state.num_bytes
    assert kv_bytes // 2 <= out["kv_cache_resident"] <= kv_bytes
    assert 0 <= out["state_slots_resident"] <= state.num_bytes
    assert "kv_cache_resident" not in memory_breakdown(MemoryParts(0, 0, kv_bytes))


def test_a_cache_larger_than_the_available_memory_is_warned_of(monkeypatch):
    monkeypatch.setattr(process_memory, "memory_available", lambda: 1000 * MIB)
    assert cache_fits(900 * MIB, 0) is None
    assert cache_fits(1500 * MIB, 600 * MIB) is None  # what is resident is already paid for
    warning = cache_fits(1500 * MIB, 0)
    assert warning is not None and "1500 MiB" in warning and "--n-cells" in warning
    monkeypatch.setattr(process_memory, "memory_available", lambda: -1)  # not Linux
    assert cache_fits(1 << 50, 0) is None
