"""Continuous batching over one KVCells: `plan = schedule()`, then `events = update(plan, out)`.

Each step fills a token budget (n_batch) with, in order: one decode token per running
sequence whose context is computed, prompt chunks of sequences still reading, then new
admissions (FCFS) while the cache has room. Not thread-safe: the engine holds a lock.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvcache.cells import KVCells, PendingOps
from scheduler.config import EngineConfig
from scheduler.context_shift import apply_shift, clamp_n_keep, plan_shift
from scheduler.intake import make_choices, prepare_prompt, shift_enabled
from scheduler.plan import BatchPlan, SampleRow, SeqBatch, StepOutput
from scheduler.prefix_cache import PrefixCache, PrefixMatch
from scheduler.request import EmbeddingEvent, Event, FinishEvent, Request, TokenEvent
from scheduler.seq_ids import SeqIds
from scheduler.sequence import SeqState, Sequence, make_sample_row


@dataclass(slots=True)
class Counters:
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_context_shifts: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # tokens fed to the model that were not sampled just before
    num_generated_tokens: int = 0
    num_steps: int = 0
    last_num_decode: int = 0
    last_num_prefill: int = 0


Routed = tuple[str, Event]  # (req_id, event)


class Scheduler:
    def __init__(self, config: EngineConfig, cells: KVCells | None = None) -> None:
        config.validate()
        self.config = config
        self.cells = cells if cells is not None else KVCells(config.n_cells, config.n_seq_max)
        self.prefix = PrefixCache()
        self.counters = Counters()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.seq_ids = SeqIds(self.cells, self.prefix, config.prefix_cache)
        self._requests: dict[str, list[Sequence]] = {}
        self._aborts: list[tuple[str, int | None]] = []
        self._events: list[Routed] = []
        self._sampled: list[Sequence] = []  # the sequence of each SampleRow of the last plan
        self._in_plan: list[Sequence] = []
        self._num_scheduled = 0
        self._admit_clock = 0
        self._rng = random.Random(config.seed)

    # ---- requests in ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues the request's choices; raises ValueError for one it cannot serve."""
        if request.req_id in self._requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        prompt = prepare_prompt(request, self.config)
        seed = request.sampling.seed
        if seed is None:
            seed = self._rng.getrandbits(63)
        seqs = make_choices(request, prompt, seed, time.monotonic())
        self._requests[request.req_id] = seqs
        self.waiting.append(seqs[0])

    def abort(self, req_id: str, index: int | None = None) -> None:
        """Takes effect at the next schedule()."""
        self._aborts.append((req_id, index))

    def shift_enabled(self, request: Request) -> bool:
        return shift_enabled(request, self.config)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts or self._events)

    @property
    def num_waiting_requests(self) -> int:
        return len({s.req_id for s in self.waiting})

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        """Plans the step and applies its cache operations (placement, shifts, forks)."""
        self._apply_aborts()
        budget = self.config.n_batch
        rows: list[tuple[Sequence, int]] = []
        self._num_scheduled = 0  # tokens in `rows`: cells this step will take
        scheduled: set[int] = set()  # id() of sequences with rows; never preempted this step

        for seq in [s for s in self.running if s.is_decoding]:
            if budget == 0:
                break
            if seq.state is not SeqState.RUNNING:
                continue  # preempted for an older sequence in this loop
            if seq.num_computed >= self.config.n_ctx_seq and not self._shift(seq, rows, scheduled):
                continue
            if not self._make_room(1, seq, rows, scheduled):
                continue
            rows.append((seq, 1))
            self._num_scheduled += 1
            scheduled.add(id(seq))
            budget -= 1
        num_decode = len(rows)

        for seq in [s for s in self.running if not s.is_decoding]:
            if budget == 0:
                break
            if seq.state is not SeqState.RUNNING:
                continue
            cap = min(seq.num_uncomputed, budget, self.config.n_ctx_seq - seq.num_computed)
            if cap <= 0:
                continue
            n = min(cap, self._free_cells(rows, evict=True))
            if n == 0:
                if not self._make_room(1, seq, rows, scheduled):
                    continue
                n = 1
            rows.append((seq, n))
            self._num_scheduled += n
            scheduled.add(id(seq))
            budget -= n

        while self.waiting and budget > 0 and self._admit(self.waiting[0], rows):
            seq = self.waiting.popleft()
            cap = min(seq.num_uncomputed, budget, self.config.n_ctx_seq - seq.num_computed)
            n = min(cap, self._free_cells(rows, evict=False))
            if n > 0:
                rows.append((seq, n))
                self._num_scheduled += n
                scheduled.add(id(seq))
                budget -= n

        self.counters.last_num_decode = num_decode
        self.counters.last_num_prefill = sum(n for _, n in rows[num_decode:])
        return self._place(rows)

    def update(self, plan: BatchPlan, out: StepOutput) -> list[Routed]:
        """Appends the sampled tokens, checks stop conditions, frees finished sequences."""
        assert len(out.token_ids) == len(plan.samples), "one sampled id per SampleRow"
        self.counters.num_steps += 1
        for i, (sample, seq) in enumerate(zip(plan.samples, self._sampled, strict=True)):
            if seq.state is not SeqState.RUNNING:
                continue
            if sample.embed:
                self._finish_embedding(seq, out, i)
                continue
            self._append_token(seq, sample, out, i)
        self._sampled, self._in_plan = [], []
        events, self._events = self._events, []
        return events

    def fail_plan(self, message: str) -> list[Routed]:
        """The worker raised on the last plan: every request with a sequence in it fails."""
        req_ids = {s.req_id for s in self._in_plan + self._sampled}
        for req_id in req_ids:
            self._finish_request(req_id, None, "error", message)
        self._sampled, self._in_plan = [], []
        events, self._events = self._events, []
        return events

    def fail_seqs(self, errors: dict[int, str]) -> None:
        """The worker failed on these sequences of the last plan ({seq_id: error}): their
        requests finish with an error; update() then skips them and updates the rest."""
        for seq in [s for s in self._in_plan if s.seq_id in errors]:
            self._finish_request(seq.req_id, None, "error", errors[seq.seq_id])

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[Routed]:
        for req_id in list(self._requests):
            self._finish_request(req_id, None, reason, error)
        events, self._events = self._events, []
        return events

    def clear_prefix_cache(self) -> None:
        self.seq_ids.clear_holders()

    # ---- placement ------------------------------------------------------------------------

    def _place(self, rows: list[tuple[Sequence, int]]) -> BatchPlan:
        num_tokens = sum(n for _, n in rows)
        token_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        seq_ids = np.empty(num_tokens, dtype=np.int64)
        start = 0
        for seq, n in rows:
            p0 = seq.num_computed
            token_ids[start : start + n] = seq.tokens[p0 : p0 + n]
            positions[start : start + n] = np.arange(p0, p0 + n)
            seq_ids[start : start + n] = seq.seq_id
            start += n
        cells = np.zeros(0, dtype=np.int64)
        if num_tokens:
            slot = self.cells.find_slot(num_tokens)
            assert slot is not None, "room was made before placement"
            cells = slot
            self.cells.apply_ubatch(cells, positions, seq_ids)

        seqs: list[SeqBatch] = []
        samples: list[SampleRow] = []
        sampled: list[Sequence] = []
        start = 0
        for seq, n in rows:
            if seq.num_generated == 0 or seq.num_uncomputed > 1:
                self.counters.num_prompt_tokens += n
            else:
                self.counters.num_prompt_tokens += n - 1
            seq.num_computed += n
            if seq.num_uncomputed == 0:
                for choice in [seq, *self._fork(seq)]:
                    samples.append(make_sample_row(choice, start + n - 1))
                    sampled.append(choice)
            start += n
        start = 0
        for seq, n in rows:
            kv_cells, kv_pos = self.cells.seq_cells(seq.seq_id)
            seqs.append(SeqBatch(seq.seq_id, start, start + n, kv_cells, kv_pos))
            start += n
        pending = self.cells.take_pending() if num_tokens else PendingOps.empty()
        self._sampled = sampled
        self._in_plan = [s for s, _ in rows]
        return BatchPlan(token_ids, positions, seq_ids, cells, seqs, samples, pending)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Choices 1..n-1 share the computed prompt of choice 0 (zero-copy seq_cp)."""
        forks, seq.forks = seq.forks, []
        for child in forks:
            self.cells.seq_cp(seq.seq_id, child.seq_id, -1, -1)
            child.tokens = list(seq.tokens)
            child.num_computed = seq.num_computed
            child.num_cached = seq.num_cached
            child.queue_time = seq.queue_time
            child.parent = None
            if seq.constraint is not None:  # structured output: the grammar state forks too
                child.constraint = seq.constraint.fork()
            child.state = SeqState.RUNNING
            self._admit_clock += 1
            child.admit_order = self._admit_clock
            self.running.append(child)
        return forks

    def _append_token(self, seq: Sequence, sample: SampleRow, out: StepOutput, i: int) -> None:
        req = seq.request
        token = int(out.token_ids[i])
        seq.tokens.append(token)
        seq.output_ids.append(token)
        self.counters.num_generated_tokens += 1
        is_stop = (
            token in req.stop_token_ids
            and not req.ignore_eos
            and seq.num_generated > req.min_tokens
        )
        if is_stop:
            self._finish(seq, "stop")
            return
        if seq.constraint is not None and (error := seq.constraint.advance(token)) is not None:
            self._finish(seq, "error", error)  # structured output: a mask was not applied
            return
        logprob = out.logprobs[i] if out.logprobs is not None else None
        top = out.top_logprobs[i] if out.top_logprobs is not None else None
        self._events.append((seq.req_id, TokenEvent(seq.index, token, logprob, top)))
        if seq.constraint is not None and seq.constraint.is_done:
            self._finish(seq, "stop")  # structured output: the grammar is complete
            return
        out_of_context = seq.num_computed >= self.config.n_ctx_seq and not self.shift_enabled(req)
        if seq.num_generated >= req.max_tokens or out_of_context:
            self._finish(seq, "length")

    def _finish_embedding(self, seq: Sequence, out: StepOutput, i: int) -> None:
        vector = out.embeddings[i] if out.embeddings is not None else None
        if vector is None:
            self._finish(seq, "error", "the worker returned no embedding")
            return
        self._events.append((seq.req_id, EmbeddingEvent(seq.index, vector)))
        self._finish(seq, "stop")

    # ---- room: holders, preemption, context shift -----------------------------------------

    def _free_cells(self, rows: list[tuple[Sequence, int]], evict: bool) -> int:
        """Cells free for more tokens this step; with `evict`, drops every holder first if
        that is what it takes to get any."""
        free = self.cells.n_cells - self.cells.used - self._num_scheduled
        while evict and free <= 0 and self.seq_ids.drop_lru_holder():
            free = self.cells.n_cells - self.cells.used - self._num_scheduled
        return max(free, 0)

    def _make_room(
        self, n: int, seq: Sequence, rows: list[tuple[Sequence, int]], scheduled: set[int]
    ) -> bool:
        """Makes `n` cells free: LRU holders first, then preempts the most recently admitted
        unscheduled sequence. False when `seq` itself had to be preempted."""
        while self._free_cells(rows, evict=False) < n:
            if self.seq_ids.drop_lru_holder():
                continue
            victims = [s for s in self.running if id(s) not in scheduled]
            victim = max(victims, key=lambda s: s.admit_order)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _shift(self, seq: Sequence, rows: list[tuple[Sequence, int]], scheduled: set[int]) -> bool:
        plan = plan_shift(self.cells, seq, self.config.n_ctx_seq)
        if plan.num_copies and not self._make_room(plan.num_copies, seq, rows, scheduled):
            return False
        apply_shift(self.cells, seq, plan)
        self.counters.num_context_shifts += 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Frees every cell and seq id of `seq`; it goes to the front of the queue and
        recomputes its context (prompt + generated) when readmitted."""
        self.cells.seq_rm(seq.seq_id, -1, -1)
        self.seq_ids.release(seq.seq_id)
        seq.seq_id = -1
        for child in seq.forks:
            self.seq_ids.release(child.seq_id)
            child.seq_id = -1
        seq.num_computed = 0
        seq.state = SeqState.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.counters.num_preemptions += 1

    def _admit(self, seq: Sequence, rows: list[tuple[Sequence, int]]) -> bool:
        """Gives `seq` (and its pending forks) seq ids and any cached prefix, if the cache can
        hold its whole uncomputed context beside what running prompts still need."""
        match = PrefixMatch(-1, 0)
        if self.config.prefix_cache:
            match = self.prefix.match(np.asarray(seq.tokens, dtype=np.int64))
            match.length = min(match.length, seq.num_tokens - 1)
        # a context at its limit shifts before its last token is fed: it never needs more
        need = min(seq.num_tokens, self.config.n_ctx_seq)
        # cells that running prompts will still take after this step's rows
        committed = sum(s.num_uncomputed for s in self.running if not s.is_decoding) - sum(
            n for s, n in rows if not s.is_decoding
        )
        while (
            self._free_cells(rows, evict=False) - committed < need - match.length
            or self.seq_ids.num_free < seq.num_seq_ids
        ):
            if self.seq_ids.drop_lru_holder(exclude=match.seq_id):
                continue
            if match.seq_id < 0:
                return False
            match = PrefixMatch(-1, 0)  # only the matched holder is left: drop it too

        seq.seq_id = self.seq_ids.take()
        for child in seq.forks:
            child.seq_id = self.seq_ids.take()
        if match.length:
            self.cells.seq_cp(match.seq_id, seq.seq_id, 0, match.length)
            self.prefix.touch(match.seq_id)
        seq.num_computed = match.length
        if self.config.prefix_cache:
            self.counters.prefix_queried_tokens += seq.num_tokens
            self.counters.prefix_hit_tokens += match.length
        if seq.queue_time is None:
            seq.queue_time = time.monotonic() - seq.submit_time
            seq.num_cached = min(match.length, seq.num_prompt)
        self._admit_clock += 1
        seq.admit_order = self._admit_clock
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        return True

    # ---- finishing ------------------------------------------------------------------------

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for req_id, index in aborts:
            self._finish_request(req_id, index, "abort", None)

    def _finish_request(
        self, req_id: str, index: int | None, reason: str, error: str | None
    ) -> None:
        seqs = self._requests.get(req_id, [])
        while True:
            todo = [
                s
                for s in seqs
                if s.state is not SeqState.FINISHED and (index is None or s.index == index)
            ]
            if not todo:
                return
            self._finish(todo[0], reason, error)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.state is SeqState.FINISHED:
            return
        if seq.forks and reason != "error":
            # choice 0 leaves while its prompt is shared: the first fork takes over the
            # reading, so swap identities (nothing was generated yet) and finish that fork
            child = seq.forks[0]
            seq.index, child.index = child.index, seq.index
            seq.seed, child.seed = child.seed, seq.seed
            seq = child
        if seq.parent is not None:
            seq.parent.forks.remove(seq)
            seq.parent = None
            if seq.seq_id >= 0:
                self.seq_ids.release(seq.seq_id)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
            # NOTE: an embedding request leaves no cells behind (its prompt is not cached)
            self._release(seq, cache=reason != "error" and not seq.request.embed)
        elif seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        seq.state = SeqState.FINISHED
        seq.seq_id = -1
        event = FinishEvent(
            index=seq.index,
            reason=reason,
            num_prompt_tokens=len(seq.request.prompt_ids),
            num_cached_tokens=seq.num_cached,
            num_output_tokens=seq.num_generated,
            queue_time=seq.queue_time or 0.0,
            error=error,
        )
        self._events.append((seq.req_id, event))
        seqs = self._requests.get(seq.req_id, [])
        if all(s.state is SeqState.FINISHED for s in seqs):
            self._requests.pop(seq.req_id, None)

    def _release(self, seq: Sequence, cache: bool) -> None:
        """Retires the seq id; a holder keeps only the unshifted part of the context (a
        holder's token i must sit at position i)."""
        n = seq.num_computed
        if seq.num_shifts:
            n = min(n, clamp_n_keep(seq.request.n_keep, seq.num_prompt, self.config.n_ctx_seq))
        self.seq_ids.retire(seq.seq_id, np.asarray(seq.tokens[:n], dtype=np.int64), cache)

    @property
    def num_free_seq_ids(self) -> int:
        return self.seq_ids.num_free
