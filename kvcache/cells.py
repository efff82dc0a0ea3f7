"""KVCells: the metadata of the shared KV cache (llama.cpp's llama-kv-cells), numpy only.

SKELETON: signatures are the contract; the kvcache issue fills in the bodies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class PendingOps:
    """Storage work recorded by the cells and applied by KVStorage.apply, once, in this order:
    1. copies: rows `copy_src[i] -> copy_dst[i]` (K and V, every layer), in order;
    2. K-shifts: re-rotate K of `shift_cells[i]` by `shift_deltas[i]` positions (RoPE)."""

    copy_src: np.ndarray  # [n_copies] int64
    copy_dst: np.ndarray  # [n_copies] int64
    shift_cells: np.ndarray  # [n_shift] int64
    shift_deltas: np.ndarray  # [n_shift] int64

    @staticmethod
    def empty() -> PendingOps:
        z = np.zeros(0, dtype=np.int64)
        return PendingOps(z, z.copy(), z.copy(), z.copy())

    @property
    def is_empty(self) -> bool:
        return self.copy_src.size == 0 and self.shift_cells.size == 0


@dataclass(slots=True)
class CellStats:
    n_cells: int
    used: int
    shared: int  # cells with more than one owner
    pending_shift: int
    num_seqs: int  # sequences owning at least one cell
    fragmentation: float  # 1 - largest free run / free cells (0 when no free cells)


class KVCells:
    def __init__(self, n_cells: int, n_seq_max: int) -> None: ...
    def find_slot(self, n_tokens: int) -> np.ndarray | None: ...
    def apply_ubatch(self, cells: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> None: ...
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]: ...
    def seq_num_cells(self, seq_id: int) -> int: ...
    def take_pending(self) -> PendingOps: ...
    def owner_map(self) -> np.ndarray: ...
    def clear(self) -> None: ...
    def stats(self) -> CellStats: ...
    def check(self) -> None: ...
