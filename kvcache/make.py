"""make_memory: the Memory variant for a model's MemorySpec."""

from __future__ import annotations

from kvcache.hybrid import HybridMemory, attention_spec, recurrent_spec
from kvcache.iswa import ISWAMemory
from kvcache.memory import Memory
from kvcache.recurrent import RecurrentMemory
from kvcache.spec import Attention, MemorySpec
from kvcache.unified import UnifiedMemory

CKPT_INTERVAL = 256  # positions between the state checkpoints a prompt step takes


def full_spec() -> MemorySpec:
    """A spec of one full-attention layer: what the scheduler needs when the model's is not
    given (head sizes only matter to the storage)."""
    return MemorySpec.of([Attention(1, 1)])


def make_memory(
    spec: MemorySpec | None,
    n_cells: int,
    n_seq_max: int,
    n_batch: int,
    kind: str = "auto",
    n_ckpt: int | None = None,
    ckpt_interval: int = CKPT_INTERVAL,
    index_cells: int = 0,
) -> Memory:
    """`kind` picks the attention layers' memory: "auto" iSWA when the spec has
    sliding-window layers, else unified. Recurrent layers get state slots: a RecurrentMemory
    when every layer is recurrent, else a HybridMemory of both. `n_ckpt`: state slots for
    prefix-cache checkpoints beside one per sequence (default n_seq_max). `index_cells`: cells
    each sliding-window pool of an attention-only model gets for the prefix index's windows."""
    spec = full_spec() if spec is None else spec
    if kind not in ("auto", "unified", "iswa"):
        raise ValueError(f"unknown memory kind {kind!r}")
    if not spec.has_recurrent:
        return _attention(spec, n_cells, n_seq_max, n_batch, kind, index_cells)
    recr = RecurrentMemory(recurrent_spec(spec), n_seq_max, n_ckpt, ckpt_interval)
    if all(not isinstance(s, Attention) for s in spec.layers):
        return recr
    attn = _attention(attention_spec(spec), n_cells, n_seq_max, n_batch, kind)
    return HybridMemory(spec, attn, recr)


def _attention(
    spec: MemorySpec, n_cells: int, n_seq_max: int, n_batch: int, kind: str, index_cells: int = 0
) -> Memory:
    if kind == "iswa" or (kind == "auto" and spec.max_window > 0):
        return ISWAMemory(spec, n_cells, n_seq_max, n_batch, index_cells)
    return UnifiedMemory(spec, n_cells, n_seq_max)
