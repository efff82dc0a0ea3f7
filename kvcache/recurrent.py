"""The recurrent memory (llama.cpp's llama_memory_recurrent): one state slot per sequence
instead of K/V per token, plus state checkpoints for the prefix cache.

A step's rows of sequence s start at pos(s) + 1 and leave s's state in one slot: its tail if
s alone references it, else a fresh slot that gets a copy of the shared state first
(copy-on-write: llama.cpp's find_slot copies the state of a shared tail into an empty cell),
or a zeroed one for a new sequence. Forks (seq_cp) share a slot; nothing moves.

Checkpoints (vLLM's and SGLang's answer for Mamba prefix caching; llama-server's
--ctx-checkpoints): a multi-row (prompt) step of s also copies the state after [0, m) into a
spare slot at the points kvcache/checkpoints.py chooses. A finished sequence's tail serves a
conversation's next turn. usable_prefix offers only those lengths, and seq_rm rolls a tail
back only to a checkpoint. Checkpoints use the slots no tail needs; under pressure the least
recently used are evicted, so they never make a step fail.

Speculative decoding: a sequence named in plan(..., rollback=) takes a checkpoint before each
of its rows but the first instead (before any other optional slot use: they are owed), so
that seq_rm can roll its rejected drafts back; seq_commit drops what the verification left.

NOTE: why a step never runs out of slots: tails <= n_seq_max distinct slots, a stepping
sequence that shares its tail with no idle sequence keeps it (its checkpoints move to a copy,
or are dropped), and every other slot only holds checkpoints, which may be evicted. So
n_seq_max slots always suffice for the tails; n_slots - n_seq_max is the checkpoint budget.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvcache.cell_types import PendingOps
from kvcache.checkpoints import capture_points, lasting
from kvcache.memory import Memory, MemoryPlan, Pool, SeqCells
from kvcache.slots import SlotPool, SlotStep
from kvcache.spec import MemorySpec, Recurrent

UNBOUNDED = 1 << 40  # num_free: a state does not grow with the tokens it consumed
_END = 1 << 62


class RecurrentMemory(Memory):
    def __init__(
        self,
        spec: MemorySpec,
        n_seq_max: int,
        n_ckpt: int | None = None,
        ckpt_interval: int = 256,
        n_slots: int | None = None,
    ) -> None:
        """`n_ckpt` (default n_seq_max): slots for checkpoints beside one per sequence;
        `n_slots` overrides the total (below n_seq_max a step can run out of slots)."""
        if not spec.layers or not all(isinstance(s, Recurrent) for s in spec.layers):
            raise ValueError("the recurrent memory holds recurrent layers only")
        if ckpt_interval < 1:
            raise ValueError(f"ckpt_interval must be >= 1, got {ckpt_interval}")
        n_ckpt = n_seq_max if n_ckpt is None else n_ckpt
        if n_ckpt < 0:
            raise ValueError(f"n_ckpt must be >= 0, got {n_ckpt}")
        self.spec = spec
        self.n_seq_max = n_seq_max
        self.ckpt_interval = ckpt_interval
        self.slots = SlotPool(n_seq_max + n_ckpt if n_slots is None else n_slots, n_seq_max)
        self._pools: list[Pool[SlotPool]] = [Pool("recurrent", self.slots, 0, "slots")]
        self._copies: list[tuple[int, int]] = []
        # per sequence: the (m, slot) checkpoints its last step took for a rollback
        self._rollback: dict[int, list[tuple[int, int]]] = {}

    @property
    def pools(self) -> list[Pool[SlotPool]]:
        return self._pools

    @property
    def group_pools(self) -> tuple[int, ...]:
        return tuple(0 for _ in self.spec.groups)

    # -- a step ------------------------------------------------------------------------------

    def num_free(self) -> int:
        return UNBOUNDED

    @property
    def rollback_rows(self) -> int:
        """A drafted row needs a checkpoint of the state before it. A step's tails take at most
        n_seq_max slots (the NOTE above), so n_slots - n_seq_max drafted rows always find
        slots, ahead of every other checkpoint; and no more than the free slots, so that
        drafts do not evict the prefix cache's checkpoints (as they evict no cells)."""
        sl = self.slots
        return max(0, min(sl.n_cells - self.n_seq_max, sl.n_cells - sl.used))

    def plan(
        self, positions: np.ndarray, seq_ids: np.ndarray, rollback: Collection[int] = ()
    ) -> MemoryPlan | None:
        """`rollback`: those sequences' rows also leave a checkpoint of the state before each
        row but the first (seq_rm rolls a tail back only to a checkpoint); seq_commit drops
        the ones the verification did not roll back to."""
        return self._plan(positions, seq_ids, written=False, rollback=rollback)

    def plan_written(self, positions: np.ndarray, seq_ids: np.ndarray) -> MemoryPlan | None:
        """The tails plan() gives, without the copies into them (a new sequence's zeroed
        state, a shared state copied before a write: the saved state overwrites the tail) and
        without checkpoints (no step computes the states before the last row)."""
        return self._plan(positions, seq_ids, written=True)

    def _plan(
        self,
        positions: np.ndarray,
        seq_ids: np.ndarray,
        written: bool,
        rollback: Collection[int] = (),
    ) -> MemoryPlan | None:
        positions = np.asarray(positions, dtype=np.int64)
        seq_ids = np.asarray(seq_ids, dtype=np.int64)
        runs = self._runs(positions, seq_ids)
        sl = self.slots
        step = SlotStep()
        stepping = {s for s, _, _ in runs}
        kept = {sl.tail[s] for s in range(self.n_seq_max) if s not in stepping and sl.tail[s] >= 0}
        need_new: list[int] = []
        for s, _, p_last in runs:
            x = sl.tail[s]
            step.pos[s] = p_last
            if x >= 0 and x not in kept:
                kept.add(x)  # the first stepping sequence on a slot no idle one reads keeps it
                step.tails[s] = x
            else:
                need_new.append(s)
        spare = self._spare(kept)
        if len(spare) < len(need_new):
            return None
        for s in need_new:
            dst = spare.pop(0)
            step.tails[s] = dst
            if not written:
                step.copies.append((sl.tail[s], dst))  # -1: a new sequence reads a zeroed state
        taken = {step.tails[s] for s in need_new}
        captures = []
        drafted = set(rollback)
        for s, p_first, p_last in runs:
            if s in drafted:  # before any optional slot use: these are owed, not a cache
                if len(spare) < p_last - p_first:
                    return None
                captures += [(s, m, spare.pop(0)) for m in range(p_first + 1, p_last + 1)]
                step.rollback.append(s)
        for x in sorted({step.tails[s] for s, _, _ in runs} - taken):
            if sl.ckpt_refs[x]:  # written in place: its checkpoints keep a copy, or go
                if spare and not written:  # (a copy owed now would read the written state)
                    y = spare.pop(0)
                    step.moves.append((x, y))
                    step.copies.append((x, y))
                else:
                    step.evict.append(x)
        for s, p_first, p_last in runs:
            if s in drafted:
                continue
            points = [] if written else capture_points(p_first, p_last, self.ckpt_interval)
            if points:
                step.drops += [(s, m) for m in sl.ckpts[s] if not lasting(m, self.ckpt_interval)]
            for m in points:
                if not spare:
                    break
                captures.append((s, m, spare.pop(0)))
        captures.sort()
        used = {y for _, y in step.moves} | {x for _, _, x in captures} | taken
        step.evict += [x for x in used if sl.ckpt_refs[x] and not sl.tail_refs[x]]
        lengths = [p_last - p_first + 1 for _, p_first, p_last in runs]
        cells = np.repeat(np.array([step.tails[s] for s, _, _ in runs], dtype=np.int64), lengths)
        return MemoryPlan(positions, seq_ids, (cells,), captures, step)

    def apply(self, plan: MemoryPlan) -> None:
        step = plan.slot_step
        assert step is not None, "a plan made by RecurrentMemory.plan"
        sl = self.slots
        for s, m in step.drops:
            sl.drop_ckpt(s, m)
        for x in step.evict:
            sl.evict(x)
        for x, y in step.moves:
            sl.move_ckpts(x, y)
        for s, x in step.tails.items():
            sl.set_tail(s, x, step.pos[s])
        for s, m, x in plan.captures:
            sl.add_ckpt(s, m, x)
        for s in step.tails:
            self._rollback.pop(s, None)
        for s, m, x in plan.captures:
            if s in step.rollback:
                self._rollback.setdefault(s, []).append((m, x))
        self._copies += step.copies

    def seq_rows(self, seq_id: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        sl = self.slots
        sl._check_seq(seq_id)
        slot = sl.tail[seq_id] if n > 0 and sl.pos[seq_id] == n - 1 else sl.ckpts[seq_id].get(n, -1)
        if slot < 0:
            cells = pos = np.zeros(0, dtype=np.int64)
        else:
            cells, pos = np.array([slot], dtype=np.int64), np.array([n - 1], dtype=np.int64)
        return [(cells, pos) for _ in self.spec.groups]

    def views(self, seq_id: int, q_pos: np.ndarray) -> list[SeqCells]:
        empty = np.zeros(0, dtype=np.int64)
        rows = np.zeros(np.asarray(q_pos).size, dtype=np.int64)
        return [SeqCells(empty, empty, rows, rows) for _ in self.spec.groups]

    def take_pending(self) -> list[PendingOps]:
        if not self._copies:
            return [PendingOps.empty() for _ in self.spec.groups]
        src = np.array([a for a, _ in self._copies], dtype=np.int64)
        dst = np.array([b for _, b in self._copies], dtype=np.int64)
        self._copies = []
        z = np.zeros(0, dtype=np.int64)
        ops = PendingOps(src, dst, z, z.copy())
        return [ops for _ in self.spec.groups]

    # -- sequence operations -----------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        if seq_id < 0:
            if not all(self.can_rm(s, p0, p1) for s in range(self.n_seq_max)):
                return False
            for s in range(self.n_seq_max):
                self.seq_rm(s, p0, p1)
            return True
        if not self.can_rm(seq_id, p0, p1):
            return False
        sl = self.slots
        lo, hi = _range(p0, p1)
        pos = sl.pos[seq_id]
        if pos < 0 or lo > pos or lo >= hi:
            return True
        if lo == 0:
            sl.drop_seq(seq_id)
            return True
        for m in [m for m in sl.ckpts[seq_id] if m > lo]:
            sl.drop_ckpt(seq_id, m)
        sl.set_tail(seq_id, sl.ckpts[seq_id][lo], lo - 1)  # roll back to the checkpoint
        return True

    def seq_commit(self, seq_id: int) -> None:
        """Drops the checkpoints plan(..., rollback=) took for seq_id that are still there: a
        rollback made the one it went back to the tail (which keeps its slot)."""
        sl = self.slots
        for m, x in self._rollback.pop(seq_id, []):
            if sl.ckpts[seq_id].get(m) == x:
                sl.drop_ckpt(seq_id, m)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst shares src's state after [0, p1): src's tail when p1 reaches past it, else the
        checkpoint at p1 (usable_prefix lists the lengths that have one). dst inherits src's
        checkpoints up to p1 and loses whatever it held."""
        sl = self.slots
        sl._check_seq(src)
        sl._check_seq(dst)
        lo, hi = _range(p0, p1)
        if lo > 0:
            raise ValueError(f"a recurrent state holds a whole prefix: p0 must be <= 0, got {p0}")
        if src == dst:
            return
        pos = sl.pos[src]
        if pos < 0 or hi == 0:
            sl.drop_seq(dst)
            return
        if hi > pos:
            slot, last = sl.tail[src], pos
        elif hi in sl.ckpts[src]:
            slot, last = sl.ckpts[src][hi], hi - 1
        else:
            raise ValueError(f"seq {src} has no state after {hi} positions (see usable_prefix)")
        sl.drop_seq(dst)
        sl.set_tail(dst, slot, last)
        for m, x in sorted(sl.ckpts[src].items()):
            if m <= hi:
                sl.add_ckpt(dst, m, x)

    def seq_keep(self, seq_id: int) -> None:
        self.slots._check_seq(seq_id)
        for s in range(self.n_seq_max):
            if s != seq_id:
                self.slots.drop_seq(s)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Positions move; no state changes (nothing to re-rotate)."""
        self.slots.move_positions(seq_id, *_range(p0, p1), lambda p: p + delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        if d < 1:
            raise ValueError(f"d must be >= 1, got {d}")
        self.slots.move_positions(seq_id, *_range(p0, p1), lambda p: p // d)

    def seq_pos_min(self, seq_id: int) -> int:
        """llama.cpp: a state's min and max are the last position it consumed."""
        self.slots._check_seq(seq_id)
        return self.slots.pos[seq_id]

    def seq_pos_max(self, seq_id: int) -> int:
        self.slots._check_seq(seq_id)
        return self.slots.pos[seq_id]

    # -- what this variant allows ------------------------------------------------------------

    def can_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Whole removal, a range past the state, or the tail [m, end) back to a checkpoint
        at m; a state cannot forget a head or middle range (llama.cpp refuses it too)."""
        if seq_id < 0:
            return all(self.can_rm(s, p0, p1) for s in range(self.n_seq_max))
        self.slots._check_seq(seq_id)
        lo, hi = _range(p0, p1)
        pos = self.slots.pos[seq_id]
        if pos < 0 or lo > pos or lo >= hi:
            return True
        return hi > pos and (lo == 0 or lo in self.slots.ckpts[seq_id])

    def can_shift(self, seq_id: int, n_keep: int, n_discard: int) -> bool:
        return n_discard == 0

    def num_shift_copies(self, seq_id: int, p0: int) -> int:
        return 0

    def usable_prefix(self, seq_id: int, n: int) -> int:
        return max(self.prefix_lengths(seq_id, n), default=0)

    def prefix_lengths(self, seq_id: int, n: int) -> list[int]:
        """Every m in (0, n] at which seq_id has a state, descending."""
        self.slots._check_seq(seq_id)
        sl = self.slots
        ms = set(sl.ckpts[seq_id])
        if sl.pos[seq_id] >= 0:
            ms.add(sl.pos[seq_id] + 1)
        return sorted((m for m in ms if 0 < m <= n), reverse=True)

    # -- accounting --------------------------------------------------------------------------

    def seq_num_cells(self, seq_id: int) -> int:
        return self.slots.seq_num_cells(seq_id)

    def clear(self) -> None:
        super().clear()
        self._copies = []
        self._rollback = {}

    # -- internals ---------------------------------------------------------------------------

    def _runs(self, positions: np.ndarray, seq_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """(seq, first position, last position) per sequence, checking the rows' contract."""
        if seq_ids.size == 0:
            return []
        same = seq_ids[1:] == seq_ids[:-1]
        starts = np.flatnonzero(np.concatenate(([True], ~same)))
        ends = np.append(starts[1:], seq_ids.size) - 1
        seqs = seq_ids[starts]
        if np.unique(seqs).size != seqs.size or (np.diff(positions)[same] != 1).any():
            raise ValueError("each sequence's rows must be contiguous with consecutive positions")
        firsts, lasts = positions[starts].tolist(), positions[ends].tolist()
        runs = list(zip(seqs.tolist(), firsts, lasts, strict=True))
        for s, first, _ in runs:
            self.slots._check_seq(s)
            if first != self.slots.pos[s] + 1:
                raise ValueError(
                    f"seq {s}: rows start at {first}, its state is after {self.slots.pos[s]}"
                )
        return runs

    def _spare(self, kept: set[int]) -> list[int]:
        """Slots a step may (over)write: free ones first, then checkpoint-only ones, least
        recently used first."""
        sl = self.slots
        free = [x for x in range(sl.n_cells) if sl.is_free(x)]
        ckpt = [x for x in range(sl.n_cells) if not sl.tail_refs[x] and sl.ckpt_refs[x]]
        ckpt = [x for x in ckpt if x not in kept]
        return free + sorted(ckpt, key=lambda x: sl.last_used[x])


def _range(p0: int, p1: int) -> tuple[int, int]:
    if p0 >= 0 and p1 >= 0 and p0 > p1:
        raise ValueError(f"empty range [{p0}, {p1}) with p0 > p1")
    return max(p0, 0), (p1 if p1 >= 0 else _END)
