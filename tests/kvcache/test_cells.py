"""Unit tests of KVCells: placement, llama.cpp semantics, copy-on-write, errors."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvcache.cells import CellStats, KVCells
from kvcache.memory import Memory
from kvcache.spec import Attention, MemorySpec
from kvcache.unified import UnifiedMemory


def make_cache(n_cells: int = 16, n_seq_max: int = 4) -> KVCells:
    return KVCells(n_cells, n_seq_max)


def write(kv: KVCells, seq_id: int, positions: list[int]) -> np.ndarray:
    cells = kv.find_slot(len(positions))
    assert cells is not None
    kv.apply_ubatch(cells, np.array(positions), np.full(len(positions), seq_id))
    kv.check()
    return cells


def snapshot(kv: KVCells) -> tuple[object, ...]:
    return (
        kv.pos.tolist(),
        kv.shift.tolist(),
        kv.owners.tolist(),
        kv.head,
        kv.used,
        len(kv.copies),
        [kv.seq_pos_max(s) for s in range(kv.n_seq_max)],
    )


def test_find_slot_does_not_mutate_and_starts_at_head() -> None:
    kv = make_cache(8)
    write(kv, 0, [0, 1, 2])
    before = snapshot(kv)
    assert kv.find_slot(3).tolist() == [3, 4, 5]
    assert kv.find_slot(3).tolist() == [3, 4, 5]
    assert snapshot(kv) == before


def test_find_slot_wraps_at_the_end() -> None:
    kv = make_cache(8)
    kv.apply_ubatch(np.array([5]), np.array([0]), np.array([0]))
    assert kv.head == 6
    assert kv.find_slot(4).tolist() == [6, 7, 0, 1]


def test_find_slot_is_non_contiguous_and_seq_rm_lowers_head() -> None:
    kv = make_cache(10)
    write(kv, 0, [0, 1, 2, 3])
    write(kv, 1, [0, 1, 2, 3])
    assert kv.head == 8
    kv.seq_rm(0, 1, 3)  # frees cells 1, 2; llama.cpp moves head to the first freed cell
    assert kv.head == 1
    kv.apply_ubatch(np.array([1]), np.array([9]), np.array([2]))
    assert kv.head == 2
    kv.seq_rm(1, 3, -1)  # frees cell 7 only; head stays
    assert kv.head == 2
    assert kv.find_slot(2).tolist() == [2, 7]
    assert kv.find_slot(4).tolist() == [2, 7, 8, 9]
    assert kv.find_slot(5) is None


def test_find_slot_none_when_full_and_rejects_zero() -> None:
    kv = make_cache(4)
    write(kv, 0, [0, 1, 2, 3])
    assert kv.head == 0
    assert kv.find_slot(1) is None
    with pytest.raises(ValueError):
        kv.find_slot(0)


@pytest.mark.parametrize(
    "call",
    [
        lambda kv: kv.apply_ubatch(np.array([0]), np.array([5]), np.array([1])),  # cell taken
        lambda kv: kv.apply_ubatch(np.array([9, 9]), np.array([1, 2]), np.array([1, 1])),
        lambda kv: kv.apply_ubatch(np.array([20]), np.array([1]), np.array([1])),
        lambda kv: kv.apply_ubatch(np.array([9]), np.array([1]), np.array([4])),
        lambda kv: kv.apply_ubatch(np.array([9]), np.array([-1]), np.array([1])),
        lambda kv: kv.apply_ubatch(np.array([9, 10]), np.array([1]), np.array([1])),
        lambda kv: kv.seq_rm(4, -1, -1),
        lambda kv: kv.seq_rm(-2, -1, -1),
        lambda kv: kv.seq_rm(0, 5, 2),
        lambda kv: kv.seq_cp(0, 7, -1, -1),
        lambda kv: kv.seq_keep(-1),
        lambda kv: kv.seq_add(0, -1, -1, 1.5),
        lambda kv: kv.seq_add(5, -1, -1, 1),
        lambda kv: kv.seq_div(0, -1, -1, 0),
        lambda kv: kv.seq_div(0, 3, 1, 2),
        lambda kv: kv.seq_pos_max(4),
    ],
)
def test_bad_calls_raise_and_change_nothing(call: Callable[[KVCells], object]) -> None:
    kv = make_cache(16)
    write(kv, 0, [0, 1, 2, 3])
    kv.seq_add(0, 2, -1, 3)
    before = snapshot(kv)
    with pytest.raises(ValueError):
        call(kv)
    assert snapshot(kv) == before
    kv.check()


def test_seq_rm_all_sequences_and_ranges() -> None:
    kv = make_cache(16)
    write(kv, 0, [0, 1, 2, 3])
    kv.seq_cp(0, 1, 1, 3)
    write(kv, 2, [1, 2])
    kv.seq_rm(-1, 2, -1)
    kv.check()
    assert kv.seq_cells(0)[1].tolist() == [0, 1]
    assert kv.seq_cells(1)[1].tolist() == [1]
    assert kv.seq_cells(2)[1].tolist() == [1]
    assert kv.used == 3


def test_seq_cp_copies_only_range_and_seq_keep() -> None:
    kv = make_cache(16)
    write(kv, 0, [0, 1, 2, 3, 4])
    write(kv, 1, [0, 1])
    kv.seq_cp(0, 2, 1, 3)
    kv.check()
    assert kv.seq_cells(2)[1].tolist() == [1, 2]
    assert kv.stats().shared == 2
    kv.seq_keep(2)
    kv.check()
    assert kv.used == 2 and kv.stats().shared == 0
    assert [kv.seq_num_cells(s) for s in range(4)] == [0, 0, 2, 0]
    assert kv.owner_map().tolist()[:5] == [-1, 2, 2, -1, -1]


def test_seq_add_drops_negative_cells_for_that_seq_only() -> None:
    kv = make_cache(16)
    write(kv, 0, [0, 1, 2, 3])
    kv.seq_add(0, -1, -1, -2)
    kv.check()
    assert kv.seq_cells(0)[1].tolist() == [0, 1]
    assert kv.used == 2 and kv.head == 0
    ops = kv.take_pending()
    assert ops.copy_src.size == 0
    assert sorted(zip(ops.shift_cells.tolist(), ops.shift_deltas.tolist(), strict=True)) == [
        (2, -2),
        (3, -2),
    ]
    assert kv.take_pending().is_empty


def test_seq_div_floors_and_records_shift() -> None:
    kv = make_cache(16)
    write(kv, 0, [0, 1, 2, 3, 7])
    kv.seq_div(0, 1, -1, 2)
    kv.check()
    assert kv.pos[:5].tolist() == [0, 0, 1, 1, 3]
    assert kv.shift[:5].tolist() == [0, -1, -1, -2, -4]
    assert kv.seq_pos_max(0) == 3


def test_copy_on_write_keeps_other_owners_positions() -> None:
    kv = make_cache(16)
    prefix = write(kv, 0, [0, 1, 2, 3])
    kv.seq_cp(0, 1, -1, -1)
    kv.seq_add(1, 2, -1, 10)
    kv.check()
    assert kv.seq_cells(0)[1].tolist() == [0, 1, 2, 3]
    assert kv.seq_cells(0)[0].tolist() == prefix.tolist()
    cells1, pos1 = kv.seq_cells(1)
    assert pos1.tolist() == [0, 1, 12, 13]
    assert cells1[:2].tolist() == prefix[:2].tolist()
    assert kv.stats().shared == 2 and kv.used == 6
    ops = kv.take_pending()
    assert ops.copy_src.tolist() == prefix[2:].tolist()
    assert ops.copy_dst.tolist() == cells1[2:].tolist()
    assert ops.shift_cells.tolist() == cells1[2:].tolist()
    assert ops.shift_deltas.tolist() == [10, 10]


def test_copy_carries_the_source_pending_shift() -> None:
    kv = make_cache(8)
    write(kv, 0, [5])
    kv.seq_add(0, -1, -1, 2)  # cell 0: pos 7, owes +2
    kv.seq_cp(0, 1, -1, -1)
    kv.seq_add(1, -1, -1, 3)  # copy 0 -> 1 owes the source's +2, then its own +3
    kv.check()
    ops = kv.take_pending()
    assert (ops.copy_src.tolist(), ops.copy_dst.tolist()) == ([0], [1])
    assert dict(zip(ops.shift_cells.tolist(), ops.shift_deltas.tolist(), strict=True)) == {
        0: 2,
        1: 5,
    }


def test_copy_on_write_without_room_raises_and_changes_nothing() -> None:
    kv = make_cache(6)
    write(kv, 0, [0, 1, 2, 3])
    kv.seq_cp(0, 1, -1, -1)
    before = snapshot(kv)
    with pytest.raises(ValueError, match="copy-on-write"):
        kv.seq_add(1, -1, -1, 1)
    assert snapshot(kv) == before
    kv.seq_add(1, 2, -1, 1)  # two copies fit
    kv.check()
    assert kv.used == 6 and kv.seq_cells(1)[1].tolist() == [0, 1, 3, 4]


def test_stats_equal_a_recount() -> None:
    kv = make_cache(16)
    write(kv, 0, [0, 1, 2, 3, 4, 5])
    write(kv, 1, [0, 1, 2])
    kv.seq_cp(0, 2, 0, 2)
    kv.seq_rm(0, 3, 5)  # free cells 3, 4 -> free runs {3, 4} and {9..15}
    kv.seq_add(1, -1, -1, 1)
    own = kv.owner_map()
    free = int((own == -1).sum())
    assert kv.stats() == CellStats(
        n_cells=16,
        used=16 - free,
        shared=int((own == -2).sum()),
        pending_shift=int((kv.shift != 0).sum()),
        num_seqs=3,
        fragmentation=1 - 7 / 9,
    )
    assert kv.stats().shared == 2 and kv.stats().pending_shift == 3


def test_clear_resets_everything() -> None:
    kv = make_cache(8)
    write(kv, 0, [0, 1, 2])
    kv.seq_cp(0, 1, -1, -1)
    kv.seq_add(1, -1, -1, 4)
    kv.clear()
    kv.check()
    assert kv.used == 0 and kv.head == 0 and kv.take_pending().is_empty
    assert [kv.seq_pos_max(s) for s in range(4)] == [-1] * 4
    assert kv.stats() == CellStats(8, 0, 0, 0, 0, 0.0)


def test_the_unified_memory_keeps_its_cells_in_kvcells() -> None:
    memory = UnifiedMemory(MemorySpec.of([Attention(2, 8)]), 16, 4)
    assert isinstance(memory, Memory) and isinstance(memory.pools[0].cells, KVCells)
    plan = memory.plan(np.arange(3), np.zeros(3, dtype=np.int64))
    assert plan is not None
    memory.apply(plan)
    assert memory.pools[0].cells.seq_cells(0)[1].tolist() == [0, 1, 2]
