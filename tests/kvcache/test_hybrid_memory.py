"""HybridMemory: attention cells beside state slots, composed so that both parts always agree."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache.hybrid import HybridMemory, attention_spec, recurrent_spec
from kvcache.iswa import ISWAMemory
from kvcache.make import make_memory
from kvcache.memory import Memory
from kvcache.recurrent import RecurrentMemory
from kvcache.spec import Attention, MemorySpec, Recurrent
from kvcache.unified import UnifiedMemory
from scheduler.plan import Capture, group_batches

STATE = Recurrent(((3, 8),))
SPEC = MemorySpec.of([STATE, Attention(2, 8), STATE, Attention(2, 8, 4)])


def make_hybrid(n_cells: int = 32, kind: str = "unified", **kw: object) -> HybridMemory:
    mem = make_memory(SPEC, n_cells, 4, n_batch=8, kind=kind, **kw)  # type: ignore[arg-type]
    assert isinstance(mem, HybridMemory)
    return mem


def prefill(mem: Memory, seq_id: int, n: int, p0: int = 0) -> None:
    plan = mem.plan(np.arange(p0, p0 + n), np.full(n, seq_id))
    assert plan is not None
    mem.apply(plan)


def state(mem: HybridMemory) -> object:
    cells = mem.attn.pools[0].cells
    sl = mem.recr.slots
    return (cells.pos.tolist(), cells.owners.tolist(), list(sl.tail), list(sl.pos), sl.ckpts)


def test_make_memory_picks_recurrent_or_hybrid() -> None:
    assert isinstance(make_memory(MemorySpec.of([STATE] * 3), 32, 4, 8), RecurrentMemory)
    mem = make_hybrid(kind="auto")
    assert isinstance(mem.attn, ISWAMemory) and isinstance(mem.recr, RecurrentMemory)
    assert [p.name for p in mem.pools] == ["full", "swa", "recurrent"]
    # groups: full, recurrent, swa4 (first appearance, full first)
    assert [g.key for g in SPEC.groups] == ["full", "recurrent", "swa4"]
    assert mem.group_pools == (0, 2, 1)
    assert isinstance(make_hybrid(kind="unified").attn, UnifiedMemory)
    assert make_hybrid(kind="unified").group_pools == (0, 1, 0)
    assert make_hybrid(n_ckpt=3).recr.slots.n_cells == 4 + 3


def test_a_step_fits_only_when_both_parts_fit() -> None:
    mem = make_hybrid(n_cells=10)
    prefill(mem, 0, 8)
    assert mem.num_free() == 2
    assert mem.plan(np.arange(8, 11), np.zeros(3, dtype=np.int64)) is None  # cells
    attn = UnifiedMemory(attention_spec(SPEC), 64, 4)
    small = HybridMemory(SPEC, attn, RecurrentMemory(recurrent_spec(SPEC), 4, n_slots=1))
    prefill(small, 0, 2)
    before = (small.attn.pools[0].cells.used, list(small.recr.slots.tail))
    assert small.plan(np.array([0]), np.array([1])) is None  # no slot for a second sequence
    assert (small.attn.pools[0].cells.used, list(small.recr.slots.tail)) == before


def test_seq_rm_is_atomic() -> None:
    mem = make_hybrid(ckpt_interval=100)
    prefill(mem, 0, 10)  # one checkpoint, at 9
    before = state(mem)
    assert not mem.can_rm(0, 5, -1)  # the attention part could; the state cannot
    assert not mem.seq_rm(0, 5, -1)
    assert state(mem) == before
    assert mem.seq_rm(0, 9, -1)  # back to the checkpoint: both parts
    assert mem.seq_pos_max(0) == 8 == mem.attn.seq_pos_max(0) == mem.recr.seq_pos_max(0)
    mem.check()


def test_positions_and_usable_prefix_combine_the_parts() -> None:
    mem = make_hybrid(kind="auto", ckpt_interval=4)  # window 4: a holder keeps its last 4
    prefill(mem, 0, 12)  # checkpoints at 11 (before the last row), 12, 8, 4 (the grid)
    assert sorted(mem.recr.slots.ckpts[0]) == [4, 8, 11, 12]
    assert mem.recr.prefix_lengths(0, 12) == [12, 11, 8, 4]
    assert mem.seq_pos_min(0) == 11 and mem.seq_pos_max(0) == 11  # max of mins, min of maxes
    assert mem.usable_prefix(0, 100) == 12
    # the window pool keeps positions 8..11 (after the next prune): length 11 needs 8..10
    prefill(mem, 0, 1, p0=12)
    assert mem.usable_prefix(0, 12) == 12 and mem.usable_prefix(0, 11) == 11
    assert mem.usable_prefix(0, 10) == 0  # the state has 8, the window no longer has 5..7
    unified = make_hybrid(kind="unified", ckpt_interval=4)
    prefill(unified, 0, 12)
    assert unified.usable_prefix(0, 10) == 8


def test_a_prefix_hit_shares_cells_and_the_checkpoint() -> None:
    mem = make_hybrid(ckpt_interval=4)
    prefill(mem, 0, 10)
    m = mem.usable_prefix(0, 6)
    assert m == 4
    mem.seq_cp(0, 1, 0, m)
    assert mem.attn.seq_pos_max(1) == 3 == mem.recr.seq_pos_max(1)
    assert mem.recr.slots.tail[1] == mem.recr.slots.ckpts[0][4]
    with pytest.raises(ValueError):
        mem.seq_cp(0, 2, 0, 6)  # no state after 6 positions
    assert mem.attn.seq_pos_max(2) == -1  # nothing was shared
    mem.check()


def test_group_batches_give_the_recurrent_group_slots_and_captures() -> None:
    mem = make_hybrid(kind="auto", ckpt_interval=4)
    prefill(mem, 3, 2)
    mem.take_pending()
    positions = np.array([2, 0, 1, 2, 3, 4])
    seq_ids = np.array([3, 1, 1, 1, 1, 1])
    plan = mem.plan(positions, seq_ids)
    assert plan is not None
    mem.apply(plan)
    views = [mem.views(3, positions[:1]), mem.views(1, positions[1:])]
    groups = group_batches(mem, plan, views, mem.take_pending())
    assert [g.key for g in groups] == ["full", "recurrent", "swa4"]
    full, recr, swa = groups
    assert len(full.seqs) == len(swa.seqs) == 2 and recr.seqs == []
    slot1 = mem.recr.slots.tail[1]
    assert recr.cells.tolist() == [mem.recr.slots.tail[3]] + [slot1] * 5
    # seq 1 is the step's second sequence; its prompt step checkpoints before its last row
    assert recr.captures == [Capture(1, 4, mem.recr.slots.ckpts[1][4])]
    assert recr.pending.copy_src.tolist() == [-1] and recr.pending.copy_dst.tolist() == [slot1]
