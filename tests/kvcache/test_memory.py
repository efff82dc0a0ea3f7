"""The Memory interface: plan never mutates, apply commits, views follow Attention.visible."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.iswa import ISWAMemory
from kvcache.make import make_memory
from kvcache.memory import Memory, seq_cells_view
from kvcache.spec import Attention, MemorySpec
from kvcache.unified import UnifiedMemory

SWA_SPEC = MemorySpec.of([Attention(2, 8), Attention(2, 8, 4), Attention(2, 8)])


def make_unified(n_cells: int = 16, spec: MemorySpec = SWA_SPEC) -> UnifiedMemory:
    return UnifiedMemory(spec, n_cells, n_seq_max=4)


def state(mem: Memory) -> list[object]:
    return [
        (p.cells.pos.tolist(), p.cells.owners.tolist(), p.cells.head, p.cells.used)
        for p in mem.pools
    ]


def prefill(mem: Memory, seq_id: int, n: int, p0: int = 0) -> None:
    plan = mem.plan(np.arange(p0, p0 + n), np.full(n, seq_id))
    assert plan is not None
    mem.apply(plan)


@pytest.mark.parametrize("kind", ["unified", "iswa"])
def test_plan_never_mutates_and_apply_commits(kind: str) -> None:
    mem = make_memory(SWA_SPEC, 16, 4, n_batch=8, kind=kind)
    prefill(mem, 0, 6)
    before = state(mem)
    plan = mem.plan(np.arange(6, 10), np.zeros(4, dtype=np.int64))
    assert plan is not None and state(mem) == before
    assert mem.plan(np.arange(6, 17), np.zeros(11, dtype=np.int64)) is None
    assert state(mem) == before
    mem.apply(plan)
    assert mem.seq_pos_max(0) == 9 and mem.pools[0].cells.used == 10
    mem.check()


def test_unified_windowed_group_reads_the_same_cells_through_a_narrower_range() -> None:
    mem = make_unified()
    prefill(mem, 0, 10)
    full, swa = mem.views(0, np.array([8, 9]))
    assert mem.group_pools == (0, 0)
    assert (full.kv_cells == swa.kv_cells).all()
    assert full.lo.tolist() == [0, 0] and full.hi.tolist() == [9, 10]
    assert swa.lo.tolist() == [5, 6] and swa.hi.tolist() == [9, 10]  # (q - 4, q]
    pending = mem.take_pending()
    assert len(pending) == 2 and pending[0] is pending[1]


def test_iswa_pools_and_groups() -> None:
    mem = ISWAMemory(SWA_SPEC, 64, n_seq_max=4, n_batch=8)
    assert [(p.name, p.cells.n_cells, p.window) for p in mem.pools] == [
        ("full", 64, 0),
        ("swa", 4 * 4 + 8, 4),
    ]
    assert mem.group_pools == (0, 1)
    prefill(mem, 0, 8)
    prefill(mem, 0, 1, p0=8)  # prunes against max 7: keeps positions 4..7, adds 8
    assert mem.pools[1].cells.seq_cells(0)[1].tolist() == [4, 5, 6, 7, 8]
    full, swa = mem.views(0, np.array([9]))
    assert swa.kv_pos[swa.lo[0] : swa.hi[0]].tolist() == [6, 7, 8]  # a row at 9 sees 6..9
    assert full.hi[0] - full.lo[0] == 9


def test_seq_cells_view_ranges() -> None:
    kv_pos = np.array([0, 1, 2, 5, 6])
    view = seq_cells_view(np.arange(5), kv_pos, np.array([2, 6]), window=3)
    assert view.lo.tolist() == [0, 3] and view.hi.tolist() == [3, 5]


@given(
    st.lists(st.integers(0, 40), max_size=24),
    st.lists(st.integers(0, 48), min_size=1, max_size=6),
    st.sampled_from([0, 1, 3, 8]),
)
def test_seq_cells_view_is_the_spec_visibility_rule(
    positions: list[int], q_pos: list[int], window: int
) -> None:
    """Row r sees kv[lo[r]:hi[r]] exactly where kvcache.spec.Attention.visible says so (the
    kernels and the masks read these ranges; positions may repeat after seq_div)."""
    kv_pos = np.sort(np.array(positions, np.int64))
    view = seq_cells_view(np.arange(len(kv_pos)), kv_pos, np.array(q_pos), window)
    rule = Attention(1, 1, window)
    for r, q in enumerate(q_pos):
        seen = [j for j, p in enumerate(kv_pos.tolist()) if rule.visible(p, q)]
        assert seen == list(range(view.lo[r], view.hi[r]))


def test_make_memory_picks_the_variant_from_the_spec() -> None:
    full = MemorySpec.of([Attention(2, 8)] * 2)
    assert isinstance(make_memory(full, 32, 4, 8), UnifiedMemory)
    assert isinstance(make_memory(SWA_SPEC, 32, 4, 8), ISWAMemory)
    assert isinstance(make_memory(SWA_SPEC, 32, 4, 8, kind="unified"), UnifiedMemory)
    assert isinstance(make_memory(None, 32, 4, 8), UnifiedMemory)
    with pytest.raises(ValueError):
        make_memory(full, 32, 4, 8, kind="iswa")
