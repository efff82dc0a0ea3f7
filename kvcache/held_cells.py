"""Cells the memory itself holds, with no seq id: what the prefix index (scheduler/radix.py)
keeps of finished conversations, so that thousands of them fit in the cache while running
sequences keep every seq id.

A held cell counts as one owner (KVCells.num_owners), so it is never freed while held, and a
sequence that also owns it copies it before a seq_add / seq_div moves it (copy-on-write). It
is handed to a sequence by cells_cp: seq_cp by cell instead of by a source sequence's range.
"""

from __future__ import annotations

import numpy as np

from kvcache.cells import KVCells


def cells_hold(kv: KVCells, cells: np.ndarray) -> None:
    """The memory holds `cells` (in use, not held yet) until cells_release."""
    cells = np.asarray(cells, dtype=np.int64)
    assert (kv.pos[cells] >= 0).all(), "hold of a free cell"
    assert not kv.held[cells].any(), "cell held twice"
    kv.held[cells] = True
    kv.num_owners[cells] += 1


def cells_release(kv: KVCells, cells: np.ndarray) -> None:
    """Drop the memory's hold on `cells`; those no sequence owns are freed."""
    cells = np.asarray(cells, dtype=np.int64)
    assert kv.held[cells].all(), "release of a cell not held"
    kv.held[cells] = False
    kv.num_owners[cells] -= 1
    freed = cells[kv.num_owners[cells] == 0]
    kv.pos[freed] = -1
    kv.shift[freed] = 0
    kv.used -= int(freed.size)
    if freed.size:
        kv.head = min(kv.head, int(freed.min()))


def cells_cp(kv: KVCells, cells: np.ndarray, dst: int) -> None:
    """dst becomes an owner of `cells` (in use, one per position): seq_cp by cell."""
    cells = np.asarray(cells, dtype=np.int64)
    assert 0 <= dst < kv.n_seq_max
    assert (kv.pos[cells] >= 0).all(), "cells_cp of a free cell"
    cells = cells[~kv.owners[dst, cells]]
    if cells.size == 0:
        return
    p = kv.pos[cells]
    kv.owners[dst, cells] = True
    kv.num_owners[cells] += 1
    kv.owner_xor[cells] ^= dst
    kv.seq_count[dst] += cells.size
    kv.seq_min[dst] = min(int(kv.seq_min[dst]), int(p.min()))
    kv.seq_max[dst] = max(int(kv.seq_max[dst]), int(p.max()))


def seq_prefix_cells(kv: KVCells, seq_id: int, n: int) -> np.ndarray:
    """The cells of seq_id's positions 0..n-1, in position order (it must hold each once)."""
    cells, pos = kv.seq_cells(seq_id)
    keep = pos < n
    assert int(keep.sum()) == n and (pos[keep] == np.arange(n)).all(), "one cell per position"
    return cells[keep]
