"""The memory interface the scheduler programs against (llama.cpp's llama_memory_i).

A Memory is built from the model's MemorySpec (kvcache/spec.py) and keeps the metadata of one
or more pools of cells; the worker's storage is built from the same spec. The scheduler only
asks it questions (does this step fit, how many tokens are free, can this sequence shift) and
programs it with llama.cpp's sequence operations; it never counts cells itself. Two variants
exist for attention: the unified cache (kvcache/unified.py) and iSWA (kvcache/iswa.py); the
recurrent memory (kvcache/recurrent.py) keeps one state slot per sequence instead, and the
hybrid memory (kvcache/hybrid.py) composes one of each. Ranges are half-open [p0, p1); p0 < 0
means 0, p1 < 0 means infinity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from kvcache.cell_types import CellStats, PendingOps, PoolCells
from kvcache.slots import SlotStep
from kvcache.spec import MemorySpec

C = TypeVar("C", bound=PoolCells, covariant=True)

ANY_ROWS = 1 << 40  # rollback_rows of a memory that can forget any rows it placed


@dataclass(slots=True)
class Pool(Generic[C]):
    """One pool of cells (KVCells) or state slots (SlotPool): `name` labels it in /metrics
    and on the cell map."""

    name: str  # "full" | "swa" | "swa<W>" | "recurrent"
    cells: C
    window: int  # 0: full attention; W: cells leave a sequence's window W positions behind
    kind: str = "cells"  # "cells": K/V per token; "slots": one recurrent state per slot


@dataclass(slots=True)
class MemoryPlan:
    """Where each row of a step goes, made by Memory.plan against the state it saw.

    NOTE: valid only until the next mutation of the memory: apply it at once or drop it."""

    positions: np.ndarray  # [n_tokens] int64
    seq_ids: np.ndarray  # [n_tokens] int64
    cells: tuple[np.ndarray, ...]  # per pool: [n_tokens] int64, each row's cell (or state slot)
    # state checkpoints taken during the step: (seq_id, m, slot), sorted (kvcache/recurrent.py)
    captures: list[tuple[int, int, int]] = field(default_factory=list)
    slot_step: SlotStep | None = None  # what apply commits in a slot pool


@dataclass(slots=True)
class SeqCells:
    """What one sequence's rows of a step may read in one layer group: the cells it owns in
    that group's pool, sorted by position, and per row the visible run kv[lo[i]:hi[i]]
    (kvcache.spec.Attention.visible: causal, and kv_pos > q_pos - window for a window)."""

    kv_cells: np.ndarray  # [n_kv] int64
    kv_pos: np.ndarray  # [n_kv] int64, strictly increasing
    lo: np.ndarray  # [n_rows] int64
    hi: np.ndarray  # [n_rows] int64


def seq_cells_view(
    kv_cells: np.ndarray, kv_pos: np.ndarray, q_pos: np.ndarray, window: int
) -> SeqCells:
    """SeqCells of rows at `q_pos` over cells sorted by position."""
    q_pos = np.asarray(q_pos, dtype=np.int64)
    hi = np.searchsorted(kv_pos, q_pos, side="right").astype(np.int64)
    if window > 0:
        lo = np.searchsorted(kv_pos, q_pos - window, side="right").astype(np.int64)
    else:
        lo = np.zeros_like(hi)
    return SeqCells(kv_cells, kv_pos, lo, hi)


@dataclass(slots=True)
class PoolStats:
    name: str
    stats: CellStats


class Memory(ABC):
    """What the scheduler programs against. Every method either answers (never mutates) or
    mutates (named after llama.cpp's seq_* operations, plus apply and clear)."""

    spec: MemorySpec
    n_seq_max: int

    # -- layout ----------------------------------------------------------------------------

    @property
    @abstractmethod
    def pools(self) -> Sequence[Pool[PoolCells]]:
        """Every pool of cells (the full-attention one first), then any pool of state slots."""

    @property
    @abstractmethod
    def group_pools(self) -> tuple[int, ...]:
        """Per layer group of `spec.groups`: the index of the pool its layers read and write."""

    @property
    def tail_rollback(self) -> bool:
        """Whether seq_rm(seq, p, -1) of rows the last apply placed leaves everything the
        sequence's next row needs (speculative decoding's rollback of rejected drafts). False
        where a step's apply already consumed them for good: a recurrent state."""
        return False

    @property
    def rollback_rows(self) -> int:
        """How many rows (beyond each sequence's first) the next step may place for the
        sequences named in plan(..., rollback=) such that seq_rm(seq, p, -1) can take any
        tail of them back after it: speculative decoding's drafted rows. ANY_ROWS where every
        tail can go (tail_rollback); a recurrent state keeps one checkpoint per such row. Its
        value for an empty memory is the most it ever is (0: never). Never mutates."""
        return ANY_ROWS if self.tail_rollback else 0

    # -- a step: plan, then apply --------------------------------------------------------------

    @abstractmethod
    def num_free(self) -> int:
        """How many new tokens (of any sequences) the next apply can place beside everything
        the memory holds, counting what apply would free first. Never mutates."""

    @abstractmethod
    def plan(
        self, positions: np.ndarray, seq_ids: np.ndarray, rollback: Collection[int] = ()
    ) -> MemoryPlan | None:
        """Cells for one step's rows (row i: seq_ids[i] at positions[i], each sequence's rows
        contiguous and ascending, right after what it holds); None when they do not fit.
        `rollback`: sequences whose rows after their first may be taken back with seq_rm once
        the step ran (rollback_rows of them in all); seq_commit ends that. Never mutates."""

    @abstractmethod
    def apply(self, plan: MemoryPlan) -> None:
        """Commit a plan made against the current state: the rows own their cells."""

    def plan_written(self, positions: np.ndarray, seq_ids: np.ndarray) -> MemoryPlan | None:
        """plan() for rows whose K/V or state will be written from a saved copy (a restored
        slot file or cache-tier entry) instead of computed: nothing is owed to the storage for
        them (a recurrent memory neither zeroes the new state nor takes checkpoints whose
        content no step computes). Never mutates."""
        return self.plan(positions, seq_ids)

    @abstractmethod
    def views(self, seq_id: int, q_pos: np.ndarray) -> list[SeqCells]:
        """Per layer group: what rows of seq_id at q_pos may read, after apply. Never mutates."""

    def seq_rows(self, seq_id: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer group: where seq_id keeps what a sequence that goes on at position n needs
        of its [0, n), as (cells, their positions ascending): what a slot file saves. A
        sliding-window group the rows its window sees from position n - 1 (it may own older
        cells until its next step: seq_trim); a recurrent group one state slot, the state
        after the n positions, at position n - 1 (nothing where seq_id has no state there: see
        usable_prefix). Never mutates."""
        out = []
        for view in self.views(seq_id, np.array([n - 1], dtype=np.int64)):
            lo, hi = int(view.lo[0]), int(view.hi[0])
            out.append((view.kv_cells[lo:hi], view.kv_pos[lo:hi]))
        return out

    @abstractmethod
    def take_pending(self) -> list[PendingOps]:
        """Per layer group: storage work (copies, then K-shifts) owed to its tensors since the
        last call, which resets it. Groups that share a pool get the same work."""

    # -- sequence operations (llama_memory_i::seq_*) ---------------------------------------------

    @abstractmethod
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Forget seq_id's tokens in [p0, p1) (-1: every sequence). False, changing nothing,
        when this memory cannot remove that range (can_rm)."""

    def seq_commit(self, seq_id: int) -> None:
        """seq_id's rows placed with plan(..., rollback=) are settled (its rejected drafts
        removed): whatever the memory kept only to take them back goes."""
        return None

    @abstractmethod
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst shares src's tokens in [p0, p1): no data is copied."""

    @abstractmethod
    def seq_keep(self, seq_id: int) -> None:
        """Forget every token seq_id does not own; seq_id becomes their only owner."""

    @abstractmethod
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move seq_id's tokens in [p0, p1) by delta (deferred K-shift, copy-on-write of
        shared cells); tokens going negative are forgotten. Needs num_shift_copies free cells."""

    @abstractmethod
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide seq_id's positions in [p0, p1) by d (floor); deferred K-shift, copy-on-write."""

    @abstractmethod
    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position seq_id holds, -1 if none."""

    @abstractmethod
    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position seq_id holds, -1 if none."""

    # -- what this variant allows ----------------------------------------------------------------

    @abstractmethod
    def can_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Whether seq_rm(seq_id, p0, p1) would succeed."""

    @abstractmethod
    def can_shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        """Whether a context shift of seq_id (seq_rm [n_keep, n_keep + n_discard), then seq_add
        of the rest by -n_discard) leaves every cell the next row needs. When False the
        caller recomputes the shifted context instead."""

    @abstractmethod
    def num_shift_copies(self, seq_id: int, p0: int) -> int:
        """Free cells (in num_free's units) a seq_add of seq_id's [p0, inf) needs for its
        copies-on-write."""

    @abstractmethod
    def usable_prefix(self, seq_id: int, n: int) -> int:
        """The longest m <= n such that a sequence given seq_id's [0, m) by seq_cp can go on
        at position m with every cell its rows need; 0 if none."""

    def seq_trim(self, seq_id: int) -> None:
        """seq_id keeps no cell but seq_rows(seq_id, seq_pos_max + 1)'s: after rows written
        from a saved copy (which holds only those), so that no cell the copy did not write
        stays owned, where a shorter prefix (usable_prefix) could read it. Every cell a
        sequence owns is needed, except a sliding window's older ones (their pool drops them
        at the next step)."""
        return None

    def prefix_lengths(self, seq_id: int, n: int) -> list[int]:
        """The lengths m <= n at which a copy of seq_id's [0, m) serves new sequences,
        descending, one per distinct prefix: usable_prefix alone where it serves every
        shorter prompt as well (cells); on a recurrent state, each length it kept a state
        for (a checkpoint or its tail). What the cache tier saves of a finished sequence."""
        m = self.usable_prefix(seq_id, n)
        return [m] if m > 0 else []

    @property
    def keeps_prefixes(self) -> bool:
        """Whether usable_prefix(seq, m) stays m while seq computes past m (the unified cache);
        a sliding-window pool prunes behind the window, a recurrent state moves on."""
        return False

    # -- cells the memory holds itself (kvcache/held_cells.py: the prefix index) ----------------

    @property
    def holds_cells(self) -> bool:
        """Whether this memory can hold a prefix's cells without a seq id (the unified cache, and
        iSWA with room for the windows of what it holds); a recurrent state serves only its
        checkpoints and keeps prefixes under seq ids."""
        return False

    @property
    def index_windows(self) -> tuple[int, ...]:
        """Per sliding-window pool (pools 1..): its window W. A held prefix of length e serves a
        sequence of length m only with the cells of positions [m - W + 1, m) held in each."""
        return ()

    @property
    def index_budget(self) -> tuple[int, ...]:
        """Per sliding-window pool: the cells the prefix index may hold there (beyond what the
        running sequences can need, so that a step never lacks a window cell)."""
        return ()

    def seq_prefix_cells(self, seq_id: int, n: int) -> np.ndarray:
        """The cells of seq_id's [0, n), in position order, as cells_hold takes them."""
        raise NotImplementedError(f"{type(self).__name__} holds no cells itself")

    def seq_window_cells(self, seq_id: int, n: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per sliding-window pool: (cells, positions) of seq_id's contiguous run of positions
        ending at n - 1 there; None when a pool lacks position n - 1."""
        return []

    def cells_hold(self, cells: np.ndarray, pool: int = 0) -> None:
        """The memory holds `cells` of `pool` (counted as one owner) until cells_release."""
        raise NotImplementedError(f"{type(self).__name__} holds no cells itself")

    def cells_release(self, cells: np.ndarray, pool: int = 0) -> None:
        """Drop the hold on `cells` of `pool`; those no sequence owns are free."""
        raise NotImplementedError(f"{type(self).__name__} holds no cells itself")

    def cells_cp(self, cells: np.ndarray, dst: int, pool: int = 0) -> None:
        """dst shares the held `cells` of `pool` (seq_cp by cell): no data is copied."""
        raise NotImplementedError(f"{type(self).__name__} holds no cells itself")

    # -- accounting ------------------------------------------------------------------------------

    @abstractmethod
    def seq_num_cells(self, seq_id: int) -> int:
        """Cells seq_id owns over every pool."""

    @property
    def num_used(self) -> int:
        """Cells in use over every pool."""
        return sum(p.cells.used for p in self.pools)

    def stats(self) -> list[PoolStats]:
        """Per pool, labelled: for /metrics and the cell map."""
        return [PoolStats(p.name, p.cells.stats()) for p in self.pools]

    def clear(self) -> None:
        """Forget everything, pending work included."""
        for p in self.pools:
            p.cells.clear()

    def check(self) -> None:
        """Assert every pool's invariants (AssertionError); variants add their own."""
        for p in self.pools:
            p.cells.check()
