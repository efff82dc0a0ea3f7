"""RecurrentMemory against an obviously-correct reference, driven by hypothesis.

The reference keeps, per sequence, its position and the tuple of payloads its state has
consumed, and the states every checkpoint the memory took must hold (the consumed prefix at
that moment). A fake storage (one tuple per slot) changes only through the pending copies and
the step's "forward", which reads each sequence's state from its slot, consumes the rows,
writes the captures and leaves the state in the slot, as the contract in scheduler/plan.py
says. So a wrong slot, a missed copy or zero, a shared slot written in place, a checkpoint
with the wrong content and a wrong can_rm / usable_prefix answer all show up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.memory import MemoryPlan
from kvcache.recurrent import RecurrentMemory
from kvcache.spec import MemorySpec, Recurrent

N_SEQ = 4
SPEC = MemorySpec.of([Recurrent(((3, 8), (2, 4, 4)))] * 2)
seq_ids = st.integers(0, N_SEQ - 1)


@dataclass
class RefSeq:
    pos: int = -1
    state: tuple[int, ...] | None = None  # payloads consumed; None: no state
    version: object = None  # identity of the state: forks share it until a write
    # every m it may have a checkpoint at, with the states it may hold there (two checkpoints
    # that seq_add / seq_div move onto one m leave one of them, the memory's choice)
    ckpts: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)


def snapshot(mem: RecurrentMemory) -> object:
    sl = mem.slots
    return (
        list(sl.tail),
        list(sl.pos),
        [dict(c) for c in sl.ckpts],
        [set(r) for r in sl.tail_refs],
        [set(r) for r in sl.ckpt_refs],
        list(mem._copies),
    )


def forward(store: list[tuple[int, ...]], plan: MemoryPlan, payloads: list[int]) -> None:
    """What a worker does with a recurrent group (copies are applied before)."""
    seq_ids = plan.seq_ids.tolist()
    captures = {(s, m): x for s, m, x in plan.captures}
    i = 0
    while i < len(seq_ids):
        s, slot = seq_ids[i], int(plan.cells[0][i])
        state = store[slot]
        while i < len(seq_ids) and seq_ids[i] == s:
            assert plan.cells[0][i] == slot, "one slot per sequence"
            state = (*state, payloads[i])
            m = int(plan.positions[i]) + 1
            if (s, m) in captures:
                store[captures[(s, m)]] = state
            i += 1
        store[slot] = state


class RecurrentMachine(RuleBasedStateMachine):
    @initialize(n_slots=st.integers(2, 10), interval=st.integers(1, 6))
    def setup(self, n_slots: int, interval: int) -> None:
        self.mem = RecurrentMemory(SPEC, N_SEQ, ckpt_interval=interval, n_slots=n_slots)
        self.store: list[tuple[int, ...]] = [(-1,)] * n_slots  # garbage until written
        self.ref = [RefSeq() for _ in range(N_SEQ)]
        self.next_payload = 0

    def flush(self) -> None:
        ops = self.mem.take_pending()
        assert len(ops) == 1 and ops[0].shift_cells.size == 0
        for src, dst in zip(ops[0].copy_src.tolist(), ops[0].copy_dst.tolist(), strict=True):
            self.store[dst] = () if src < 0 else self.store[src]

    @rule(
        seqs=st.lists(seq_ids, min_size=1, max_size=N_SEQ, unique=True),
        counts=st.lists(st.integers(1, 5), min_size=N_SEQ, max_size=N_SEQ),
    )
    def step(self, seqs: list[int], counts: list[int]) -> None:
        self.run(seqs, counts, [])

    @rule(
        seqs=st.lists(seq_ids, min_size=1, max_size=N_SEQ, unique=True),
        counts=st.lists(st.integers(1, 5), min_size=N_SEQ, max_size=N_SEQ),
        drafted=st.lists(st.booleans(), min_size=N_SEQ, max_size=N_SEQ),
        accepts=st.lists(st.integers(0, 4), min_size=N_SEQ, max_size=N_SEQ),
    )
    def drafted_step(
        self, seqs: list[int], counts: list[int], drafted: list[bool], accepts: list[int]
    ) -> None:
        """Speculative decoding: the drafted sequences' rows past the first (within
        rollback_rows) are verified after the step, the rejected ones rolled back."""
        budget = self.mem.rollback_rows
        counts = list(counts)
        rollback = []
        for i, s in enumerate(seqs):
            if drafted[i] and budget > 0:
                counts[i] = min(counts[i], budget + 1)
                budget -= counts[i] - 1
                rollback.append(s)
        first = {s: self.ref[s].pos + 1 for s in rollback}
        before = {s: (self.ref[s].state or (), dict(self.ref[s].ckpts)) for s in rollback}
        plan = self.run(seqs, counts, rollback)
        if plan is None:
            return
        for i, s in enumerate(seqs):
            if s not in rollback:
                continue
            n = counts[i]
            got = sorted(m for c, m, _ in plan.captures if c == s)
            assert got == list(range(first[s] + 1, first[s] + n)), "a state before each draft"
            keep = first[s] + 1 + min(accepts[i], n - 1)  # positions [0, keep) stay
            if keep < first[s] + n:
                assert self.mem.seq_rm(s, keep, -1), "a drafted tail rolls back"
                event("drafts rolled back")
            self.mem.seq_commit(s)
            ref = self.ref[s]
            state, ckpts = before[s]
            ref.state = (*state, *ref.state[len(state) : len(state) + keep - first[s]])
            ref.pos, ref.version, ref.ckpts = keep - 1, object(), ckpts
            assert not set(self.mem.slots.ckpts[s]) - set(ckpts), "commit leaves no draft point"

    def run(self, seqs: list[int], counts: list[int], rollback: list[int]) -> MemoryPlan | None:
        positions: list[int] = []
        rows: list[int] = []
        for s, n in zip(seqs, counts, strict=False):
            p0 = self.ref[s].pos + 1
            positions += range(p0, p0 + n)
            rows += [s] * n
        before = snapshot(self.mem)
        plan = self.mem.plan(np.array(positions), np.array(rows), rollback)
        assert snapshot(self.mem) == before, "plan mutated the memory"
        idle = {id(r.version) for i, r in enumerate(self.ref) if i not in seqs and r.version}
        if plan is None:
            assert len(idle) + len(seqs) > self.mem.slots.n_cells, "refused a step that fits"
            event("slots ran out")
            return None
        assert self.mem.num_free() >= len(positions)
        self.mem.apply(plan)
        self.flush()
        for s in seqs:  # the slot each sequence reads holds its state
            first = int(np.flatnonzero(plan.seq_ids == s)[0])
            assert self.store[plan.cells[0][first]] == (self.ref[s].state or ()), f"seq {s}"
        payloads = list(range(self.next_payload, self.next_payload + len(positions)))
        self.next_payload += len(positions)
        forward(self.store, plan, payloads)
        for s in seqs:
            ref = self.ref[s]
            mine = [p for p, r in zip(payloads, rows, strict=True) if r == s]
            state = (*(ref.state or ()), *mine)
            for c, m, _ in plan.captures:
                if c == s:
                    ref.ckpts[m] = {(*(ref.state or ()), *mine[: m - ref.pos - 1])}
            ref.pos += len(mine)
            ref.state, ref.version = state, object()
        if plan.captures:
            event("captured")
        return plan

    @rule(src=seq_ids, dst=seq_ids, back=st.integers(0, 12))
    def fork(self, src: int, dst: int, back: int) -> None:
        """n > 1 choices and prefix hits: dst takes src's state after usable_prefix(src, n)."""
        self.share(src, dst, self.mem.usable_prefix(src, self.ref[src].pos + 1 - back))

    @rule(src=seq_ids, dst=seq_ids, i=st.integers(0, 8))
    def fork_at_a_checkpoint(self, src: int, dst: int, i: int) -> None:
        ms = sorted(self.mem.slots.ckpts[src])
        if ms:
            self.share(src, dst, ms[i % len(ms)])

    def share(self, src: int, dst: int, m: int) -> None:
        if src == dst or m == 0:
            return
        s, d = self.ref[src], self.ref[dst]
        held = self.store[self.mem.slots.ckpts[src].get(m, 0)]
        self.mem.seq_cp(src, dst, 0, m)
        if m == s.pos + 1:
            d.state, d.version = s.state, s.version
        else:
            assert held in s.ckpts[m]
            d.state, d.version = held, object()
            event("forked from a checkpoint")
        d.pos = m - 1
        d.ckpts = {k: v for k, v in s.ckpts.items() if k <= m}

    @rule(src=seq_ids, dst=seq_ids, n=st.integers(1, 30))
    def fork_without_a_state_there(self, src: int, dst: int, n: int) -> None:
        if src == dst or self.ref[src].pos < 0 or n in self.mem.prefix_lengths(src, n):
            return
        if n > self.ref[src].pos:
            return  # past the tail: that is a whole fork
        before = snapshot(self.mem)
        with pytest.raises(ValueError):
            self.mem.seq_cp(src, dst, 0, n)
        assert snapshot(self.mem) == before

    @rule(s=seq_ids)
    def free(self, s: int) -> None:
        assert self.mem.seq_rm(s, -1, -1)
        self.ref[s] = RefSeq()

    @rule(s=seq_ids, p0=st.integers(-1, 20), length=st.one_of(st.just(-1), st.integers(0, 20)))
    def rm(self, s: int, p0: int, length: int) -> None:
        p1 = -1 if length < 0 else max(p0, 0) + length
        ref = self.ref[s]
        lo, hi = max(p0, 0), (1 << 62 if p1 < 0 else p1)
        if ref.pos < 0 or lo > ref.pos or lo >= hi:
            want = "nothing"
        elif hi > ref.pos and lo == 0:
            want = "all"
        elif hi > ref.pos and lo in self.mem.slots.ckpts[s]:
            want = "rollback"
        else:
            want = "refuse"
        can = self.mem.can_rm(s, p0, p1)
        before = snapshot(self.mem)
        held = self.store[self.mem.slots.ckpts[s].get(lo, 0)]
        assert self.mem.seq_rm(s, p0, p1) == can == (want != "refuse")
        event(f"rm: {want}")
        if want == "refuse":
            assert snapshot(self.mem) == before
        elif want == "all":
            self.ref[s] = RefSeq()
        elif want == "rollback":
            assert held in ref.ckpts[lo]
            ref.state, ref.version, ref.pos = held, object(), lo - 1
            ref.ckpts = {k: v for k, v in ref.ckpts.items() if k <= lo}

    @rule(s=seq_ids)
    def keep(self, s: int) -> None:
        self.mem.seq_keep(s)
        for i in range(N_SEQ):
            if i != s:
                self.ref[i] = RefSeq()

    @rule(s=seq_ids, p0=st.integers(0, 20), delta=st.integers(-8, 8))
    def add(self, s: int, p0: int, delta: int) -> None:
        """Positions [p0, end) move; the states stay as they are."""
        self.mem.seq_add(s, p0, -1, delta)
        self.move(s, p0, lambda p: p + delta)

    @rule(s=seq_ids, p0=st.integers(0, 20), d=st.integers(1, 3))
    def div(self, s: int, p0: int, d: int) -> None:
        self.mem.seq_div(s, p0, -1, d)
        self.move(s, p0, lambda p: p // d)

    def move(self, s: int, p0: int, f) -> None:  # type: ignore[no-untyped-def]
        ref = self.ref[s]
        if ref.pos < 0:
            return
        new_pos = f(ref.pos) if ref.pos >= p0 else ref.pos
        if new_pos < 0:
            self.ref[s] = RefSeq()
            return
        kept = {m: v for m, v in ref.ckpts.items() if m - 1 < p0 or f(m - 1) == m - 1}
        ckpts = dict(kept)
        for m, v in ref.ckpts.items():
            if m not in kept:
                ckpts[f(m - 1) + 1] = ckpts.get(f(m - 1) + 1, set()) | v
        ref.ckpts = {m: v for m, v in ckpts.items() if 0 < m <= new_pos + 1}
        ref.pos = new_pos

    @rule(s=seq_ids, n=st.integers(0, 30))
    def usable_prefix(self, s: int, n: int) -> None:
        ref = self.ref[s]
        have = set(self.mem.slots.ckpts[s]) | ({ref.pos + 1} if ref.pos >= 0 else set())
        assert self.mem.usable_prefix(s, n) == max((m for m in have if 0 < m <= n), default=0)

    @rule(s=seq_ids, n_discard=st.integers(0, 4))
    def shift(self, s: int, n_discard: int) -> None:
        assert self.mem.can_shift(s, 0, n_discard) == (n_discard == 0)
        assert self.mem.num_shift_copies(s, 0) == 0

    @precondition(lambda self: hasattr(self, "mem"))
    @invariant()
    def matches_reference(self) -> None:
        self.mem.check()
        sl = self.mem.slots
        for s, ref in enumerate(self.ref):
            assert sl.pos[s] == ref.pos == self.mem.seq_pos_max(s), f"seq {s} pos"
            if ref.state is None:
                assert sl.tail[s] == -1 and not sl.ckpts[s]
                continue
            assert self.store[sl.tail[s]] == ref.state, f"seq {s}: its slot holds another state"
            for m, x in sl.ckpts[s].items():
                assert m in ref.ckpts, f"seq {s}: a checkpoint at {m} it never took"
                assert self.store[x] in ref.ckpts[m], f"seq {s}: checkpoint {m} content"
        owners = sl.owner_map()
        assert sl.used == int((owners != -1).sum()) == sl.stats().used
        assert self.mem.num_used == sl.used


RecurrentMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None
)
TestRecurrentMachine = RecurrentMachine.TestCase


def make_mem(**kw: object) -> RecurrentMemory:
    return RecurrentMemory(SPEC, N_SEQ, **kw)  # type: ignore[arg-type]


def run_step(mem: RecurrentMemory, rows: dict[int, range]) -> MemoryPlan:
    positions = np.array([p for r in rows.values() for p in r])
    seqs = np.array([s for s, r in rows.items() for _ in r])
    plan = mem.plan(positions, seqs)
    assert plan is not None
    mem.apply(plan)
    return plan


def test_a_prompt_step_checkpoints_before_its_last_token_and_on_the_grid() -> None:
    mem = make_mem(ckpt_interval=4)
    plan = run_step(mem, {0: range(0, 10)})
    assert [(s, m) for s, m, _ in plan.captures] == [(0, 4), (0, 8), (0, 9)]
    assert mem.prefix_lengths(0, 100) == [10, 9, 8, 4]
    assert mem.usable_prefix(0, 9) == 9 and mem.usable_prefix(0, 7) == 4
    plan = run_step(mem, {0: range(10, 11)})  # a decode step takes none
    assert plan.captures == []


def test_a_long_prompt_keeps_a_spread_of_checkpoints_not_one_per_chunk() -> None:
    mem = make_mem(n_ckpt=12, ckpt_interval=8)
    run_step(mem, {0: range(0, 10)})
    run_step(mem, {0: range(10, 20)})
    assert sorted(mem.slots.ckpts[0]) == [8, 16, 19]
    for p0 in range(20, 100, 10):  # a 100-token prompt read in chunks of 10
        run_step(mem, {0: range(p0, p0 + 10)})
    # 8 x 2^j, the newest grid point (96) and the state before the last row (99)
    assert sorted(mem.slots.ckpts[0]) == [8, 16, 32, 64, 96, 99]
    assert mem.slots.used == 1 + 6
    mem.check()


def test_a_fork_shares_the_slot_until_its_first_write() -> None:
    mem = make_mem(n_ckpt=0)
    run_step(mem, {0: range(0, 1)})
    mem.take_pending()
    mem.seq_cp(0, 1, -1, -1)
    assert mem.slots.tail[0] == mem.slots.tail[1] and mem.slots.stats().shared == 1
    plan = run_step(mem, {1: range(1, 2)})
    x0, x1 = mem.slots.tail[0], mem.slots.tail[1]
    assert x0 != x1 and plan.cells[0].tolist() == [x1]
    pending = mem.take_pending()[0]
    assert (pending.copy_src.tolist(), pending.copy_dst.tolist()) == ([x0], [x1])


def test_a_new_sequence_reads_a_zeroed_slot() -> None:
    mem = make_mem()
    plan = run_step(mem, {2: range(0, 3)})
    pending = mem.take_pending()[0]
    assert pending.copy_src.tolist()[0] == -1
    assert pending.copy_dst.tolist()[0] == plan.cells[0][0]


def test_checkpoints_give_way_to_tails_and_never_fail_a_step() -> None:
    mem = make_mem(n_ckpt=1, ckpt_interval=2)
    for s in range(N_SEQ):
        run_step(mem, {s: range(0, 8)})
        mem.check()
    assert mem.slots.num_ckpt_slots() <= 1
    assert all(mem.slots.tail[s] >= 0 for s in range(N_SEQ))


def test_rows_must_continue_the_state() -> None:
    mem = make_mem()
    run_step(mem, {0: range(0, 3)})
    with pytest.raises(ValueError):
        mem.plan(np.array([5]), np.array([0]))
    with pytest.raises(ValueError):
        mem.plan(np.array([0, 1]), np.array([1, 2]))  # seq 2 has no state before 1
