"""ISWAMemory against an obviously-correct reference, driven by hypothesis.

The reference keeps, per pool, logical entries (pos, owners, payload) and knows nothing of
cells. Its SWA rule is the definition: before a step's rows are placed (and before a shift),
every sequence s leaves its entries at positions <= max_s - W; an entry with no owner left is
gone. A fake storage per pool (payload and applied rotation per cell) changes only through
the pending ops and the step's writes, as the worker's would. So a cell freed too early (a
payload missing), too late (used count), a lost copy or K-shift, and a wrong can_shift or
usable_prefix answer all show up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.iswa import ISWAMemory
from kvcache.spec import Attention, MemorySpec

N_SEQ = 4
N_BATCH = 6
seq_ids = st.integers(0, N_SEQ - 1)


@dataclass(slots=True)
class Entry:
    pos: int
    owners: set[int]
    payload: int


@dataclass(slots=True)
class RefPool:
    window: int  # 0: full
    entries: list[Entry] = field(default_factory=list)

    def items(self, s: int) -> list[tuple[int, int]]:
        return sorted((e.pos, e.payload) for e in self.entries if s in e.owners)

    def positions(self, s: int) -> list[int]:
        return [p for p, _ in self.items(s)]

    def prune(self, max_pos: dict[int, int]) -> None:
        if self.window:
            for e in self.entries:
                e.owners = {s for s in e.owners if e.pos > max_pos[s] - self.window}
        self.entries = [e for e in self.entries if e.owners]

    def rm(self, s: int, lo: int, hi: int) -> None:
        for e in self.entries:
            if lo <= e.pos < hi:
                e.owners.discard(s)
        self.entries = [e for e in self.entries if e.owners]

    def shift(self, s: int, lo: int, delta: int) -> None:
        for e in [e for e in self.entries if s in e.owners and e.pos >= lo]:
            if e.pos + delta < 0:
                e.owners.discard(s)
            elif len(e.owners) > 1:  # copy-on-write
                e.owners.discard(s)
                self.entries.append(Entry(e.pos + delta, {s}, e.payload))
            else:
                e.pos += delta
        self.entries = [e for e in self.entries if e.owners]


class ISWAMachine(RuleBasedStateMachine):
    @initialize(n_cells=st.integers(12, 40), window=st.integers(1, 6))
    def setup(self, n_cells: int, window: int) -> None:
        spec = MemorySpec.of([Attention(1, 4), Attention(1, 4, window)])
        self.mem = ISWAMemory(spec, n_cells, N_SEQ, N_BATCH)
        self.window = window
        self.ref = [RefPool(0), RefPool(window)]
        self.payload = [np.full(p.cells.n_cells, -1, np.int64) for p in self.mem.pools]
        self.rot = [np.full(p.cells.n_cells, -1, np.int64) for p in self.mem.pools]
        self.next_payload = 0

    def max_pos(self) -> dict[int, int]:
        return {s: max(self.ref[0].positions(s), default=-1) for s in range(N_SEQ)}

    def flush(self) -> None:
        """The worker applies the pending ops (each pool's once)."""
        for i, ops in enumerate(self.mem.take_pending()[:2]):  # group i reads pool i here
            pay, rot = self.payload[i], self.rot[i]
            for src, dst in zip(ops.copy_src.tolist(), ops.copy_dst.tolist(), strict=True):
                pay[dst], rot[dst] = pay[src], rot[src]
            rot[ops.shift_cells] += ops.shift_deltas

    def snapshot(self) -> list[object]:
        return [
            (c.pos.tolist(), c.owners.tolist(), c.head, c.used)
            for c in (p.cells for p in self.mem.pools)
        ]

    @rule(
        seqs=st.lists(seq_ids, min_size=1, max_size=N_SEQ, unique=True),
        counts=st.lists(st.integers(1, 3), min_size=N_SEQ, max_size=N_SEQ),
    )
    def step(self, seqs: list[int], counts: list[int]) -> None:
        top = self.max_pos()
        positions: list[int] = []
        rows: list[int] = []
        for s, n in zip(seqs, counts, strict=False):
            n = min(n, N_BATCH - len(positions))
            positions += range(top[s] + 1, top[s] + 1 + n)
            rows += [s] * n
        before = self.snapshot()
        plan = self.mem.plan(np.array(positions), np.array(rows))
        assert self.snapshot() == before, "plan mutated the memory"
        full = self.mem.pools[0].cells
        if plan is None:
            assert len(positions) > full.n_cells - len(self.ref[0].entries)
            event("step does not fit")
            return
        assert self.mem.num_free() >= len(positions)
        self.mem.apply(plan)
        self.flush()
        for ref in self.ref:
            ref.prune(top)
        for i, ref in enumerate(self.ref):
            for c, p, s in zip(plan.cells[i].tolist(), positions, rows, strict=True):
                self.payload[i][c], self.rot[i][c] = self.next_payload + p, p
                ref.entries.append(Entry(p, {s}, self.next_payload + p))
        self.next_payload += 1000

    @rule(src=seq_ids, dst=seq_ids)
    def fork(self, src: int, dst: int) -> None:
        """n > 1 choices and prefix reuse: dst (empty) shares all of src."""
        if src == dst or self.ref[0].positions(dst):
            return
        self.mem.seq_cp(src, dst, -1, -1)
        for ref in self.ref:
            for e in ref.entries:
                if src in e.owners:
                    e.owners.add(dst)

    @rule(s=seq_ids)
    def free(self, s: int) -> None:
        assert self.mem.seq_rm(s, -1, -1)
        for ref in self.ref:
            ref.rm(s, 0, 1 << 62)

    @rule(s=seq_ids, keep=st.integers(0, 20))
    def trim(self, s: int, keep: int) -> None:
        """What a prefix-cache holder does: keep [0, keep)."""
        assert self.mem.can_rm(s, keep, -1)
        assert self.mem.seq_rm(s, keep, -1)
        for ref in self.ref:
            ref.rm(s, keep, 1 << 62)

    @rule(s=seq_ids, n_keep=st.integers(0, 8), n_discard=st.integers(1, 8))
    def shift(self, s: int, n_keep: int, n_discard: int) -> None:
        top = self.max_pos()
        if top[s] - n_keep < n_discard:
            return
        new_max = top[s] - n_discard
        # the reference's answer: positions the next row needs, in pre-shift terms, are held
        swa_ref = RefPool(
            self.window, [Entry(e.pos, set(e.owners), 0) for e in self.ref[1].entries]
        )
        swa_ref.prune(top)
        need = range(max(0, new_max + 2 - self.window), new_max + 1)
        old = [q if q < n_keep else q + n_discard for q in need]
        want = set(old) <= set(swa_ref.positions(s))
        assert self.mem.can_shift(s, n_keep, n_discard) == want
        if not want:
            event("shift refused")
            return
        if self.mem.num_shift_copies(s, n_keep + n_discard) > self.mem.num_free():
            return
        self.mem.seq_rm(s, n_keep, n_keep + n_discard)
        self.mem.seq_add(s, n_keep + n_discard, -1, -n_discard)
        self.flush()
        self.ref[1].prune(top)
        for ref in self.ref:
            ref.rm(s, n_keep, n_keep + n_discard)
            ref.shift(s, n_keep + n_discard, -n_discard)
        event("shifted")

    @rule(s=seq_ids, n=st.integers(0, 24))
    def usable_prefix(self, s: int, n: int) -> None:
        m = max(0, min(n, self.max_pos()[s] + 1))
        held = set(self.ref[1].positions(s))
        want = m if set(range(max(0, m - self.window + 1), m)) <= held else 0
        assert self.mem.usable_prefix(s, n) == want

    @precondition(lambda self: hasattr(self, "mem"))
    @invariant()
    def matches_reference(self) -> None:
        self.mem.check()
        for i, (pool, ref) in enumerate(zip(self.mem.pools, self.ref, strict=True)):
            cells = pool.cells
            assert cells.used == len(ref.entries), f"{pool.name}: cells freed at the wrong time"
            for s in range(N_SEQ):
                kv_cells, kv_pos = cells.seq_cells(s)
                got = sorted(zip(kv_pos.tolist(), self.payload[i][kv_cells].tolist(), strict=True))
                assert got == ref.items(s), f"{pool.name}: seq {s}"
                assert (self.rot[i][kv_cells] == kv_pos).all(), f"{pool.name}: K rotation"
        assert self.mem.pools[1].cells.used <= self.window * N_SEQ + N_BATCH

    @precondition(lambda self: hasattr(self, "mem"))
    @invariant()
    def each_row_sees_its_window(self) -> None:
        """The views a next row at max + 1 gets: exactly (max + 1 - W, max + 1) of what is held."""
        for s in range(N_SEQ):
            top = self.max_pos()[s]
            if top < 0:
                continue
            full, swa = self.mem.views(s, np.array([top + 1]))
            assert full.kv_pos[full.lo[0] : full.hi[0]].tolist() == self.ref[0].positions(s)
            seen = swa.kv_pos[swa.lo[0] : swa.hi[0]].tolist()
            assert seen == [p for p in self.ref[1].positions(s) if p > top + 1 - self.window]


ISWAMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestISWAMachine = ISWAMachine.TestCase
