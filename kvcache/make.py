"""make_memory: the Memory variant for a model's MemorySpec."""

from __future__ import annotations

from kvcache.iswa import ISWAMemory
from kvcache.memory import Memory
from kvcache.spec import Attention, MemorySpec
from kvcache.unified import UnifiedMemory


def full_spec() -> MemorySpec:
    """A spec of one full-attention layer: what the scheduler needs when the model's is not
    given (head sizes only matter to the storage)."""
    return MemorySpec.of([Attention(1, 1)])


def make_memory(
    spec: MemorySpec | None, n_cells: int, n_seq_max: int, n_batch: int, kind: str = "auto"
) -> Memory:
    """`kind` "auto": iSWA when the spec has sliding-window layers, else unified."""
    spec = full_spec() if spec is None else spec
    if kind == "iswa" or (kind == "auto" and spec.max_window > 0):
        return ISWAMemory(spec, n_cells, n_seq_max, n_batch)
    if kind in ("auto", "unified"):
        return UnifiedMemory(spec, n_cells, n_seq_max)
    raise ValueError(f"unknown memory kind {kind!r}")
