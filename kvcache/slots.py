"""SlotPool: refcounted state slots of a recurrent memory (metadata only, no tensors).

A slot holds one whole recurrent state (every recurrent layer's conv + SSM state). A sequence
references slots in two roles: its `tail`, the state after the last position it consumed
(llama.cpp's llama_memory_recurrent `cells[seq_id].tail`), and its checkpoints `ckpts[m]`,
the state after consuming positions [0, m), kept for the prefix cache. Several sequences may
reference one slot (a fork shares the tail until its first write; a prefix hit shares a
checkpoint). A slot is free when nothing references it. The policy (which slot a step writes,
copy-on-write, which checkpoints to take or evict) is kvcache/recurrent.py's; this class keeps
the references consistent and answers what generic code reads of a pool (PoolCells).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvcache.cell_types import CellStats, longest_run

FREE = -1  # owner_map value of a free slot (kvcache.cells.FREE)
SHARED = -2  # owner_map value of a slot two or more sequences reference (kvcache.cells.SHARED)


@dataclass(slots=True)
class SlotStep:
    """What RecurrentMemory.apply commits for one planned step, in this order:
    0. `drops`: (seq, m) checkpoints a newer one of the step supersedes;
    1. `evict`: slots whose checkpoint references are all dropped;
    2. `moves`: (x, y): every checkpoint reference to x now points to y (y got x's state);
    3. `tails`: {seq: slot} the state each stepping sequence leaves, at `pos[seq]`;
    4. captures (MemoryPlan.captures) become checkpoints;
    5. `copies`: (src, dst) whole-state copies for the storage, src -1 = zero dst."""

    drops: list[tuple[int, int]] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)
    moves: list[tuple[int, int]] = field(default_factory=list)
    tails: dict[int, int] = field(default_factory=dict)
    pos: dict[int, int] = field(default_factory=dict)
    copies: list[tuple[int, int]] = field(default_factory=list)
    rollback: list[int] = field(default_factory=list)  # seqs whose captures are rollback points


class SlotPool:
    # NOTE: invariants (check() asserts them):
    #   tail_refs[x] == {s : tail[s] == x}; ckpt_refs[x] == {(s, m) : ckpts[s][m] == x};
    #   a slot is used <=> it has a reference; tail[s] == -1 <=> pos[s] == -1 <=> no ckpts[s];
    #   every checkpoint m of s has 1 <= m <= pos[s] + 1.

    def __init__(self, n_slots: int, n_seq_max: int) -> None:
        if n_slots < 1 or n_seq_max < 1:
            raise ValueError(f"need n_slots >= 1 and n_seq_max >= 1, got {n_slots}, {n_seq_max}")
        self.n_cells = n_slots  # PoolCells' name: a slot is this pool's cell
        self.n_seq_max = n_seq_max
        self.head = 0  # slots have no write pointer
        self.tail = [-1] * n_seq_max
        self.pos = [-1] * n_seq_max
        self.ckpts: list[dict[int, int]] = [{} for _ in range(n_seq_max)]
        self.tail_refs: list[set[int]] = [set() for _ in range(n_slots)]
        self.ckpt_refs: list[set[tuple[int, int]]] = [set() for _ in range(n_slots)]
        self.last_used = [0] * n_slots  # LRU clock of checkpoint slots
        self.clock = 0

    # -- references --------------------------------------------------------------------------

    def is_free(self, slot: int) -> bool:
        return not self.tail_refs[slot] and not self.ckpt_refs[slot]

    def num_refs(self, slot: int) -> int:
        return len(self.tail_refs[slot]) + len(self.ckpt_refs[slot])

    def set_tail(self, seq_id: int, slot: int, pos: int) -> None:
        """seq_id's state after position `pos` is in `slot` (-1, -1: it has none)."""
        old = self.tail[seq_id]
        if old >= 0:
            self.tail_refs[old].discard(seq_id)
        self.tail[seq_id] = slot
        self.pos[seq_id] = pos if slot >= 0 else -1
        if slot >= 0:
            self.tail_refs[slot].add(seq_id)

    def add_ckpt(self, seq_id: int, m: int, slot: int) -> None:
        """seq_id's state after [0, m) is (also) in `slot`; replaces any checkpoint at m."""
        self.drop_ckpt(seq_id, m)
        self.ckpts[seq_id][m] = slot
        self.ckpt_refs[slot].add((seq_id, m))
        self.touch(slot)

    def drop_ckpt(self, seq_id: int, m: int) -> None:
        slot = self.ckpts[seq_id].pop(m, -1)
        if slot >= 0:
            self.ckpt_refs[slot].discard((seq_id, m))

    def evict(self, slot: int) -> None:
        """Every checkpoint in `slot` is forgotten."""
        for s, m in list(self.ckpt_refs[slot]):
            self.drop_ckpt(s, m)

    def move_ckpts(self, src: int, dst: int) -> None:
        """Every checkpoint reference to `src` now points to `dst` (which holds a copy)."""
        for s, m in list(self.ckpt_refs[src]):
            self.drop_ckpt(s, m)
            self.add_ckpt(s, m, dst)

    def drop_seq(self, seq_id: int) -> None:
        """seq_id references nothing any more."""
        for m in list(self.ckpts[seq_id]):
            self.drop_ckpt(seq_id, m)
        self.set_tail(seq_id, -1, -1)

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.last_used[slot] = self.clock

    # -- PoolCells ---------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return sum(1 for x in range(self.n_cells) if not self.is_free(x))

    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots, last position each holds) that seq_id references, by position."""
        self._check_seq(seq_id)
        held = {slot: m - 1 for m, slot in self.ckpts[seq_id].items()}
        if self.tail[seq_id] >= 0:
            held[self.tail[seq_id]] = self.pos[seq_id]
        order = sorted(held, key=lambda x: (held[x], x))
        return (
            np.asarray(order, dtype=np.int64),
            np.asarray([held[x] for x in order], dtype=np.int64),
        )

    def seq_num_cells(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return len(set(self.ckpts[seq_id].values()) | {self.tail[seq_id]} - {-1})

    def owners(self, slot: int) -> set[int]:
        return self.tail_refs[slot] | {s for s, _ in self.ckpt_refs[slot]}

    def owner_map(self) -> np.ndarray:
        """Per slot: FREE, SHARED (2+ sequences), else the one sequence referencing it."""
        out = np.full(self.n_cells, FREE, dtype=np.int32)
        for x in range(self.n_cells):
            owners = self.owners(x)
            if owners:
                out[x] = next(iter(owners)) if len(owners) == 1 else SHARED
        return out

    def stats(self) -> CellStats:
        free = np.array([self.is_free(x) for x in range(self.n_cells)])
        num_free = int(free.sum())
        return CellStats(
            n_cells=self.n_cells,
            used=self.n_cells - num_free,
            shared=sum(1 for x in range(self.n_cells) if len(self.owners(x)) > 1),
            pending_shift=0,
            num_seqs=sum(1 for s in range(self.n_seq_max) if self.tail[s] >= 0),
            fragmentation=1.0 - longest_run(free) / num_free if num_free else 0.0,
        )

    def move_positions(self, seq_id: int, lo: int, hi: int, move: Callable[[int], int]) -> None:
        """Positions p in [lo, hi) of seq_id's tail and checkpoints (a checkpoint at m holds
        position m - 1) become move(p); those going negative or past the tail are dropped
        (seq_add / seq_div of the recurrent memory: references move, no state changes)."""
        self._check_seq(seq_id)
        pos = self.pos[seq_id]
        if pos < 0:
            return
        new_pos = move(pos) if lo <= pos < hi else pos
        moved = {
            m: move(m - 1) + 1
            for m in self.ckpts[seq_id]
            if lo <= m - 1 < hi and move(m - 1) != m - 1
        }
        if new_pos < 0:
            self.drop_seq(seq_id)
            return
        slots = {m: self.ckpts[seq_id][m] for m in moved}
        for m in moved:
            self.drop_ckpt(seq_id, m)
        self.set_tail(seq_id, self.tail[seq_id], new_pos)
        for m, new_m in sorted(moved.items()):
            if 0 < new_m <= new_pos + 1:
                self.add_ckpt(seq_id, new_m, slots[m])
        for m in [m for m in self.ckpts[seq_id] if m > new_pos + 1]:
            self.drop_ckpt(seq_id, m)

    def num_ckpt_slots(self) -> int:
        """Slots that hold only checkpoints (no sequence's tail)."""
        return sum(1 for x in range(self.n_cells) if self.ckpt_refs[x] and not self.tail_refs[x])

    def clear(self) -> None:
        for s in range(self.n_seq_max):
            self.drop_seq(s)

    def check(self) -> None:
        tail_refs: list[set[int]] = [set() for _ in range(self.n_cells)]
        ckpt_refs: list[set[tuple[int, int]]] = [set() for _ in range(self.n_cells)]
        for s in range(self.n_seq_max):
            t, p = self.tail[s], self.pos[s]
            assert (t == -1) == (p == -1), f"seq {s}: tail {t} with pos {p}"
            assert t >= 0 or not self.ckpts[s], f"seq {s}: checkpoints without a tail"
            if t >= 0:
                tail_refs[t].add(s)
            for m, x in self.ckpts[s].items():
                assert 1 <= m <= p + 1, f"seq {s}: checkpoint {m} past pos {p}"
                ckpt_refs[x].add((s, m))
        assert tail_refs == self.tail_refs, "tail_refs"
        assert ckpt_refs == self.ckpt_refs, "ckpt_refs"

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq id {seq_id} out of range [0, {self.n_seq_max})")
