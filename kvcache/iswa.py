"""The iSWA memory (llama.cpp's llama_kv_cache_iswa): a unified pool for the full-attention
layers and a small pool per sliding window.

A row at position q of a window-W layer reads positions (q - W, q]. A sequence's cell in a
SWA pool leaves its window once its position is W or more behind the sequence's newest one;
the cell is freed once it is out of every owner's window. Pruning runs when a step is
applied, against each sequence's newest position BEFORE that step's rows: those rows (the
ubatch in flight, up to n_batch of them) still read the cells behind them, so a pool holds at
most W cells per sequence plus the step's rows, and is sized W x n_seq_max + n_batch
(llama.cpp: n_swa * n_seq_max + n_ubatch).

NOTE: why a SWA pool never binds: after a prune each sequence owns cells at distinct
positions in [max - W + 1, max], so at most W, and distinct cells <= the sum over seq ids
(running choices and prefix holders alike) <= W x n_seq_max; a step adds <= n_batch. Forks
(seq_cp) add owners, not cells; a copy-on-write replaces a shared cell of one owner, and
seq_add prunes first. So only the full pool decides what fits (num_free), and plan() still
checks every pool.

Prefix cache: a holder keeps the SWA cells of its last W positions (what pruning leaves).
A sequence forked from it at length m needs positions [m - W + 1, m) in every SWA pool, so a
match is reused only at lengths whose window the holder still has (usable_prefix): m = the
holder's length (or m - 1), or any m when the holder is no longer than W. A cached prefix
thus gives exactly the cold output: every row reads the same positions as a cold run.

Prefix index (scheduler/radix.py): with `index_cells` > 0 each SWA pool has that many cells more,
for the index to hold: a demoted holder leaves its full-pool cells AND its window (the SWA cells
of its last W positions) in the index, which serves a length m only where a held window covers
[m - W + 1, m). The index keeps its SWA cells within index_cells a pool (evicting its least
recently used leaves), so the bound above still holds for everything else and no step lacks a
window cell.

Context shift: seq_rm + seq_add in every pool, each group's K re-rotated by the storage with
its own RoPE. When n_keep sits inside the window of the next row, positions the shifted
context needs may have been pruned already: can_shift says so, and the scheduler recomputes.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvcache import held_cells
from kvcache.cells import KVCells, PendingOps
from kvcache.memory import Memory, MemoryPlan, Pool, SeqCells, seq_cells_view
from kvcache.spec import Attention, MemorySpec
from kvcache.unified import shared_from


class ISWAMemory(Memory):
    def __init__(
        self, spec: MemorySpec, n_cells: int, n_seq_max: int, n_batch: int, index_cells: int = 0
    ) -> None:
        if spec.has_recurrent:
            raise ValueError("the iSWA memory holds attention layers only")
        windows = sorted({g.spec.window for g in spec.groups if isinstance(g.spec, Attention)})
        windows = [w for w in windows if w > 0]
        if not windows:
            raise ValueError("the iSWA memory needs a sliding-window layer in the spec")
        self.spec = spec
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        if index_cells < 0:
            raise ValueError(f"index_cells must be >= 0, got {index_cells}")
        self.index_cells = index_cells
        self.full = KVCells(n_cells, n_seq_max)
        self._pools: list[Pool[KVCells]] = [Pool("full", self.full, 0)]
        for w in windows:
            n_swa = min(n_cells, w * n_seq_max + n_batch) + index_cells
            name = "swa" if len(windows) == 1 else f"swa{w}"
            self._pools.append(Pool(name, KVCells(n_swa, n_seq_max), w))
        by_window = {p.window: i for i, p in enumerate(self._pools)}
        self._group_pools = tuple(
            by_window[g.spec.window if isinstance(g.spec, Attention) else 0] for g in spec.groups
        )

    @property
    def pools(self) -> list[Pool[KVCells]]:
        return self._pools

    @property
    def swa(self) -> list[Pool[KVCells]]:
        return self._pools[1:]

    @property
    def group_pools(self) -> tuple[int, ...]:
        return self._group_pools

    @property
    def tail_rollback(self) -> bool:
        """NOTE: apply prunes against each sequence's newest position BEFORE the step's rows,
        so removing rows the last step placed leaves every cell the next row reads."""
        return True

    # -- a step ------------------------------------------------------------------------------

    def num_free(self) -> int:
        return self.full.n_cells - self.full.used

    def plan(
        self, positions: np.ndarray, seq_ids: np.ndarray, rollback: Collection[int] = ()
    ) -> MemoryPlan | None:
        positions = np.asarray(positions, dtype=np.int64)
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        n = int(positions.size)
        if n == 0:
            return MemoryPlan(positions, seq_ids, tuple(positions.copy() for _ in self._pools))
        full = self.full.find_slot(n)
        if full is None:
            return None
        cells = [full]
        for pool in self.swa:
            # NOTE: free cells first: what the prune in apply() frees is looked for only when
            # they run short (a scan of the whole pool, large with the index's room)
            slot = pool.cells.find_slot(n)
            if slot is None:
                free = (pool.cells.pos == -1) | pool.cells.freed_below(self._cuts(pool))
                slot = _first_from(free, pool.cells.head, n)
            if slot is None:
                return None
            cells.append(slot)
        return MemoryPlan(positions, seq_ids, tuple(cells))

    def apply(self, plan: MemoryPlan) -> None:
        if plan.positions.size == 0:
            return
        self._prune()
        for pool, cells in zip(self._pools, plan.cells, strict=True):
            pool.cells.apply_ubatch(cells, plan.positions, plan.seq_ids)

    def views(self, seq_id: int, q_pos: np.ndarray) -> list[SeqCells]:
        by_pool = [p.cells.seq_cells(seq_id) for p in self._pools]
        out = []
        for g, i in zip(self.spec.groups, self._group_pools, strict=True):
            window = g.spec.window if isinstance(g.spec, Attention) else 0
            out.append(seq_cells_view(*by_pool[i], q_pos, window))
        return out

    def take_pending(self) -> list[PendingOps]:
        pending = [p.cells.take_pending() for p in self._pools]
        return [pending[i] for i in self._group_pools]

    # -- sequence operations -----------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        for p in self._pools:
            p.cells.seq_rm(seq_id, p0, p1)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        for p in self._pools:
            p.cells.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        for p in self._pools:
            p.cells.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._prune()  # copies-on-write need the room that pruning gives
        for p in self._pools:
            p.cells.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._prune()
        for p in self._pools:
            p.cells.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.full.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.full.seq_pos_max(seq_id)

    # -- what this variant allows ------------------------------------------------------------

    def can_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return True

    def can_shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        # NOTE: seq_add prunes against the pre-shift max first, so what counts is what
        # survives that: positions the shift brings back into the window are gone
        top = self.full.seq_pos_max(seq_id)
        new_max = top - n_discard
        for pool in self.swa:
            held = pool.cells.seq_cells(seq_id)[1]
            need = np.arange(max(0, new_max + 2 - pool.window), new_max + 1)
            old = np.where(need < n_keep, need, need + n_discard)
            if not np.isin(old, held[held > top - pool.window]).all():
                return False
        return True

    def num_shift_copies(self, seq_id: int, p0: int) -> int:
        return shared_from(self.full, seq_id, p0)

    def usable_prefix(self, seq_id: int, n: int) -> int:
        m = max(0, min(n, self.full.seq_pos_max(seq_id) + 1))
        for pool in self.swa:
            need = np.arange(max(0, m - pool.window + 1), m)
            if not np.isin(need, pool.cells.seq_cells(seq_id)[1]).all():
                return 0
        return m

    # -- cells the memory holds itself (the prefix index: module docstring) --------------------

    @property
    def holds_cells(self) -> bool:
        return self.index_cells > 0

    @property
    def index_windows(self) -> tuple[int, ...]:
        return tuple(p.window for p in self.swa)

    @property
    def index_budget(self) -> tuple[int, ...]:
        return tuple(self.index_cells for _ in self.swa)

    def seq_prefix_cells(self, seq_id: int, n: int) -> np.ndarray:
        return held_cells.seq_prefix_cells(self.full, seq_id, n)

    def seq_window_cells(self, seq_id: int, n: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
        out = []
        for pool in self.swa:
            cells, pos = pool.cells.seq_cells(seq_id)
            keep = pos < n
            cells, pos = cells[keep], pos[keep]
            if pos.size == 0 or pos[-1] != n - 1:
                return None
            # the run of consecutive positions that ends at n - 1
            gaps = np.flatnonzero(np.diff(pos) != 1)
            first = int(gaps[-1]) + 1 if gaps.size else 0
            out.append((cells[first:], pos[first:]))
        return out

    def cells_hold(self, cells: np.ndarray, pool: int = 0) -> None:
        held_cells.cells_hold(self._pools[pool].cells, cells)

    def cells_release(self, cells: np.ndarray, pool: int = 0) -> None:
        held_cells.cells_release(self._pools[pool].cells, cells)

    def cells_cp(self, cells: np.ndarray, dst: int, pool: int = 0) -> None:
        held_cells.cells_cp(self._pools[pool].cells, cells, dst)

    # -- accounting --------------------------------------------------------------------------

    def seq_num_cells(self, seq_id: int) -> int:
        return sum(p.cells.seq_num_cells(seq_id) for p in self._pools)

    def check(self) -> None:
        super().check()
        for pool in self.swa:
            bound = pool.window * self.n_seq_max + self.n_batch + self.index_cells
            assert pool.cells.used <= bound, "swa size"
            assert int(pool.cells.held.sum()) <= self.index_cells, "swa cells the index holds"
            for s in range(self.n_seq_max):
                swa_pos = pool.cells.seq_cells(s)[1]
                assert np.isin(swa_pos, self.full.seq_cells(s)[1]).all(), "swa pos not in full"
                if swa_pos.size:
                    assert swa_pos[-1] == self.full.seq_pos_max(s), "swa max is the full max"

    # -- internals ---------------------------------------------------------------------------

    def seq_trim(self, seq_id: int) -> None:
        for pool in self.swa:
            cut = np.full(self.n_seq_max, -1, dtype=np.int64)
            if pool.cells.seq_count[seq_id]:
                cut[seq_id] = self.full.seq_pos_max(seq_id) - pool.window + 1
            pool.cells.seq_rm_below(cut)

    def _prune(self) -> None:
        """Every sequence leaves its SWA cells out of its window (see the module NOTE)."""
        for pool in self.swa:
            pool.cells.seq_rm_below(self._cuts(pool))

    def _cuts(self, pool: Pool[KVCells]) -> np.ndarray:
        """[n_seq_max]: per sequence, the first position still in its window (-1: none held).
        NOTE: the full pool's max, which a SWA pool shares wherever it holds the sequence
        (check() asserts it), and which pruning never makes stale."""
        cut = np.full(self.n_seq_max, -1, dtype=np.int64)
        for s in np.flatnonzero(pool.cells.seq_count).tolist():
            cut[s] = self.full.seq_pos_max(s) - pool.window + 1
        return cut


def _first_from(free: np.ndarray, head: int, n: int) -> np.ndarray | None:
    """The first n True indices of `free` from `head`, wrapping; None if fewer."""
    idx = np.flatnonzero(np.roll(free, -head))
    if idx.size < n:
        return None
    return ((idx[:n] + head) % free.size).astype(np.int64)
