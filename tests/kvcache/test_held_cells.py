"""Cells the memory holds itself (kvcache/held_cells.py): an owner without a seq id."""

from __future__ import annotations

import numpy as np

from kvcache.cells import HELD, SHARED, KVCells
from kvcache.held_cells import cells_cp, cells_hold, cells_release, seq_prefix_cells
from kvcache.iswa import ISWAMemory
from kvcache.spec import Attention, MemorySpec


def make_cache(n_cells: int = 16, n_seq_max: int = 2) -> KVCells:
    return KVCells(n_cells, n_seq_max)


def held_prefix(kv: KVCells, n: int) -> np.ndarray:
    """Seq 0 computes n tokens, the memory holds them, seq 0 leaves: -> the held cells."""
    cells = kv.find_slot(n)
    assert cells is not None
    kv.apply_ubatch(cells, np.arange(n), np.zeros(n, dtype=np.int64))
    prefix = seq_prefix_cells(kv, 0, n)
    cells_hold(kv, prefix)
    kv.seq_rm(0, -1, -1)
    kv.check()
    return prefix


def test_held_cells_outlive_their_sequence_and_are_freed_on_release() -> None:
    kv = make_cache()
    cells = held_prefix(kv, 4)
    assert kv.used == 4 and kv.seq_num_cells(0) == 0
    assert (kv.owner_map()[cells] == HELD).all()
    cells_release(kv, cells)
    kv.check()
    assert kv.used == 0


def test_cells_cp_shares_held_cells_and_a_shift_copies_them_first() -> None:
    kv = make_cache()
    cells = held_prefix(kv, 4)
    cells_cp(kv, cells, 1)
    kv.check()
    assert kv.seq_cells(1)[1].tolist() == [0, 1, 2, 3]
    assert (kv.owner_map()[cells] == SHARED).all()
    kv.seq_add(1, 2, -1, 5)  # copy-on-write: the held cells keep their positions
    kv.check()
    assert kv.pos[cells].tolist() == [0, 1, 2, 3]
    assert kv.seq_cells(1)[1].tolist() == [0, 1, 7, 8] and kv.used == 6
    cells_release(kv, cells)  # seq 1 still owns two of them
    kv.check()
    assert kv.used == 4
    kv.seq_rm(1, -1, -1)
    kv.check()
    assert kv.used == 0


def test_seq_rm_of_every_sequence_and_clear_drop_the_holds() -> None:
    kv = make_cache()
    held_prefix(kv, 3)
    kv.seq_rm(-1, -1, -1)
    kv.check()
    assert kv.used == 0 and not kv.held.any()
    held_prefix(kv, 3)
    kv.clear()
    kv.check()
    assert not kv.held.any()


def test_a_window_cut_never_frees_a_held_cell() -> None:
    kv = make_cache()
    cells = held_prefix(kv, 4)
    cells_cp(kv, cells, 1)
    cut = np.array([0, 3], dtype=np.int64)
    assert not kv.freed_below(cut).any()
    kv.seq_rm_below(cut)
    kv.check()
    assert kv.used == 4 and kv.seq_cells(1)[1].tolist() == [3]


def test_the_iswa_memory_holds_cells_in_every_pool_only_with_room_for_the_index() -> None:
    spec = MemorySpec.of([Attention(1, 4), Attention(1, 4, window=4)])
    memory = ISWAMemory(spec, 32, 2, 8)
    assert not memory.holds_cells and memory.index_budget == (0,)
    memory = ISWAMemory(spec, 32, 2, 8, index_cells=6)
    assert memory.holds_cells and memory.index_windows == (4,) and memory.index_budget == (6,)
    assert memory.pools[1].cells.n_cells == 4 * 2 + 8 + 6
    plan = memory.plan(np.arange(6), np.zeros(6, dtype=np.int64))
    assert plan is not None
    memory.apply(plan)
    memory.seq_trim(0)  # seq 0's window: positions 2..5
    full = memory.seq_prefix_cells(0, 6)
    window = memory.seq_window_cells(0, 6)
    assert window is not None and (window[0][1] == np.arange(2, 6)).all()
    short = memory.seq_window_cells(0, 3)  # only position 2 is left below 3
    assert short is not None and (short[0][1] == [2]).all()
    assert memory.seq_window_cells(0, 9) is None  # no position 8
    memory.cells_hold(full)
    memory.cells_hold(window[0][0], pool=1)
    memory.seq_rm(0, -1, -1)
    memory.check()
    assert memory.pools[1].cells.used == 4  # held without a seq id
    memory.cells_cp(full, 1)
    memory.cells_cp(window[0][0], 1, pool=1)
    assert memory.usable_prefix(1, 6) == 6
    memory.cells_release(full)
    memory.cells_release(window[0][0], pool=1)
    memory.seq_rm(1, -1, -1)
    memory.check()
    assert memory.num_used == 0
