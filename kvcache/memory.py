"""The memory interface the scheduler programs against (llama.cpp's llama_memory_i).

KVCells (the unified cell cache) satisfies it structurally; a sliding-window or a
recurrent memory must fit it too, so the scheduler never needs to know which it drives.
Ranges are half-open [p0, p1); p0 < 0 means 0, p1 < 0 means infinity.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvcache.cells import CellStats, PendingOps


class Memory(Protocol):
    n_cells: int
    n_seq_max: int
    head: int
    used: int

    def find_slot(self, n_tokens: int) -> np.ndarray | None:
        """Cells for n_tokens new tokens, or None if they do not fit; never mutates."""

    def apply_ubatch(self, cells: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> None:
        """Record token i (positions[i], seq_ids[i]) in cells[i]; the cells must be free."""

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        """Forget seq_id's tokens in [p0, p1); seq_id -1 means every sequence."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst shares src's tokens in [p0, p1) (no data is copied)."""

    def seq_keep(self, seq_id: int) -> None:
        """Forget every token seq_id does not own; seq_id becomes their only owner."""

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move seq_id's tokens in [p0, p1) by delta; those going negative are forgotten."""

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide seq_id's positions in [p0, p1) by d (floor)."""

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of seq_id, -1 if it holds nothing."""

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id, -1 if it holds nothing."""

    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(cells, positions) of seq_id, int64, sorted by position: what attention gathers."""

    def seq_num_cells(self, seq_id: int) -> int:
        """Number of cells seq_id holds."""

    def take_pending(self) -> PendingOps:
        """Storage work (copies, then K-shifts) owed since the last call; resets it."""

    def owner_map(self) -> np.ndarray:
        """Per cell: FREE, SHARED (kvcache.cells), else the owner seq id (int32)."""

    def clear(self) -> None:
        """Forget everything, pending work included."""

    def stats(self) -> CellStats:
        """Accounting for /metrics and the cell map."""

    def check(self) -> None:
        """Recompute every cached quantity and assert the invariants (AssertionError)."""
