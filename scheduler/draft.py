"""The draft model of speculative decoding (scheduler/speculative.py's Drafter): a second model
with its own worker and its own memory (built from its own spec: it may be another
architecture), driven from the engine thread inside the scheduler's step. Torch-free: the
worker is any scheduler.plan.Worker (server/model_backend.py load_draft_model builds the real
one from model/).

Its cache mirrors each target sequence by seq id, lazily: `held[seq_id]` is the tokens its
cells hold at positions 0..n-1. Asked to draft for a sequence, it keeps the longest common
prefix of what it holds and the sequence's tokens (seq_rm of the rest: the drafts the target
rejected, a context shift, a seq id that now serves another request), or, where another
seq id holds a longer one (an n > 1 fork's parent, the prefix-cache holder a request was
served from), shares that one's cells with seq_cp; it feeds the remainder in one chunk, then
its own greedy tokens one row at a time, every asking sequence in one batch per row. Seq ids
no longer in use (neither running nor prefix-cache holders) are forgotten at the next call; a
full cache forgets the sequences that are not drafting first.

A recurrent or hybrid draft (Mamba2, Granite 4.0-H, LFM2: a state, not cells per token) cannot
forget its last tokens: its memory rolls a sequence back only to a state it kept (a checkpoint,
Memory.usable_prefix). Its memory has twice the target's seq ids (draft_memory): before a
sequence's draft rows, its state after the verified tokens is forked (seq_cp: the slot is
shared until the draft rows write a copy) to the seq id n_seq above it, the backup. When the
target accepts fewer than the rows fed, the sequence goes back to the best state any of its seq
ids keeps (its own tail, a checkpoint, the backup) and feeds the accepted drafts again in the
next catch-up chunk: one chunk of a few rows instead of a checkpoint per draft row.

NOTE: the draft's proposals are its argmax, points: the verification (the target sampling each
row as usual) is lossless whatever they are. The draft's cells are its own: what it shares
between seq ids is only what it computed itself.
"""

from __future__ import annotations

import numpy as np

from kvcache.make import make_memory
from kvcache.memory import Memory
from kvcache.spec import MemorySpec
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch, Worker, group_batches
from scheduler.prefix_cache import common_prefix_len

GREEDY = SamplingParams(temperature=0.0)
SHARE_MIN = 16  # tokens another seq id's cells must add before they are shared


def common_prefix(a: list[int], b: list[int]) -> int:
    return common_prefix_len(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def draft_memory(
    spec: MemorySpec, n_cells: int, n_seq: int, n_batch: int, n_ckpt: int | None = None
) -> Memory:
    """The draft's memory for a target of `n_seq` seq ids: a unified cache (sliding-window
    layers masked, so that its tail can go), with state slots for recurrent layers; twice the
    seq ids when it has them (DraftModel's backups), `n_ckpt` checkpoint slots beside them."""
    n_seq_max = 2 * n_seq if spec.has_recurrent else n_seq
    return make_memory(spec, n_cells, n_seq_max, n_batch, "unified", n_ckpt)


class DraftModel:
    def __init__(
        self,
        worker: Worker,
        memory: Memory,
        n_batch: int,
        vocab_limit: int | None = None,
        name: str = "draft",
        head_rows: int | None = None,
    ) -> None:
        # a memory that cannot forget any tail (recurrent states) keeps a backup per sequence
        # at seq id + n_seq (the module docstring)
        self.n_seq = memory.n_seq_max if memory.tail_rollback else memory.n_seq_max // 2
        if self.n_seq < 1:
            raise ValueError(f"a recurrent draft's memory needs 2 seq ids, got {memory.n_seq_max}")
        self.worker = worker
        self.memory = memory
        self.n_batch = n_batch
        # ids both models have rows for: a draft token past them ends the proposal, and a
        # sequence holding one (a target's padded vocabulary can be larger than the draft's
        # under the same tokenizer) gets no drafts from the token on
        self.vocab_limit = vocab_limit
        self.name = name
        # a reduced head (--draft-vocab): it scores ids below head_rows, and each step names the
        # drafting sequences' own ids above it (BatchPlan.head_ids): what a copy needs
        self.head_rows = head_rows
        self.held: dict[int, list[int]] = {}
        self.num_forwards = 0  # draft model steps run (stats, tests)
        self.num_rows = 0  # tokens fed to the draft model

    def propose(self, asks: list[tuple[int, list[int], int]], live: set[int]) -> list[list[int]]:
        for sid, _, _ in asks:
            if not 0 <= sid < self.n_seq:
                raise ValueError(f"seq id {sid} past the draft's {self.n_seq}")
        for sid in [s for s in self.held if s % self.n_seq not in live]:
            self._forget(sid)
        drafts: list[list[int]] = [[] for _ in asks]
        head_ids = self._ids_above_head(asks)
        # catch-up: each asking sequence feeds what its cells lack (at least its last token,
        # whose logits give the first draft) as long as the step's budget and the memory last
        feeds: list[tuple[int, list[int], int, bool]] = []  # (ask index, tokens, position, sample)
        budget = self.n_batch
        asking = {s + b for s, _, _ in asks for b in (0, self.n_seq)}
        for i, (sid, tokens, _) in enumerate(asks):
            if self.memory.tail_rollback:
                keep = min(self._share(sid, tokens), len(tokens) - 1)
                self._cut(sid, keep)
            else:
                keep = self._restore(sid, tokens)
            rest = tokens[keep:]
            if self.vocab_limit is not None and max(rest) >= self.vocab_limit:
                continue  # an id the draft has no embedding row for: it cannot follow
            planned = self.n_batch - budget
            n = min(len(rest), budget, self._room(asking) - planned)
            if n <= 0:
                continue
            feeds.append((i, rest[:n], keep, n == len(rest)))
            self.held[sid] = tokens[: keep + n]
            budget -= n
        active = self._run(asks, feeds, head_ids)
        self._take(active, drafts)
        if not self.memory.tail_rollback:
            for i in active:
                sid, _, k = asks[i]
                if k > 1:  # draft rows follow: keep the state they start from
                    self._fork(sid, sid + self.n_seq, len(self.held[sid]))
        # one row per still-drafting sequence: its newest draft in, the next one out
        while active:
            rows: list[tuple[int, list[int], int, bool]] = []
            for i, token in active.items():
                sid, _, k = asks[i]
                if len(drafts[i]) >= k or self._room(asking) - len(rows) < 1:
                    continue
                rows.append((i, [token], len(self.held[sid]), True))
                self.held[sid] = self.held[sid] + [token]
            active = self._take(self._run(asks, rows, head_ids), drafts)
        return drafts

    def _ids_above_head(self, asks: list[tuple[int, list[int], int]]) -> np.ndarray | None:
        """The distinct ids at or above a reduced head's rows in the asking sequences (None:
        the whole head)."""
        if self.head_rows is None or not asks:
            return None
        ids = np.unique(np.concatenate([np.asarray(t, dtype=np.int64) for _, t, _ in asks]))
        return ids[ids >= self.head_rows]

    def _take(self, got: dict[int, int], drafts: list[list[int]]) -> dict[int, int]:
        """Appends each new draft token; -> those still drafting (a token past the target's
        vocabulary ends its proposal, without it)."""
        keep = {}
        for i, token in got.items():
            if self.vocab_limit is not None and token >= self.vocab_limit:
                continue
            drafts[i].append(token)
            keep[i] = token
        return keep

    def _run(
        self,
        asks: list[tuple[int, list[int], int]],
        feeds: list[tuple[int, list[int], int, bool]],
        head_ids: np.ndarray | None,
    ) -> dict[int, int]:
        """One forward of the draft over `feeds` -> {ask index: greedy token} of the sampled
        ones; `head_ids`: what a reduced head scores beside its rows (BatchPlan.head_ids)."""
        if not feeds:
            return {}
        token_ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t, _, _ in feeds])
        positions = np.concatenate(
            [np.arange(p, p + len(t), dtype=np.int64) for _, t, p, _ in feeds]
        )
        seqs, samples, sampled, start = [], [], [], 0
        for i, tokens, _, sample in feeds:
            sid = asks[i][0]
            seqs.append(SeqBatch(sid, start, start + len(tokens)))
            if sample:
                samples.append(SampleRow(start + len(tokens) - 1, GREEDY, 0, 0, 0))
                sampled.append(i)
            start += len(tokens)
        seq_ids = np.concatenate([np.full(sb.end - sb.start, sb.seq_id) for sb in seqs])
        mplan = self.memory.plan(positions, seq_ids)
        assert mplan is not None, "room was checked"
        self.memory.apply(mplan)
        views = [self.memory.views(sb.seq_id, positions[sb.start : sb.end]) for sb in seqs]
        groups = group_batches(self.memory, mplan, views, self.memory.take_pending())
        plan = BatchPlan(token_ids, positions, seq_ids, seqs, groups, samples, head_ids)
        try:
            out = self.worker.execute(plan)
        except BaseException:
            for sb in seqs:  # what the failed rows left in its cells or state is not known
                if sb.seq_id in self.held:
                    self._forget(sb.seq_id)
            raise
        self.num_forwards += 1
        self.num_rows += plan.num_tokens
        return dict(zip(sampled, out.token_ids, strict=True))

    def _room(self, keep: set[int]) -> int:
        """Free cells; when the memory is full, after forgetting the sequences not in `keep`
        (planned rows are the caller's to subtract)."""
        if self.memory.num_free() < self.n_batch:
            for other in [s for s in self.held if s not in keep]:
                self._forget(other)
        return self.memory.num_free()

    def _share(self, sid: int, tokens: list[int]) -> int:
        """How much of `tokens` sid's cells hold, after taking another seq id's cells
        (seq_cp) where that one holds more of them."""
        have = common_prefix(self.held.get(sid, []), tokens)
        if len(tokens) - have <= SHARE_MIN:
            return have
        best, best_n = -1, have + SHARE_MIN
        for other, held in self.held.items():
            n = common_prefix(held, tokens) if other != sid else 0
            if n > best_n:
                best, best_n = other, n
        if best < 0:
            return have
        if sid in self.held:
            self._forget(sid)
        self.memory.seq_cp(best, sid, 0, best_n)
        self.held[sid] = tokens[:best_n]
        return best_n

    def _restore(self, sid: int, tokens: list[int]) -> int:
        """A memory without tail rollback: sid takes the longest state of `tokens` (but the
        last token, whose logits are wanted) that one of the seq ids keeps; -> its length."""
        limit = len(tokens) - 1
        best, best_n = sid, 0
        for other in sorted(self.held, key=lambda s: s != sid):  # sid first: it wins ties
            same = common_prefix(self.held[other], tokens)
            n = self.memory.usable_prefix(other, min(same, limit))
            if n > best_n:
                best, best_n = other, n
        if best_n == 0:
            if sid in self.held:
                self._forget(sid)
        elif best == sid:
            ok = self.memory.seq_rm(sid, best_n, -1)
            assert ok, "usable_prefix names a state seq_rm goes back to"
            self.held[sid] = tokens[:best_n]
        else:
            self._fork(best, sid, best_n)
        return best_n

    def _fork(self, src: int, dst: int, n: int) -> None:
        """dst holds src's first n tokens and nothing else."""
        if dst in self.held:
            self._forget(dst)
        self.memory.seq_cp(src, dst, 0, n)
        self.held[dst] = self.held[src][:n]

    def _cut(self, sid: int, n: int) -> None:
        held = self.held.get(sid)
        if held is not None and len(held) > n:
            self.memory.seq_rm(sid, n, -1)
            self.held[sid] = held[:n]

    def _forget(self, sid: int) -> None:
        self.memory.seq_rm(sid, -1, -1)
        del self.held[sid]
