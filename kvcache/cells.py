"""KVCells: the metadata of the shared KV cache (llama.cpp's llama-kv-cells), numpy only."""

from __future__ import annotations

import numpy as np

from kvcache.cell_check import check_cells
from kvcache.cell_types import FREE, HELD, SHARED, CellStats, PendingOps, longest_run

__all__ = ["FREE", "HELD", "SHARED", "CellStats", "KVCells", "PendingOps"]


_NO_POS = np.iinfo(np.int64).max  # seq_min sentinel for an empty sequence


class KVCells:
    """Cell metadata of the unified KV cache, after llama.cpp's llama_kv_cells + llama_kv_cache."""

    # NOTE: invariants (check() asserts them: kvcache/cell_check.py):
    #   pos[c] == -1  <=>  no owner  <=>  shift[c] == 0 and num_owners[c] == 0;
    #   owner_xor[c] == XOR of c's owner ids, so the single owner's id where num_owners[c] == 1;
    #   used == count(pos != -1); seq_count[s] == owners[s].sum();
    #   seq_min/seq_max[s] are exact unless seq_dirty[s] (then recomputed on read);
    #   held[c] (a cell-level owner with no seq id: kvcache/held_cells.py) counts as one owner
    #   in num_owners[c], never in owner_xor.
    # NOTE: pending copies are recorded in the logical order of the cell operations and
    #   read storage rows that hold the data as of the last applied forward: shift[c] is the
    #   rotation still owed to the row that cell c holds once all pending copies are applied.
    #   Copies run before K-shifts, and both before the forward writes the next ubatch, so a
    #   copy src freed and reused afterwards (by a later copy or by apply_ubatch) still reads
    #   the right row. The one order to avoid: seq_add/seq_div copying a cell written by an
    #   apply_ubatch whose forward has not run yet (that row does not hold its data yet).

    def __init__(self, n_cells: int, n_seq_max: int) -> None:
        if n_cells < 1 or n_seq_max < 1:
            raise ValueError(f"need n_cells >= 1 and n_seq_max >= 1, got {n_cells}, {n_seq_max}")
        self.n_cells = n_cells
        self.n_seq_max = n_seq_max
        self.pos = np.full(n_cells, -1, dtype=np.int64)
        self.shift = np.zeros(n_cells, dtype=np.int64)
        self.owners = np.zeros((n_seq_max, n_cells), dtype=bool)  # [n_seq_max, n_cells]
        self.num_owners = np.zeros(n_cells, dtype=np.int32)
        self.held = np.zeros(n_cells, dtype=bool)
        self.owner_xor = np.zeros(n_cells, dtype=np.int32)
        self.seq_count = np.zeros(n_seq_max, dtype=np.int64)
        self.seq_min = np.full(n_seq_max, _NO_POS, dtype=np.int64)
        self.seq_max = np.full(n_seq_max, -1, dtype=np.int64)
        self.seq_dirty = np.zeros(n_seq_max, dtype=bool)
        self.head = 0
        self.used = 0
        self.has_shift = False
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []

    # -- placement ---------------------------------------------------------------------------

    def find_slot(self, n_tokens: int) -> np.ndarray | None:
        """First n_tokens free cells from head, wrapping (may be non-contiguous); never mutates."""
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        if n_tokens > self.n_cells - self.used:
            return None
        return self._free_from_head(n_tokens)

    def apply_ubatch(self, cells: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray) -> None:
        """Write pos/owner for each token (one seq per token) into free cells; head moves past."""
        cells = np.asarray(cells, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        if not (cells.ndim == positions.ndim == seq_ids.ndim == 1):
            raise ValueError("cells, positions and seq_ids must be 1-D")
        if not (cells.size == positions.size == seq_ids.size):
            raise ValueError(
                f"length mismatch: {cells.size} cells, {positions.size} positions, "
                f"{seq_ids.size} seq_ids"
            )
        if cells.size == 0:
            return
        if cells.min() < 0 or cells.max() >= self.n_cells:
            raise ValueError(f"cell index out of range [0, {self.n_cells})")
        if np.unique(cells).size != cells.size:
            raise ValueError("duplicate cells in ubatch")
        if positions.min() < 0:
            raise ValueError("positions must be >= 0")
        if seq_ids.min() < 0 or seq_ids.max() >= self.n_seq_max:
            raise ValueError(f"seq id out of range [0, {self.n_seq_max})")
        if (self.pos[cells] != -1).any():
            raise ValueError("apply_ubatch into a cell that is not free")
        self.pos[cells] = positions
        self.owners[seq_ids, cells] = True
        self.num_owners[cells] = 1
        self.owner_xor[cells] = seq_ids
        self.used += int(cells.size)
        self.seq_count += np.bincount(seq_ids, minlength=self.n_seq_max)
        np.minimum.at(self.seq_min, seq_ids, positions)
        np.maximum.at(self.seq_max, seq_ids, positions)
        self.head = int(cells[-1] + 1) % self.n_cells

    # -- sequence operations (llama_kv_cache::seq_*) ------------------------------------------

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        """Drop seq_id from its cells with pos in [p0, p1); ownerless cells are freed; -1 = all."""
        self._check_seq(seq_id, allow_all=True)
        lo, hi = self._range(p0, p1)
        in_range = (self.pos >= lo) & (self.pos < hi)
        if seq_id < 0:
            cells = np.flatnonzero(in_range)
            self.seq_count -= self.owners[:, cells].sum(axis=1)
            self.seq_dirty |= self.owners[:, cells].any(axis=1)
            self.owners[:, cells] = False
            self.num_owners[cells] = 0
            self.held[cells] = False
            self.owner_xor[cells] = 0
            freed = cells
        else:
            cells = np.flatnonzero(in_range & self.owners[seq_id])
            freed = self._drop_owner(seq_id, cells)
            self.seq_dirty[seq_id] |= cells.size > 0
        self._free(freed)
        self._reset_empty_seqs()
        if freed.size and freed[0] < self.head:
            self.head = int(freed[0])

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst becomes an owner of src's cells with pos in [p0, p1); no data is copied."""
        self._check_seq(src)
        self._check_seq(dst)
        lo, hi = self._range(p0, p1)
        if src == dst:
            return
        p = self.pos
        cells = np.flatnonzero(self.owners[src] & ~self.owners[dst] & (p >= lo) & (p < hi))
        if cells.size == 0:
            return
        self.owners[dst, cells] = True
        self.num_owners[cells] += 1
        self.owner_xor[cells] ^= dst
        self.seq_count[dst] += cells.size
        self.seq_min[dst] = min(int(self.seq_min[dst]), int(p[cells].min()))
        self.seq_max[dst] = max(int(self.seq_max[dst]), int(p[cells].max()))

    def seq_keep(self, seq_id: int) -> None:
        """Free every cell seq_id does not own; seq_id becomes the only owner of the rest."""
        self._check_seq(seq_id)
        keep = self.owners[seq_id].copy()
        freed = np.flatnonzero((self.pos != -1) & ~keep)
        self.owners[:] = False
        self.owners[seq_id] = keep
        self.num_owners[:] = keep
        self.held[:] = False
        self.owner_xor[:] = np.where(keep, seq_id, 0)
        self._free(freed)
        self.seq_count[:] = 0
        self.seq_count[seq_id] = int(keep.sum())
        self._reset_empty_seqs()
        if freed.size and freed[0] < self.head:
            self.head = int(freed[0])

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift seq_id's positions in [p0, p1) by delta (deferred K-shift); cells going
        negative are dropped for seq_id; shared cells are copied first (copy-on-write)."""
        self._check_seq(seq_id)
        lo, hi = self._range(p0, p1)
        if isinstance(delta, bool) or not isinstance(delta, (int, np.integer)):
            raise ValueError(f"delta must be an int, got {delta!r}")
        if delta == 0 or lo == hi:
            return
        cells = self._seq_cells_in(seq_id, lo, hi)
        new_pos = self.pos[cells] + delta
        gone = cells[new_pos < 0]
        moved = self._copy_on_write(seq_id, cells[new_pos >= 0])
        self.pos[moved] += delta
        self.shift[moved] += delta
        self.has_shift |= moved.size > 0
        freed = self._drop_owner(seq_id, gone)
        self._free(freed)
        self.seq_dirty[seq_id] = True
        self._reset_empty_seqs()
        # llama.cpp: search restarts at the first freed cell, else at 0
        self.head = int(freed[0]) if freed.size else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """pos //= d for seq_id's cells in [p0, p1) (self-extend); deferred K-shift, CoW."""
        self._check_seq(seq_id)
        lo, hi = self._range(p0, p1)
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d <= 0:
            raise ValueError(f"d must be an int >= 1, got {d!r}")
        if d == 1 or lo == hi:
            return
        cells = self._seq_cells_in(seq_id, lo, hi)
        cells = cells[self.pos[cells] // d != self.pos[cells]]
        moved = self._copy_on_write(seq_id, cells)
        old = self.pos[moved]
        self.pos[moved] = old // d
        self.shift[moved] += self.pos[moved] - old
        self.has_shift |= moved.size > 0
        self.seq_dirty[seq_id] |= moved.size > 0

    def seq_rm_below(self, cut: np.ndarray) -> None:
        """seq_rm(s, 0, cut[s]) for every sequence s at once (cut: [n_seq_max] int64): how a
        sliding-window pool drops what left each sequence's window."""
        single, shared, drop = self._below(cut)
        owner = self.owner_xor[single]
        self.owners[owner, single] = False
        self.num_owners[single] = 0
        self.owner_xor[single] = 0
        self.seq_count -= np.bincount(owner, minlength=self.n_seq_max)
        self.seq_dirty[owner] = True
        if shared.size:
            ids = np.arange(self.n_seq_max, dtype=np.int32)[:, None]
            self.owners[:, shared] &= ~drop
            self.num_owners[shared] -= drop.sum(axis=0).astype(np.int32)
            self.owner_xor[shared] ^= np.bitwise_xor.reduce(np.where(drop, ids, 0), axis=0)
            self.seq_count -= drop.sum(axis=1)
            self.seq_dirty |= drop.any(axis=1)
        freed = np.concatenate([single, shared[self.num_owners[shared] == 0]])
        freed.sort()
        self._free(freed)
        self._reset_empty_seqs()
        if freed.size and freed[0] < self.head:
            self.head = int(freed[0])

    def freed_below(self, cut: np.ndarray) -> np.ndarray:
        """[n_cells] bool: the cells seq_rm_below(cut) would free; never mutates."""
        single, shared, drop = self._below(cut)
        mask = np.zeros(self.n_cells, dtype=bool)
        mask[single] = True
        left = (self.owners[:, shared] & ~drop).sum(axis=0) + self.held[shared]
        mask[shared[left == 0]] = True
        return mask

    # -- queries -------------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of seq_id, -1 when it owns nothing."""
        self._check_seq(seq_id)
        self._refresh(seq_id)
        return int(self.seq_min[seq_id]) if self.seq_count[seq_id] else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id, -1 when it owns nothing."""
        self._check_seq(seq_id)
        self._refresh(seq_id)
        return int(self.seq_max[seq_id])

    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(cells, positions) of seq_id, int64, sorted by position."""
        self._check_seq(seq_id)
        cells = np.flatnonzero(self.owners[seq_id])
        positions = self.pos[cells]
        order = np.argsort(positions, kind="stable")
        return cells[order], positions[order]

    def seq_num_cells(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return int(self.seq_count[seq_id])

    def owner_map(self) -> np.ndarray:
        """Per cell: FREE, SHARED (2+ owners), HELD (only the memory holds it), else the single
        owner's seq id (int32)."""
        n = self.num_owners
        single = np.where(self.held, HELD, self.owner_xor)
        return np.where(n == 1, single, np.where(n == 0, FREE, SHARED)).astype(np.int32)

    def take_pending(self) -> PendingOps:
        """Copies (in order) then K-shifts recorded since the last call; resets them."""
        if not self.copies and not self.has_shift:
            return PendingOps.empty()
        if self.copies:
            src = np.concatenate([s for s, _ in self.copies])
            dst = np.concatenate([d for _, d in self.copies])
        else:
            src = dst = np.zeros(0, dtype=np.int64)
        shift_cells = np.flatnonzero(self.shift)
        deltas = self.shift[shift_cells].copy()
        self.shift[shift_cells] = 0
        self.copies = []
        self.has_shift = False
        return PendingOps(src, dst.copy(), shift_cells.astype(np.int64), deltas)

    def clear(self) -> None:
        """Free every cell and drop pending work; head returns to 0."""
        self.pos[:] = -1
        self.shift[:] = 0
        self.owners[:] = False
        self.num_owners[:] = 0
        self.held[:] = False
        self.owner_xor[:] = 0
        self.seq_count[:] = 0
        self._reset_empty_seqs()
        self.head = 0
        self.used = 0
        self.has_shift = False
        self.copies = []

    def stats(self) -> CellStats:
        free = self.pos == -1
        num_free = int(free.sum())
        return CellStats(
            n_cells=self.n_cells,
            used=self.used,
            shared=int((self.num_owners > 1).sum()),
            pending_shift=int(np.count_nonzero(self.shift)),
            num_seqs=int(np.count_nonzero(self.seq_count)),
            fragmentation=1.0 - longest_run(free) / num_free if num_free else 0.0,
        )

    def check(self) -> None:
        """Recompute every cached quantity from pos/owners and assert the invariants."""
        check_cells(self)

    # -- internals -----------------------------------------------------------------------------

    def _free_from_head(self, n: int) -> np.ndarray:
        # NOTE: look just past head first: scanning all cells was 5% of a 1-stream decode step
        near = np.flatnonzero(self.pos[self.head : self.head + max(4 * n, 256)] == -1)
        if near.size >= n:
            return near[:n] + self.head
        after = np.flatnonzero(self.pos[self.head :] == -1)
        if after.size >= n:
            return after[:n] + self.head
        before = np.flatnonzero(self.pos[: self.head] == -1)[: n - after.size]
        return np.concatenate([after + self.head, before]).astype(np.int64)

    def _below(self, cut: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (single-owner cells below their owner's cut, shared cells, [n_seq_max, n_shared]
        which owners drop each shared cell)."""
        single = np.flatnonzero((self.num_owners == 1) & ~self.held)
        single = single[self.pos[single] < cut[self.owner_xor[single]]]
        shared = np.flatnonzero(self.num_owners > 1)
        drop = self.owners[:, shared] & (self.pos[shared][None, :] < cut[:, None])
        return single.astype(np.int64), shared.astype(np.int64), drop

    def _copy_on_write(self, seq_id: int, cells: np.ndarray) -> np.ndarray:
        """Give seq_id a private copy of each cell in `cells` that others also own; returns
        `cells` with those replaced by the copies. Raises (changing nothing) if no room."""
        shared = self.num_owners[cells] > 1
        n_copies = int(shared.sum())
        if n_copies == 0:
            return cells
        if n_copies > self.n_cells - self.used:
            raise ValueError(
                f"copy-on-write of seq {seq_id} needs {n_copies} free cells, "
                f"{self.n_cells - self.used} free"
            )
        src = cells[shared]
        dst = self._free_from_head(n_copies)
        self.pos[dst] = self.pos[src]
        self.shift[dst] = self.shift[src]
        self._drop_owner(seq_id, src)
        self.seq_count[seq_id] += n_copies
        self.owners[seq_id, dst] = True
        self.num_owners[dst] = 1
        self.owner_xor[dst] = seq_id
        self.used += n_copies
        self.copies.append((src.astype(np.int64), dst.astype(np.int64)))
        out = cells.copy()
        out[shared] = dst
        return out

    def _drop_owner(self, seq_id: int, cells: np.ndarray) -> np.ndarray:
        """Remove seq_id from `cells` (all owned by it); returns the cells left ownerless."""
        self.owners[seq_id, cells] = False
        self.num_owners[cells] -= 1
        self.seq_count[seq_id] -= cells.size
        self.owner_xor[cells] ^= seq_id
        return cells[self.num_owners[cells] == 0]

    def _seq_cells_in(self, seq_id: int, lo: int, hi: int) -> np.ndarray:
        p = self.pos
        return np.flatnonzero(self.owners[seq_id] & (p >= lo) & (p < hi))

    def _free(self, cells: np.ndarray) -> None:
        self.pos[cells] = -1
        self.shift[cells] = 0
        self.used -= int(cells.size)

    def _reset_empty_seqs(self) -> None:
        empty = self.seq_count == 0
        self.seq_min[empty] = _NO_POS
        self.seq_max[empty] = -1
        self.seq_dirty[empty] = False

    def _refresh(self, seq_id: int) -> None:
        if self.seq_dirty[seq_id]:
            p = self.pos[self.owners[seq_id]]
            self.seq_min[seq_id] = p.min()
            self.seq_max[seq_id] = p.max()
            self.seq_dirty[seq_id] = False

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        if not (0 <= seq_id < self.n_seq_max or (allow_all and seq_id == -1)):
            raise ValueError(f"seq id {seq_id} out of range [0, {self.n_seq_max})")

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        if p0 >= 0 and p1 >= 0 and p0 > p1:
            raise ValueError(f"empty range [{p0}, {p1}) with p0 > p1")
        return max(p0, 0), (p1 if p1 >= 0 else _NO_POS)
