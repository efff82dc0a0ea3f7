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

NOTE: the draft's proposals are its argmax, points: the verification (the target sampling each
row as usual) is lossless whatever they are. The draft's cells are its own: what it shares
between seq ids is only what it computed itself.
"""

from __future__ import annotations

import numpy as np

from kvcache.memory import Memory
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch, Worker, group_batches
from scheduler.prefix_cache import common_prefix_len

GREEDY = SamplingParams(temperature=0.0)
SHARE_MIN = 16  # tokens another seq id's cells must add before they are shared


def common_prefix(a: list[int], b: list[int]) -> int:
    return common_prefix_len(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


class DraftModel:
    def __init__(
        self,
        worker: Worker,
        memory: Memory,
        n_batch: int,
        vocab_limit: int | None = None,
        name: str = "draft",
    ) -> None:
        if not memory.tail_rollback:
            raise ValueError(
                f"the draft model's memory ({type(memory).__name__}) cannot forget a "
                "sequence's last tokens: a recurrent or hybrid model cannot be the draft"
            )
        self.worker = worker
        self.memory = memory
        self.n_batch = n_batch
        # ids both models have rows for: a draft token past them ends the proposal, and a
        # sequence holding one (a target's padded vocabulary can be larger than the draft's
        # under the same tokenizer) gets no drafts from the token on
        self.vocab_limit = vocab_limit
        self.name = name
        self.held: dict[int, list[int]] = {}
        self.num_forwards = 0  # draft model steps run (stats, tests)
        self.num_rows = 0  # tokens fed to the draft model

    def propose(self, asks: list[tuple[int, list[int], int]], live: set[int]) -> list[list[int]]:
        for sid in [s for s in self.held if s not in live]:
            self._forget(sid)
        drafts: list[list[int]] = [[] for _ in asks]
        # catch-up: each asking sequence feeds what its cells lack (at least its last token,
        # whose logits give the first draft) as long as the step's budget and the memory last
        feeds: list[tuple[int, list[int], int, bool]] = []  # (ask index, tokens, position, sample)
        budget = self.n_batch
        asking = {s for s, _, _ in asks}
        for i, (sid, tokens, _) in enumerate(asks):
            keep = min(self._share(sid, tokens), len(tokens) - 1)
            self._cut(sid, keep)
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
        active = self._run(asks, feeds)
        self._take(active, drafts)
        # one row per still-drafting sequence: its newest draft in, the next one out
        while active:
            rows: list[tuple[int, list[int], int, bool]] = []
            for i, token in active.items():
                sid, _, k = asks[i]
                if len(drafts[i]) >= k or self._room(asking) - len(rows) < 1:
                    continue
                rows.append((i, [token], len(self.held[sid]), True))
                self.held[sid] = self.held[sid] + [token]
            active = self._take(self._run(asks, rows), drafts)
        return drafts

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
        self, asks: list[tuple[int, list[int], int]], feeds: list[tuple[int, list[int], int, bool]]
    ) -> dict[int, int]:
        """One forward of the draft over `feeds` -> {ask index: greedy token} of the sampled
        ones."""
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
        plan = BatchPlan(token_ids, positions, seq_ids, seqs, groups, samples)
        out = self.worker.execute(plan)
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

    def _cut(self, sid: int, n: int) -> None:
        held = self.held.get(sid)
        if held is not None and len(held) > n:
            self.memory.seq_rm(sid, n, -1)
            self.held[sid] = held[:n]

    def _forget(self, sid: int) -> None:
        self.memory.seq_rm(sid, -1, -1)
        del self.held[sid]
