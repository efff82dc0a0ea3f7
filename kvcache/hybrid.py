"""The hybrid memory (llama.cpp's llama_memory_hybrid): attention layers keep K/V cells
(a unified or iSWA memory over them), recurrent layers state slots (a RecurrentMemory), and
every sequence operation acts on both.

A step fits only when both parts fit. seq_rm is atomic: both parts are asked first
(llama.cpp ANDs the two results and can change one part only). A sequence holds a prefix
only where both do, so seq_pos_min is the larger of the parts' minimums and seq_pos_max the
smaller maximum (llama.cpp), and usable_prefix is the longest length the state has (a
checkpoint or the tail) that the attention part can also serve. A context shift always
recomputes: a state cannot drop tokens from its middle.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar

import numpy as np

from kvcache.cell_types import PendingOps, PoolCells
from kvcache.memory import Memory, MemoryPlan, Pool, SeqCells
from kvcache.recurrent import RecurrentMemory
from kvcache.spec import Attention, MemorySpec, Recurrent

T = TypeVar("T")


def attention_spec(spec: MemorySpec) -> MemorySpec:
    """The attention layers of a hybrid spec (what its attention part is built from)."""
    return MemorySpec.of([s for s in spec.layers if isinstance(s, Attention)])


def recurrent_spec(spec: MemorySpec) -> MemorySpec:
    return MemorySpec.of([s for s in spec.layers if isinstance(s, Recurrent)])


class HybridMemory(Memory):
    def __init__(self, spec: MemorySpec, attn: Memory, recr: RecurrentMemory) -> None:
        if attn.spec != attention_spec(spec) or recr.spec != recurrent_spec(spec):
            raise ValueError(
                "the parts must be built from the spec's attention and recurrent layers"
            )
        if attn.n_seq_max != recr.n_seq_max:
            raise ValueError("both parts need the same n_seq_max")
        self.spec = spec
        self.n_seq_max = attn.n_seq_max
        self.attn = attn
        self.recr = recr
        self._pools: list[Pool[PoolCells]] = [*attn.pools, *recr.pools]
        n_attn = len(attn.pools)
        attn_groups = {g.key: i for i, g in enumerate(attn.spec.groups)}
        self._group_pools = tuple(
            n_attn if isinstance(g.spec, Recurrent) else attn.group_pools[attn_groups[g.key]]
            for g in spec.groups
        )

    @property
    def pools(self) -> list[Pool[PoolCells]]:
        return self._pools

    @property
    def group_pools(self) -> tuple[int, ...]:
        return self._group_pools

    # -- a step ------------------------------------------------------------------------------

    def num_free(self) -> int:
        return self.attn.num_free()

    @property
    def rollback_rows(self) -> int:
        return min(self.attn.rollback_rows, self.recr.rollback_rows)

    def plan(
        self, positions: np.ndarray, seq_ids: np.ndarray, rollback: Collection[int] = ()
    ) -> MemoryPlan | None:
        a = self.attn.plan(positions, seq_ids, rollback)
        return _both(a, self.recr.plan(positions, seq_ids, rollback))

    def apply(self, plan: MemoryPlan) -> None:
        n = len(self.attn.pools)
        self.attn.apply(MemoryPlan(plan.positions, plan.seq_ids, plan.cells[:n]))
        self.recr.apply(
            MemoryPlan(plan.positions, plan.seq_ids, plan.cells[n:], plan.captures, plan.slot_step)
        )

    def plan_written(self, positions: np.ndarray, seq_ids: np.ndarray) -> MemoryPlan | None:
        a = self.attn.plan_written(positions, seq_ids)
        return _both(a, self.recr.plan_written(positions, seq_ids))

    def seq_trim(self, seq_id: int) -> None:
        self.attn.seq_trim(seq_id)

    def seq_rows(self, seq_id: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return self._per_group(self.attn.seq_rows(seq_id, n), self.recr.seq_rows(seq_id, n))

    def views(self, seq_id: int, q_pos: np.ndarray) -> list[SeqCells]:
        return self._per_group(self.attn.views(seq_id, q_pos), self.recr.views(seq_id, q_pos))

    def take_pending(self) -> list[PendingOps]:
        return self._per_group(self.attn.take_pending(), self.recr.take_pending())

    # -- sequence operations -----------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        if not self.can_rm(seq_id, p0, p1):
            return False
        ok = self.attn.seq_rm(seq_id, p0, p1) and self.recr.seq_rm(seq_id, p0, p1)
        assert ok, "can_rm said both parts can"
        return True

    def seq_commit(self, seq_id: int) -> None:
        self.attn.seq_commit(seq_id)
        self.recr.seq_commit(seq_id)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.recr.seq_cp(src, dst, p0, p1)  # raises first, changing nothing, on a bad p1
        self.attn.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.attn.seq_keep(seq_id)
        self.recr.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.attn.seq_add(seq_id, p0, p1, delta)
        self.recr.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.attn.seq_div(seq_id, p0, p1, d)
        self.recr.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.attn.seq_pos_min(seq_id), self.recr.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return min(self.attn.seq_pos_max(seq_id), self.recr.seq_pos_max(seq_id))

    # -- what this variant allows ------------------------------------------------------------

    def can_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return self.attn.can_rm(seq_id, p0, p1) and self.recr.can_rm(seq_id, p0, p1)

    def can_shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        return self.attn.can_shift(seq_id, n_keep, n_discard) and self.recr.can_shift(
            seq_id, n_keep, n_discard
        )

    def num_shift_copies(self, seq_id: int, p0: int) -> int:
        return self.attn.num_shift_copies(seq_id, p0)

    def usable_prefix(self, seq_id: int, n: int) -> int:
        return max(self.prefix_lengths(seq_id, n), default=0)

    def prefix_lengths(self, seq_id: int, n: int) -> list[int]:
        """The state's lengths (RecurrentMemory.prefix_lengths) the attention part serves."""
        return [
            m
            for m in self.recr.prefix_lengths(seq_id, n)
            if self.attn.usable_prefix(seq_id, m) == m
        ]

    # -- accounting --------------------------------------------------------------------------

    def seq_num_cells(self, seq_id: int) -> int:
        return self.attn.seq_num_cells(seq_id) + self.recr.seq_num_cells(seq_id)

    def clear(self) -> None:
        self.attn.clear()
        self.recr.clear()

    def check(self) -> None:
        self.attn.check()
        self.recr.check()
        for s in range(self.n_seq_max):
            top = self.attn.seq_pos_max(s)
            assert self.recr.seq_pos_max(s) <= top, f"seq {s}: a state past its K/V"

    def _per_group(self, attn: list[T], recr: list[T]) -> list[T]:
        """Per group of spec: the attention part's entry for its group, or the recurrent one."""
        attn_groups = {g.key: i for i, g in enumerate(self.attn.spec.groups)}
        return [
            recr[0] if isinstance(g.spec, Recurrent) else attn[attn_groups[g.key]]
            for g in self.spec.groups
        ]


def _both(a: MemoryPlan | None, r: MemoryPlan | None) -> MemoryPlan | None:
    """The attention part's plan and the recurrent part's as one (None unless both fit)."""
    if a is None or r is None:
        return None
    return MemoryPlan(a.positions, a.seq_ids, a.cells + r.cells, r.captures, r.slot_step)
