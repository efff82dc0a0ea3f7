"""KVCells against an obviously-correct reference model, driven by hypothesis.

The reference knows nothing of cell indices: it keeps logical entries (pos, owners,
payload id, original pos). A fake storage keyed by cell (payload, original pos, applied
rotation) is updated only through take_pending's ops and the ubatch writes, in the
worker's order, so wrong copy or K-shift bookkeeping shows up as a wrong payload or
rotation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache.cells import KVCells

N_SEQ = 4
seq_ids = st.integers(0, N_SEQ - 1)
bounds = st.one_of(st.just(-1), st.integers(0, 32))
deltas = st.one_of(st.integers(-12, -1), st.integers(1, 12))


@dataclass(slots=True)
class Entry:
    pos: int
    owners: set[int]
    payload: int
    orig: int


@dataclass(slots=True)
class Reference:
    n_cells: int
    entries: list[Entry] = field(default_factory=list)

    def seq_positions(self, s: int) -> list[int]:
        return sorted(e.pos for e in self.entries if s in e.owners)

    def seq_items(self, s: int) -> list[tuple[int, int]]:
        return sorted((e.pos, e.payload) for e in self.entries if s in e.owners)

    def drop_empty(self) -> None:
        self.entries = [e for e in self.entries if e.owners]

    def shift(self, s: int, lo: int, hi: int, new_pos: dict[int, int]) -> bool:
        """Move seq s's entries to new_pos[id(entry)]; False (nothing changed) if no room."""
        mine = [e for e in self.entries if s in e.owners and lo <= e.pos < hi]
        moving = [e for e in mine if new_pos[id(e)] >= 0 and new_pos[id(e)] != e.pos]
        n_copies = sum(1 for e in moving if len(e.owners) > 1)
        if n_copies > self.n_cells - len(self.entries):
            return False
        for e in mine:
            p = new_pos[id(e)]
            if p < 0:
                e.owners.discard(s)
            elif p != e.pos and len(e.owners) > 1:
                e.owners.discard(s)
                self.entries.append(Entry(p, {s}, e.payload, e.orig))
            else:
                e.pos = p
        self.drop_empty()
        return True


def in_range(p0: int, p1: int) -> tuple[int, int]:
    return max(p0, 0), (p1 if p1 >= 0 else 1 << 62)


def snapshot(kv: KVCells) -> tuple[object, ...]:
    return (
        kv.pos.copy().tolist(),
        kv.shift.copy().tolist(),
        kv.owners.copy().tolist(),
        kv.head,
        kv.used,
        [(src.tolist(), dst.tolist()) for src, dst in kv.copies],
    )


class CellsMachine(RuleBasedStateMachine):
    @initialize(
        n_cells=st.integers(8, 32),
        prefix=st.integers(0, 6),
        sharers=st.sets(st.integers(1, N_SEQ - 1), min_size=1),
    )
    def setup(self, n_cells: int, prefix: int, sharers: set[int]) -> None:
        """Start from a prompt of seq 0 whose prefix `sharers` share (the common case)."""
        self.kv = KVCells(n_cells, N_SEQ)
        self.ref = Reference(n_cells)
        self.payload = np.full(n_cells, -1, dtype=np.int64)
        self.orig = np.zeros(n_cells, dtype=np.int64)
        self.rot = np.zeros(n_cells, dtype=np.int64)
        self.next_payload = 0
        self.storage_synced = True
        if prefix:
            self.ubatch(prefix, positions=list(range(prefix)), seqs=[0] * prefix)
            for s in sharers:
                self.seq_cp(0, s, -1, -1)

    def take_and_apply(self) -> None:
        ops = self.kv.take_pending()
        for src, dst in zip(ops.copy_src.tolist(), ops.copy_dst.tolist(), strict=True):
            self.payload[dst] = self.payload[src]
            self.orig[dst] = self.orig[src]
            self.rot[dst] = self.rot[src]
        self.rot[ops.shift_cells] += ops.shift_deltas
        self.storage_synced = True

    @rule(
        n=st.integers(1, 10),
        positions=st.lists(st.integers(0, 30), min_size=10, max_size=10),
        seqs=st.lists(seq_ids, min_size=10, max_size=10),
    )
    def ubatch(self, n: int, positions: list[int], seqs: list[int]) -> None:
        before = snapshot(self.kv)
        cells = self.kv.find_slot(n)
        assert snapshot(self.kv) == before, "find_slot mutated the cells"
        if cells is None:
            assert n > self.ref.n_cells - len(self.ref.entries)
            return
        assert len(set(cells.tolist())) == n and (self.kv.pos[cells] == -1).all()
        positions, seqs = positions[:n], seqs[:n]
        self.kv.apply_ubatch(cells, np.array(positions), np.array(seqs))
        self.take_and_apply()  # the worker: pending ops first, then the forward's writes
        for c, p, s in zip(cells.tolist(), positions, seqs, strict=True):
            self.payload[c], self.orig[c], self.rot[c] = self.next_payload, p, 0
            self.ref.entries.append(Entry(p, {s}, self.next_payload, p))
            self.next_payload += 1

    @rule(s=st.integers(-1, N_SEQ - 1), p0=bounds, p1=bounds)
    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        if p0 >= 0 and p1 >= 0 and p0 > p1:
            before = snapshot(self.kv)
            with pytest.raises(ValueError):
                self.kv.seq_rm(s, p0, p1)
            assert snapshot(self.kv) == before
            return
        self.kv.seq_rm(s, p0, p1)
        lo, hi = in_range(p0, p1)
        for e in self.ref.entries:
            if lo <= e.pos < hi:
                if s < 0:
                    e.owners.clear()
                else:
                    e.owners.discard(s)
        self.ref.drop_empty()

    @rule(src=seq_ids, dst=seq_ids, p0=bounds, p1=bounds)
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if p0 >= 0 and p1 >= 0 and p0 > p1:
            return
        self.kv.seq_cp(src, dst, p0, p1)
        lo, hi = in_range(p0, p1)
        for e in self.ref.entries:
            if src in e.owners and lo <= e.pos < hi:
                e.owners.add(dst)

    @rule(s=seq_ids)
    def seq_keep(self, s: int) -> None:
        self.kv.seq_keep(s)
        for e in self.ref.entries:
            e.owners &= {s}
        self.ref.drop_empty()

    @rule(s=seq_ids, p0=bounds, p1=bounds, delta=deltas)
    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        if p0 >= 0 and p1 >= 0 and p0 > p1:
            return
        lo, hi = in_range(p0, p1)
        self.shift_both(
            s,
            lo,
            hi,
            {id(e): e.pos + delta for e in self.ref.entries},
            lambda: self.kv.seq_add(s, p0, p1, delta),
        )

    @rule(s=seq_ids, p0=bounds, p1=bounds, d=st.integers(1, 4))
    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        if p0 >= 0 and p1 >= 0 and p0 > p1:
            return
        lo, hi = in_range(p0, p1)
        self.shift_both(
            s,
            lo,
            hi,
            {id(e): e.pos // d for e in self.ref.entries},
            lambda: self.kv.seq_div(s, p0, p1, d),
        )

    def shift_both(self, s: int, lo: int, hi: int, new_pos: dict[int, int], call) -> None:  # type: ignore[no-untyped-def]
        before = snapshot(self.kv)
        if self.ref.shift(s, lo, hi, new_pos):
            call()
            if len(self.kv.copies) > len(before[5]):  # type: ignore[arg-type]
                event("copy-on-write")
            self.storage_synced = False
        else:
            with pytest.raises(ValueError, match="copy-on-write"):
                call()
            assert snapshot(self.kv) == before

    @rule(src=seq_ids, dst=seq_ids)
    def fork(self, src: int, dst: int) -> None:
        """Whole-sequence seq_cp (n > 1 choices, prefix reuse): makes sharing common."""
        self.seq_cp(src, dst, -1, -1)

    @rule(s=seq_ids, delta=deltas)
    def context_shift(self, s: int, delta: int) -> None:
        """Whole-sequence seq_add: with fork, makes copies of already-shifted cells common."""
        self.seq_add(s, -1, -1, delta)

    @rule()
    def take_pending(self) -> None:
        self.take_and_apply()

    @rule()
    def clear(self) -> None:
        self.kv.clear()
        self.ref.entries.clear()
        self.storage_synced = True

    @invariant()
    def matches_reference(self) -> None:
        kv, ref = self.kv, self.ref
        kv.check()
        assert kv.used == len(ref.entries)
        stats = kv.stats()
        assert stats.used == kv.used
        assert stats.shared == sum(1 for e in ref.entries if len(e.owners) > 1)
        assert stats.num_seqs == sum(1 for s in range(N_SEQ) if ref.seq_positions(s))
        owner_map = kv.owner_map().tolist()
        assert owner_map.count(-1) == kv.n_cells - len(ref.entries)
        for s in range(N_SEQ):
            assert owner_map.count(s) == sum(1 for e in ref.entries if e.owners == {s})
        for s in range(N_SEQ):
            want = ref.seq_positions(s)
            cells, positions = kv.seq_cells(s)
            assert positions.tolist() == want
            assert kv.seq_num_cells(s) == len(want)
            assert kv.seq_pos_min(s) == (want[0] if want else -1)
            assert kv.seq_pos_max(s) == (want[-1] if want else -1)

    @invariant()
    def storage_matches_after_pending(self) -> None:
        if not self.storage_synced:
            return
        kv = self.kv
        assert kv.take_pending().is_empty
        live = np.flatnonzero(kv.pos != -1)
        assert (self.rot[live] == kv.pos[live] - self.orig[live]).all(), "K rotation"
        for s in range(N_SEQ):
            cells, positions = kv.seq_cells(s)
            got = sorted(zip(positions.tolist(), self.payload[cells].tolist(), strict=True))
            assert got == self.ref.seq_items(s)


CellsMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestCellsMachine = CellsMachine.TestCase
