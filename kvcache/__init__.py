"""The shared KV cache: cell metadata (cells, numpy) apart from the K/V tensors (storage)."""

from kvcache.cells import FREE, SHARED, CellStats, KVCells, PendingOps
from kvcache.memory import Memory

__all__ = ["FREE", "SHARED", "CellStats", "KVCells", "Memory", "PendingOps"]
