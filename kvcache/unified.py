"""The unified memory (llama.cpp's llama_kv_cache): one pool, one cell per token for every layer.

Sliding-window layers of the spec read the same cells as the full ones; only their visible
range (SeqCells.lo) is narrower. kvcache/iswa.py gives them a pool of their own.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvcache import held_cells
from kvcache.cells import KVCells, PendingOps
from kvcache.memory import Memory, MemoryPlan, Pool, SeqCells, seq_cells_view
from kvcache.spec import Attention, MemorySpec


class UnifiedMemory(Memory):
    def __init__(self, spec: MemorySpec, n_cells: int, n_seq_max: int) -> None:
        if spec.has_recurrent:
            raise ValueError("the unified KV cache holds attention layers only")
        self.spec = spec
        self.n_seq_max = n_seq_max
        self.cells = KVCells(n_cells, n_seq_max)
        self._pools: list[Pool[KVCells]] = [Pool("full", self.cells, 0)]
        self._windows = tuple(_window(g.spec) for g in spec.groups)

    @property
    def pools(self) -> list[Pool[KVCells]]:
        return self._pools

    @property
    def group_pools(self) -> tuple[int, ...]:
        return tuple(0 for _ in self._windows)

    @property
    def tail_rollback(self) -> bool:
        return True

    def num_free(self) -> int:
        return self.cells.n_cells - self.cells.used

    def plan(
        self, positions: np.ndarray, seq_ids: np.ndarray, rollback: Collection[int] = ()
    ) -> MemoryPlan | None:
        positions = np.asarray(positions, dtype=np.int64)
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if positions.size == 0:
            return MemoryPlan(positions, seq_ids, (positions.copy(),))
        slot = self.cells.find_slot(int(positions.size))
        return None if slot is None else MemoryPlan(positions, seq_ids, (slot,))

    def apply(self, plan: MemoryPlan) -> None:
        if plan.positions.size:
            self.cells.apply_ubatch(plan.cells[0], plan.positions, plan.seq_ids)

    def views(self, seq_id: int, q_pos: np.ndarray) -> list[SeqCells]:
        kv_cells, kv_pos = self.cells.seq_cells(seq_id)
        return [seq_cells_view(kv_cells, kv_pos, q_pos, w) for w in self._windows]

    def take_pending(self) -> list[PendingOps]:
        pending = self.cells.take_pending()
        return [pending for _ in self._windows]

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        self.cells.seq_rm(seq_id, p0, p1)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.cells.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.cells.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.cells.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.cells.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.cells.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.cells.seq_pos_max(seq_id)

    def can_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return True

    def can_shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        return True

    def num_shift_copies(self, seq_id: int, p0: int) -> int:
        return shared_from(self.cells, seq_id, p0)

    def usable_prefix(self, seq_id: int, n: int) -> int:
        return max(0, min(n, self.cells.seq_pos_max(seq_id) + 1))

    @property
    def keeps_prefixes(self) -> bool:
        return True

    def seq_num_cells(self, seq_id: int) -> int:
        return self.cells.seq_num_cells(seq_id)

    @property
    def holds_cells(self) -> bool:
        return True

    def seq_prefix_cells(self, seq_id: int, n: int) -> np.ndarray:
        return held_cells.seq_prefix_cells(self.cells, seq_id, n)

    def cells_hold(self, cells: np.ndarray, pool: int = 0) -> None:
        assert pool == 0
        held_cells.cells_hold(self.cells, cells)

    def cells_release(self, cells: np.ndarray, pool: int = 0) -> None:
        assert pool == 0
        held_cells.cells_release(self.cells, cells)

    def cells_cp(self, cells: np.ndarray, dst: int, pool: int = 0) -> None:
        assert pool == 0
        held_cells.cells_cp(self.cells, cells, dst)


def shared_from(cells: KVCells, seq_id: int, p0: int) -> int:
    """How many of seq_id's cells at positions >= p0 other sequences also own."""
    kv_cells, kv_pos = cells.seq_cells(seq_id)
    tail = kv_cells[kv_pos >= p0]
    return int(np.count_nonzero(cells.num_owners[tail] > 1)) if tail.size else 0


def _window(spec: object) -> int:
    return spec.window if isinstance(spec, Attention) else 0
