"""The KV cache: cell metadata (cells, numpy), state slots (slots, numpy), the Memory
variants over them (unified, iSWA, recurrent, hybrid), and the K/V tensors (storage, torch)."""

from kvcache.cells import FREE, SHARED, CellStats, KVCells, PendingOps
from kvcache.memory import Memory, MemoryPlan, Pool, SeqCells

__all__ = [
    "FREE",
    "SHARED",
    "CellStats",
    "KVCells",
    "Memory",
    "MemoryPlan",
    "PendingOps",
    "Pool",
    "SeqCells",
]
