"""Continuous batching over a Memory: `plan = schedule()`, then `events = update(plan, out)`.

Each step fills a token budget (n_batch) with, in order: one decode token per running
sequence whose context is computed, prompt chunks of sequences still reading, then new
admissions (FCFS, except that a request waiting for a prefix a running prompt is computing
lets the others pass: scheduler/sharing.py) while the memory has room. Room, shifts and prefix
reuse are questions to the memory (kvcache/memory.py); who gets the room (admission, holders
dropped, preemption) is scheduler/admission.py; n > 1 choices live in scheduler/choices.py.
Not thread-safe: the engine holds a lock.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque

import numpy as np

from kvcache.memory import Memory
from scheduler import choices
from scheduler.admission import Admission
from scheduler.config import EngineConfig
from scheduler.context_shift import clamp_n_keep
from scheduler.intake import check_request, make_choices, prepare_prompt, shift_enabled
from scheduler.kv_blocks import KVEvent
from scheduler.plan import BatchPlan, SampleRow, SeqBatch, StepOutput, group_batches
from scheduler.prefix_cache import PrefixCache, PrefixMatch
from scheduler.request import EmbeddingEvent, Event, FinishEvent, Request, TokenEvent
from scheduler.seq_ids import SeqIds
from scheduler.sequence import SeqState, Sequence, make_sample_row
from scheduler.sharing import Sharing
from scheduler.speculative import Drafter, Speculator, draft_rows
from scheduler.stats import Counters
from scheduler.step import Step

Routed = tuple[str, Event]  # (req_id, event)


class Scheduler:
    def __init__(
        self, config: EngineConfig, memory: Memory | None = None, drafter: Drafter | None = None
    ) -> None:
        config.validate()
        self.config = config
        if memory is None:
            memory = config.make_memory()
        self.memory = memory
        self.prefix = PrefixCache()
        self.counters = Counters()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.seq_ids = SeqIds(memory, self.prefix, config.prefix_cache, config.prefix_index)
        self.sharing = Sharing(self.prefix, memory, config, self.seq_ids.radix)
        self.spec = Speculator(config.spec, memory.rollback_rows > 0, drafter)
        self.admission = Admission(
            config, memory, self.prefix, self.seq_ids, self.counters, self.running, self.waiting
        )
        # queued sequences looked at per step: waiters are skipped, the rest admitted FCFS
        self._scan = max(config.n_seq_max, 1)
        self._requests: dict[str, list[Sequence]] = {}
        self._aborts: list[tuple[str, int | None]] = []
        self._events: list[Routed] = []
        self._step = Step(0)  # the last schedule()'s
        self._rng = random.Random(config.seed)

    # ---- requests in ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues the request's choices; raises ValueError for one it cannot serve."""
        if request.req_id in self._requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        check_request(request, self.config)
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
        """Plans the step and applies its memory operations (placement, shifts, forks)."""
        self._apply_aborts()
        step = self._step = Step(self.config.n_batch)
        n_ctx = self.config.n_ctx_seq

        for seq in [s for s in self.running if s.is_decoding]:
            if step.budget == 0:
                break
            if seq.state is not SeqState.RUNNING:
                continue  # preempted for an older sequence in this loop
            if seq.num_computed >= n_ctx and not self.admission.shift(seq, step):
                continue
            if self.admission.make_room(1, seq, step):
                step.add(seq, 1)
        step.num_decode = len(step.rows)
        if self.spec.enabled:  # drafts never evict nor preempt
            free = self.admission.num_free(step, evict=False)
            busy = len(self.running) + len(self.waiting)
            rollback = self.memory.rollback_rows
            self.spec.add_drafts(step, free, rollback, n_ctx, busy, self._live_seq_ids)

        for seq in [s for s in self.running if not s.is_decoding]:
            if step.budget == 0:
                break
            if seq.state is not SeqState.RUNNING:
                continue
            cap = min(seq.num_uncomputed, step.budget, n_ctx - seq.num_computed)
            cap = min(cap, self._stop(seq) - seq.num_computed)
            if cap <= 0:
                continue
            n = min(cap, self.admission.num_free(step, evict=True))
            if n == 0:
                if not self.admission.make_room(1, seq, step):
                    continue
                n = 1
            step.add(seq, n)

        i = 0
        while i < min(len(self.waiting), self._scan) and step.budget > 0:
            seq = self.waiting[i]
            match = self._match(seq)
            if seq.tier_wait or self.sharing.waits(seq, self.running, match):
                i += 1  # its prefix is being computed or read: it takes it in a later step
                continue
            if self.config.whole_prompts and seq.num_tokens > min(
                step.budget, self.admission.num_free(step, evict=False)
            ):
                break  # an encoder's input is read whole: it waits for a step with room
            if not self.admission.admit(seq, step, match):
                break
            del self.waiting[i]
            cap = min(seq.num_uncomputed, step.budget, n_ctx - seq.num_computed)
            cap = min(cap, self._stop(seq) - seq.num_computed)
            n = min(cap, self.admission.num_free(step, evict=False))
            if n > 0:
                step.add(seq, n)

        self.counters.last_num_decode = step.num_decode
        self.counters.last_num_prefill = step.num_prompt_rows
        return self._place(step)

    def update(self, plan: BatchPlan, out: StepOutput) -> list[Routed]:
        """Appends the sampled tokens, checks stop conditions, frees finished sequences."""
        assert len(out.token_ids) == len(plan.samples), "one sampled id per SampleRow"
        self.counters.num_steps += 1
        sampled = self._step.sampled
        i = 0
        while i < len(plan.samples):
            sample, seq = plan.samples[i], sampled[i]
            drafts = self._step.drafts.get(id(seq))
            if seq.state is not SeqState.RUNNING:
                pass
            elif drafts is not None:  # its k + 1 rows' samples are samples[i : i + k + 1]
                self.spec.verify(seq, drafts, plan.samples, out, i, self.memory, self._append_token)
            elif sample.embed:
                self._finish_embedding(seq, out, i)
            else:
                self._append_token(seq, sample, out, i)
            i += 1 if drafts is None else len(drafts) + 1
        self._step = Step(0)
        events, self._events = self._events, []
        return events

    def fail_plan(self, message: str) -> list[Routed]:
        """The worker raised on the last plan: every request with a sequence in it fails."""
        req_ids = {s.req_id for s in self._step.in_plan + self._step.sampled}
        for req_id in req_ids:
            self._finish_request(req_id, None, "error", message)
        self._step = Step(0)
        events, self._events = self._events, []
        return events

    def fail_seqs(self, errors: dict[int, str]) -> None:
        """The worker failed on these sequences of the last plan ({seq_id: error}): their
        requests finish with an error; update() then skips them and updates the rest."""
        for seq in [s for s in self._step.in_plan if s.seq_id in errors]:
            self._finish_request(seq.req_id, None, "error", errors[seq.seq_id])

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[Routed]:
        for req_id in list(self._requests):
            self._finish_request(req_id, None, reason, error)
        events, self._events = self._events, []
        return events

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last take (none without a ledger), the running sequences'
        blocks brought up to date first (Sharing.announce)."""
        if self.prefix.ledger is None:
            return []
        self.sharing.announce(self.running)
        return self.prefix.ledger.take()

    def clear_prefix_cache(self) -> None:
        self.seq_ids.clear_holders()
        if self.prefix.ledger is not None:
            self.prefix.ledger.cleared()

    def drop_adapter_cache(self, adapter_id: int) -> None:
        """Free the prefix cache's K/V computed under `adapter_id`: an unloaded LoRA adapter,
        whose id no new request selects (ids are never reused). Between steps only."""
        self.seq_ids.drop_adapter(adapter_id)

    # ---- placement ------------------------------------------------------------------------

    def _place(self, step: Step) -> BatchPlan:
        rows = step.rows
        num_tokens = step.num_scheduled
        token_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        seq_ids = np.empty(num_tokens, dtype=np.int64)
        seqs: list[SeqBatch] = []
        start = 0
        for seq, n in rows:
            p0 = seq.num_computed
            drafts = step.drafts.get(id(seq))
            if drafts:  # the last sampled token, then the drafted ones
                token_ids[start] = seq.tokens[p0]
                token_ids[start + 1 : start + n] = drafts
            else:
                token_ids[start : start + n] = seq.tokens[p0 : p0 + n]
            positions[start : start + n] = np.arange(p0, p0 + n)
            seq_ids[start : start + n] = seq.seq_id
            seqs.append(SeqBatch(seq.seq_id, start, start + n, seq.request.lora))
            start += n
        drafted = [seq.seq_id for seq, _ in rows if step.drafts.get(id(seq))]
        mplan = self.memory.plan(positions, seq_ids, drafted)
        assert mplan is not None, "room was made before placement"
        self.memory.apply(mplan)

        samples: list[SampleRow] = []
        for (seq, n), sb in zip(rows, seqs, strict=True):
            drafts = step.drafts.get(id(seq))
            if drafts:  # every row sampled; the drafts count once verified (spec.verify)
                seq.num_computed += 1
                for row in draft_rows(seq, sb.start, drafts):
                    samples.append(row)
                    step.sampled.append(seq)
                continue
            if seq.num_generated == 0 or seq.num_uncomputed > 1:
                self.counters.num_prompt_tokens += n
            else:
                self.counters.num_prompt_tokens += n - 1
            seq.num_computed += n
            if seq.num_uncomputed == 0:
                for choice in [seq, *self._fork(seq)]:
                    samples.append(make_sample_row(choice, sb.end - 1))
                    step.sampled.append(choice)
        views = [self.memory.views(sb.seq_id, positions[sb.start : sb.end]) for sb in seqs]
        groups = group_batches(self.memory, mplan, views, self.memory.take_pending())
        step.in_plan = [s for s, _ in rows]
        return BatchPlan(token_ids, positions, seq_ids, seqs, groups, samples)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        forks = choices.fork(seq, self.memory)
        for child in forks:
            self.admission.add_running(child)
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
            self._finish(seq, "error", error, grammar_error=True)
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

    def _live_seq_ids(self) -> set[int]:
        """Seq ids in use: running sequences' and prefix-cache holders'."""
        return {s.seq_id for s in self.running} | set(self.prefix.seq_ids)

    def _finish_embedding(self, seq: Sequence, out: StepOutput, i: int) -> None:
        vector = out.embeddings[i] if out.embeddings is not None else None
        if vector is None:
            self._finish(seq, "error", "the worker returned no embedding")
            return
        self._events.append((seq.req_id, EmbeddingEvent(seq.index, vector)))
        self._finish(seq, "stop")

    # ---- prefix sharing -------------------------------------------------------------------

    def _match(self, seq: Sequence) -> PrefixMatch:
        """The computed prefix `seq` would start from: a holder's or a running sequence's."""
        if not self.config.prefix_cache:
            return PrefixMatch(-1, 0)
        return self.sharing.match(seq, self.running)

    def _stop(self, seq: Sequence) -> int:
        """Where the prompt chunk of `seq` must end for the queued sequences that wait for it."""
        return self.sharing.next_stop(seq, itertools.islice(self.waiting, self._scan))

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

    def _finish(
        self, seq: Sequence, reason: str, error: str | None = None, grammar_error: bool = False
    ) -> None:
        if seq.state is SeqState.FINISHED:
            return
        seq = choices.leaving(seq, reason)
        if seq.parent is not None:
            choices.detach(seq, self.seq_ids)
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
            grammar_error=grammar_error,
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
        tokens = np.asarray(seq.tokens[:n], dtype=np.int64)
        req = seq.request
        self.seq_ids.retire(seq.seq_id, tokens, cache, req.lora, req.lora_name)

    @property
    def num_free_seq_ids(self) -> int:
        return self.seq_ids.num_free
