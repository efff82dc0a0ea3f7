"""Who holds the memory: room for a step's rows, admission of queued sequences, preemption.

Room comes from free cells first, then from the least-recently-used leaf of the prefix index
(scheduler/radix.py) or prefix-cache holder, and last from preempting the most recently
admitted running sequence without rows this step. A preempted sequence goes to the front of
the queue and recomputes its context (prompt + generated) when readmitted, so nothing is lost.
A queued sequence is admitted only when the memory can hold its whole uncomputed context
beside what running prompts still need; a context shift's copies-on-write need room like any
other rows. Seq ids come from free ones, then from demoting the LRU holder into the index.
"""

from __future__ import annotations

import time
from collections import deque

from kvcache.memory import Memory
from scheduler import choices
from scheduler.config import EngineConfig
from scheduler.context_shift import apply_shift, drop_tokens, plan_shift
from scheduler.prefix_cache import PrefixCache, PrefixMatch
from scheduler.seq_ids import SeqIds
from scheduler.sequence import SeqState, Sequence
from scheduler.stats import Counters
from scheduler.step import Step


class Admission:
    # NOTE: `running` and `waiting` are the scheduler's own list and deque, changed in place
    def __init__(
        self,
        config: EngineConfig,
        memory: Memory,
        prefix: PrefixCache,
        seq_ids: SeqIds,
        counters: Counters,
        running: list[Sequence],
        waiting: deque[Sequence],
    ) -> None:
        self.config = config
        self.memory = memory
        self.prefix = prefix
        self.seq_ids = seq_ids
        self.counters = counters
        self.running = running
        self.waiting = waiting
        self._clock = 0

    def num_free(self, step: Step, evict: bool) -> int:
        """Tokens the memory can still take this step; with `evict`, drops every holder
        first if that is what it takes to get any."""
        free = self.memory.num_free() - step.num_scheduled
        while evict and free <= 0 and self.seq_ids.drop_lru_holder():
            free = self.memory.num_free() - step.num_scheduled
        return max(free, 0)

    def make_room(self, n: int, seq: Sequence, step: Step) -> bool:
        """Room for `n` more tokens: LRU holders first, then preempts the most recently
        admitted sequence without rows this step. False when `seq` itself was preempted."""
        while self.num_free(step, evict=False) < n:
            if not self._free_some(seq, step):
                return False
        return True

    def shift(self, seq: Sequence, step: Step) -> bool:
        """Context shift of `seq` at its limit. Where the memory cannot keep what the next
        rows need (a sliding window reaching into the discarded part), the shifted context is
        recomputed: `seq` is requeued, and False returned."""
        plan = plan_shift(seq, self.config.n_ctx_seq)
        if not self.memory.can_shift(seq.seq_id, plan.n_keep, plan.n_discard):
            drop_tokens(seq, plan)
            self.preempt(seq, count=False)
        else:
            # the copies-on-write shrink as sharers leave (a preempted sibling, a dropped
            # holder): counted again after each, or room is made for copies no longer needed
            p0 = plan.n_keep + plan.n_discard
            while self.num_free(step, evict=False) < self.memory.num_shift_copies(seq.seq_id, p0):
                if not self._free_some(seq, step):
                    return False
            apply_shift(self.memory, seq, plan)
        self.counters.num_context_shifts += 1
        return seq.state is SeqState.RUNNING

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Frees every cell and seq id of `seq`; it goes to the front of the queue and
        recomputes its context (prompt + generated) when readmitted."""
        self.memory.seq_rm(seq.seq_id, -1, -1)
        self.seq_ids.release(seq.seq_id)
        seq.seq_id = -1
        choices.release_fork_ids(seq, self.seq_ids)
        seq.num_computed = 0
        seq.state = SeqState.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        if count:
            seq.num_preemptions += 1
            self.counters.num_preemptions += 1

    def admit(self, seq: Sequence, step: Step, match: PrefixMatch) -> bool:
        """Gives `seq` (and its pending forks) seq ids and `match`'s prefix, if the memory
        can hold its whole uncomputed context beside what running prompts still need."""
        # a context at its limit shifts before its last token is fed: it never needs more
        need = min(seq.num_tokens, self.config.n_ctx_seq)
        # tokens that running prompts will still take after this step's rows
        running_prompts = sum(s.num_uncomputed for s in self.running if not s.is_decoding)
        committed = running_prompts - step.num_prompt_rows
        if match.radix is not None:
            self.seq_ids.radix_lock(match.radix.node, 1)  # evictions below keep its cells
        try:
            while True:
                short_ids = self.seq_ids.num_free < seq.num_seq_ids
                short_cells = self.num_free(step, evict=False) - committed < need - match.length
                if not (short_ids or short_cells):
                    break
                keep = match.seq_id if match.holder else -1
                if short_ids and self.seq_ids.free_lru_id(exclude=keep):
                    continue
                if short_cells and self.seq_ids.drop_lru_holder(exclude=keep):
                    continue
                if (match.seq_id < 0 and match.radix is None) or not match.holder:
                    return False
                # only the matched prefix is left: drop it too
                if match.radix is not None:
                    self.seq_ids.radix_lock(match.radix.node, -1)
                match = PrefixMatch(-1, 0)
        finally:
            if match.radix is not None:
                self.seq_ids.radix_lock(match.radix.node, -1)

        choices.take_seq_ids(seq, self.seq_ids)
        if match.radix is not None:
            self.memory.cells_cp(match.radix.cells, seq.seq_id)
            for pool, cells in enumerate(match.radix.windows, start=1):
                self.memory.cells_cp(cells, seq.seq_id, pool)
            self.seq_ids.radix_touch(match.radix.node)
        elif match.length:
            self.memory.seq_cp(match.seq_id, seq.seq_id, 0, match.length)
            if match.holder:
                self.prefix.touch(match.seq_id)
        seq.num_computed = match.length
        if self.config.prefix_cache:
            self.counters.prefix_queried_tokens += seq.num_tokens
            self.counters.prefix_hit_tokens += match.length
            if not match.holder:
                self.counters.prefix_running_hit_tokens += match.length
        if seq.queue_time is None:
            seq.queue_time = time.monotonic() - seq.submit_time
            seq.num_cached = min(match.length, seq.num_prompt)
        seq.state = SeqState.RUNNING
        self.add_running(seq)
        return True

    def add_running(self, seq: Sequence) -> None:
        """Appends `seq` to `running` as the most recently admitted (the next victim)."""
        self._clock += 1
        seq.admit_order = self._clock
        self.running.append(seq)

    def _free_some(self, seq: Sequence, step: Step) -> bool:
        """Drops the LRU holder, or else preempts the most recently admitted sequence without
        rows this step. False when that was `seq` itself."""
        if self.seq_ids.drop_lru_holder():
            return True
        victim = max((s for s in self.running if not step.has(s)), key=lambda s: s.admit_order)
        self.preempt(victim)
        return victim is not seq
