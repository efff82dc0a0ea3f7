"""What the cell metadata hands out: the owner map's values, pending storage work, accounting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

FREE = -1  # owner_map value of a cell no sequence owns
SHARED = -2  # owner_map value of a cell two or more sequences own
HELD = -3  # owner_map value of a cell only the memory itself holds (kvcache/held_cells.py)


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


def longest_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return int((edges[1::2] - edges[::2]).max())


class PoolCells(Protocol):
    """What generic code (snapshots, /metrics, the cell map) reads of a pool: KV cells
    (kvcache.cells.KVCells, one per token) or state slots (kvcache.slots.SlotPool, one per
    sequence state). `seq_cells` is (cells or slots, the last position each holds) by position."""

    @property
    def n_cells(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def head(self) -> int: ...
    def stats(self) -> CellStats: ...
    def owner_map(self) -> np.ndarray: ...
    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]: ...
    def seq_num_cells(self, seq_id: int) -> int: ...
    def clear(self) -> None: ...
    def check(self) -> None: ...
