"""Speculative decoding inside continuous batching: which sequences draft, how many tokens,
what they propose (n-gram / prompt lookup), and what the verification accepted.

A drafted sequence feeds its last token and k drafted tokens as k + 1 rows at consecutive
positions (a prompt chunk's causal mask over them), and every row is sampled. Row j is sampled
exactly as output index num_generated + j would be without speculation: the same
(seed, output_index) random stream (scheduler/plan.py SampleRow), the same history (the
drafts before it) and the same processors. Token j + 1 is accepted while row j's sample equals
draft j; the first sample that differs is emitted as the correction and the rest is dropped,
the rejected drafts' cells with `seq_rm(seq, p_accept, -1)`.

NOTE: lossless at every temperature: the emitted token of each position IS the target's sample
for it (a draft only decides how many positions one forward verifies). For proposals that are
points (an n-gram continuation, a draft model's argmax) this is speculative sampling's rule
with q = a point mass: d is accepted with probability p(d), else the token comes from p
without d, renormalised. With a seed, the text is the same as without speculation token for
token, up to the floating-point differences of computing a row in a batch of k + 1
(--batch-invariant removes those).

Structured outputs: a grammar cuts a proposal at its first token the grammar rejects (or
after the one that completes it), and each drafted row is sampled under the mask of a copy of
the matcher that has consumed the drafts before it.

Proposers: n-gram lookup (prompt lookup: free to propose, right where the text repeats itself),
a draft model (scheduler/draft.py: a forward of its own per drafted token), or both, the lookup
first and the draft model for the sequences it has nothing for (llama.cpp's
`--spec-type ngram-simple,draft-simple`). Each keeps its own pace per sequence.

Every memory rolls back, within its Memory.rollback_rows: the unified and iSWA caches any
number of rows (the iSWA pools prune against a sequence's newest position before a step's rows,
never against the drafts); a recurrent or hybrid memory's state consumes the drafts for good,
so the drafted sequences' rows are placed with plan(..., rollback=) and leave a checkpoint of
the state before each drafted row: a step drafts at most as many tokens as the memory has
free checkpoint slots for (--state-checkpoints), and Memory.seq_commit drops the checkpoints
once verified.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import numpy as np

from kvcache.memory import Memory
from scheduler.plan import SampleRow, StepOutput
from scheduler.sequence import Pace, SeqState, Sequence, make_sample_row
from scheduler.step import Step

# "ngram,draft": the n-gram lookup proposes first, the draft model where it finds nothing
# (llama.cpp's `--spec-type ngram-simple,draft-simple`: the draftless type has precedence)
SpecType = Literal["none", "ngram", "draft", "ngram,draft"]
SPEC_TYPES: dict[str, str] = {  # llama.cpp's spellings too
    "none": "none",
    "ngram": "ngram",
    "ngram-simple": "ngram",
    "draft": "draft",
    "draft-simple": "draft",
}


def parse_spec_type(text: str, with_draft_model: bool) -> SpecType:
    """A comma-separated list of types (llama.cpp's `--spec-type`) -> the kind in effect; a
    draft model adds "draft" unless the list says none. ValueError names an unknown type."""
    names = [t.strip() for t in text.split(",") if t.strip()] or ["none"]
    unknown = [t for t in names if t not in SPEC_TYPES]
    if unknown:
        raise ValueError(f"spec type {unknown[0]!r}: use one of {sorted(SPEC_TYPES)}, or a list")
    kinds = {SPEC_TYPES[t] for t in names}
    if "none" in kinds:
        if len(kinds) > 1:
            raise ValueError(f"spec type none with others: {text!r}")
        return "none"
    if with_draft_model:
        kinds.add("draft")
    return "ngram,draft" if kinds == {"ngram", "draft"} else kinds.pop()  # type: ignore[return-value]


class Drafter(Protocol):
    """A draft model beside the target (scheduler/draft.py; fakes in tests)."""

    def propose(self, asks: list[tuple[int, list[int], int]], live: set[int]) -> list[list[int]]:
        """asks: (seq_id, the sequence's tokens, k) -> up to k greedy draft tokens each.
        `live`: the seq ids in use; whatever the drafter keeps for others may go."""
        ...


MAX_SKIP = 32  # decode steps a sequence whose drafts keep failing waits at most


@dataclass(slots=True)
class SpecConfig:
    kind: SpecType = "none"
    draft_max: int = 16  # tokens drafted for one sequence in one step
    draft_min: int = 0  # a proposal shorter than this is not verified (llama.cpp's --draft-min)
    # n-gram lookup: the longest suffix of the context (ngram_max tokens, down to ngram_min)
    # that occurred before proposes what followed it. Replaying the code-edit workload's
    # greedy outputs (bench/spec_bench.py's prompts, Qwen2.5-Coder-1.5B), 3..12 accepted
    # 3.27 tokens a verification step against 2.66 with 2..4 and drafted fewer tokens: a
    # two-token suffix matches too often by chance, a longer one finds the right copy.
    ngram_min: int = 3
    ngram_max: int = 12
    # drafted rows a step may add while few sequences run: draft tokens of one step
    # <= step_rows - (running + waiting sequences), so under load nothing is drafted (steps
    # that are already compute-bound would only get slower)
    step_rows: int = 17
    # a draft model drafts only while at most this many sequences run or wait: each draft
    # token is a sequential forward of the draft that the whole step waits for, and each new
    # sequence first reads its prompt into the draft (measured on a 2-core Zen 5 with
    # Qwen2.5-Coder 1.5B / 0.5B: the draft at c=8 cost 30% of the throughput)
    draft_seqs_max: int = 2

    @property
    def lookup(self) -> bool:
        """The n-gram lookup proposes (first, where a draft model is there too)."""
        return self.kind in ("ngram", "ngram,draft")

    @property
    def uses_draft_model(self) -> bool:
        return self.kind in ("draft", "ngram,draft")

    def validate(self) -> None:
        if self.kind not in ("none", "ngram", "draft", "ngram,draft"):
            raise ValueError(f"unknown spec type {self.kind!r}")
        if not 0 <= self.draft_min <= self.draft_max or self.draft_max > 256:
            raise ValueError(
                f"need 0 <= draft_min ({self.draft_min}) <= draft_max ({self.draft_max}) <= 256"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max: {self}")
        if self.step_rows < 0 or self.draft_seqs_max < 0:
            raise ValueError(f"step_rows must be >= 0: {self}")


@dataclass(slots=True)
class SpecStats:
    """Cumulative (vLLM's spec_decode counters): rounds = drafted sequences verified."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts + the target's own token of each round
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: rounds accepting draft i
    acceptance_lengths: list[int] = field(default_factory=list)  # [a]: rounds accepting a
    # per proposer ("ngram", "draft"): [draft tokens verified, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)


def ngram_propose(tokens: Seq[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the
    context's last n tokens (n from n_max down to n_min); [] without one."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # start i of a match: arr[i:i + n] == the last n, with i + n < size (something follows)
        hit = arr[: size - n] == arr[size - n]
        for j in range(1, n):
            hit &= arr[j : size - n + j] == arr[size - n + j]
        found = np.flatnonzero(hit)
        if found.size:
            i = int(found[-1]) + n
            return arr[i : i + k].tolist()
    return []


class Speculator:
    """The scheduler's drafting policy and statistics."""

    def __init__(self, config: SpecConfig, rollback: bool, drafter: Drafter | None = None) -> None:
        """`rollback`: whether the memory can take drafted rows back at all (its
        Memory.rollback_rows when empty); one that cannot never drafts."""
        config.validate()
        if config.uses_draft_model and drafter is None and rollback:
            raise ValueError(f"speculative decoding of type {config.kind} needs a draft model")
        self.config = config
        self.drafter = drafter
        self.enabled = config.kind != "none" and config.draft_max > 0 and rollback
        self.stats = SpecStats(
            accepted_per_pos=[0] * config.draft_max,
            acceptance_lengths=[0] * (config.draft_max + 1),
            by_source={s: [0, 0] for s in ("ngram", "draft") if s in config.kind},
        )

    def snapshot(self) -> SpecStats | None:
        """A copy of the counters; None when speculation is off."""
        if not self.enabled:
            return None
        s = self.stats
        return replace(
            s,
            accepted_per_pos=list(s.accepted_per_pos),
            acceptance_lengths=list(s.acceptance_lengths),
            by_source={k: list(v) for k, v in s.by_source.items()},
        )

    def step_budget(self, num_seqs: int) -> int:
        """Draft tokens the next step may take."""
        if not self.enabled:
            return 0
        if self.config.kind == "draft" and not self.draft_model_on(num_seqs):
            return 0
        return max(0, self.config.step_rows - num_seqs)

    def draft_model_on(self, num_seqs: int) -> bool:
        """Whether the draft model drafts while `num_seqs` sequences run or wait."""
        return self.config.uses_draft_model and num_seqs <= self.config.draft_seqs_max

    def limit(self, seq: Sequence, source: str) -> int:
        """How many tokens `seq` may draft now from `source` ("ngram" or "draft"): the
        request's cap, then what that proposer's recent acceptance earned for it (doubling
        after a fully accepted round, else one more than the last round accepted; after n
        rounds in a row that accepted nothing, it sits out 2^(n-1) decode steps, at most
        MAX_SKIP). Each proposer keeps its own pace: n-gram misses do not slow the draft
        model that takes over while the lookup sits out."""
        req = seq.request
        if req.embed:
            return 0
        cap = self.config.draft_max if req.draft_max is None else min(req.draft_max, 256)
        pace = seq.pace.get(source)
        if pace is None:
            pace = seq.pace[source] = Pace(k=cap)
        if pace.skip > 0:
            pace.skip -= 1
            return 0
        return min(cap, pace.k)

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """The n-gram proposal for `seq` (at most k tokens; [] when shorter than draft_min)."""
        c = self.config
        got = ngram_propose(seq.tokens, c.ngram_min, c.ngram_max, k)
        return got if len(got) >= max(c.draft_min, 1) else []

    def ask_draft_model(
        self, asks: list[tuple[Sequence, int]], live: Callable[[], set[int]]
    ) -> list[list[int]]:
        """The draft model's greedy tokens, up to k for each (seq, k) (a proposal shorter
        than draft_min is []). `live()`: the seq ids in use."""
        assert self.drafter is not None
        got = self.drafter.propose([(s.seq_id, s.tokens, k) for s, k in asks], live())
        shortest = max(self.config.draft_min, 1)
        return [d[:k] if len(d) >= shortest else [] for d, (_, k) in zip(got, asks, strict=True)]

    def add_drafts(
        self,
        step: Step,
        free: int,
        rollback_rows: int,
        n_ctx: int,
        num_seqs: int,
        live: Callable[[], set[int]],
    ) -> None:
        """The decode rows' sequences draft, in order, within the step's draft budget (from
        `num_seqs`, the sequences running or waiting), its token budget, `free` cells and
        the memory's `rollback_rows`, before their context limit and their max_tokens; a
        grammar cuts its sequence's proposal. `live()`: the seq ids in use (asked only by a
        draft model)."""
        budget = min(self.step_budget(num_seqs), rollback_rows)
        room = min(step.budget, free)
        lookup = self.config.lookup
        drafting = self.draft_model_on(num_seqs)
        proposed: list[tuple[int, Sequence, list[int]]] = []  # (index in step.rows, seq, drafts)
        asks: list[tuple[int, Sequence, int]] = []  # the draft model's: (index, seq, k)
        for index, (seq, _) in enumerate(step.rows[: step.num_decode]):
            bound = min(
                budget,
                room,
                n_ctx - 1 - seq.num_computed,
                seq.request.max_tokens - seq.num_generated - 1,
            )
            if bound <= 0:
                continue
            # the lookup first: it costs nothing to propose; the draft model where it has none
            k = min(bound, self.limit(seq, "ngram")) if lookup else 0
            got = self.lookup(seq, k) if k > 0 else []
            if got:
                proposed.append((index, seq, got))
                seq.spec_from = "ngram"
                budget, room = budget - len(got), room - len(got)
                continue
            k = min(bound, self.limit(seq, "draft")) if drafting else 0
            if k > 0:
                asks.append((index, seq, k))
                seq.spec_from = "draft"
                budget, room = budget - k, room - k
        if asks:
            got_all = self.ask_draft_model([(seq, k) for _, seq, k in asks], live)
            proposed += [(i, seq, d) for (i, seq, _), d in zip(asks, got_all, strict=True)]
        for index, seq, proposal in sorted(proposed, key=lambda t: t[0]):
            drafts = grammar_cut(seq, proposal)
            if drafts:
                step.extend(index, len(drafts))
                step.drafts[id(seq)] = drafts

    def verify(
        self,
        seq: Sequence,
        drafts: list[int],
        samples: list[SampleRow],
        out: StepOutput,
        i: int,
        memory: Memory,
        append: Callable[[Sequence, SampleRow, StepOutput, int], None],
    ) -> None:
        """A drafted sequence's k + 1 samples (from samples[i]): the rejected drafts' cells
        go, then the accepted drafts and the target's own token are appended one by one by
        `append` (the scheduler's: stop conditions apply to each), then the memory drops
        what it kept for the rollback (Memory.seq_commit)."""
        p = seq.num_computed  # its drafts sit at positions p .. p + k - 1
        k = len(drafts)
        a = accepted_count(drafts, out.token_ids[i : i + k])
        sid = seq.seq_id
        if a < k:
            ok = memory.seq_rm(sid, p + a, -1)
            assert ok, "rows placed with plan(..., rollback=) roll back"
        emitted = 0
        for j in range(a + 1):
            seq.num_computed = p + j  # the cells of every token but the one appended now
            append(seq, samples[i + j], out, i + j)
            emitted += 1
            if seq.state is not SeqState.RUNNING:
                break  # finished: retiring the seq id cuts its cells to num_computed
        memory.seq_commit(sid)  # NOTE: after retiring, which may roll back further
        self.record(seq, k, a, emitted)

    def record(self, seq: Sequence, k: int, accepted: int, emitted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += k
        s.num_accepted_tokens += accepted
        s.num_emitted_tokens += emitted
        for i in range(min(accepted, len(s.accepted_per_pos))):
            s.accepted_per_pos[i] += 1
        s.acceptance_lengths[min(accepted, len(s.acceptance_lengths) - 1)] += 1
        source = seq.spec_from
        counts = s.by_source.setdefault(source, [0, 0])
        counts[0] += k
        counts[1] += accepted
        pace = seq.pace.setdefault(source, Pace())
        cap = self.config.draft_max
        pace.k = min(cap, 2 * k) if accepted == k else accepted + 1
        # a round that accepted nothing cost rows for nothing: sit out 1, 2, 4 ... 32 steps
        pace.misses = pace.misses + 1 if accepted == 0 else 0
        pace.skip = min(1 << (pace.misses - 1), MAX_SKIP) if pace.misses else 0


def grammar_cut(seq: Sequence, drafts: list[int]) -> list[int]:
    """The drafts a structured output's grammar admits: up to the first it rejects, and none
    after the one that completes it."""
    if seq.constraint is None or not drafts:
        return drafts
    probe = seq.constraint.fork()
    for j, token in enumerate(drafts):
        if probe.advance(token) is not None:
            return drafts[:j]
        if probe.is_done:
            return drafts[: j + 1]
    return drafts


def draft_rows(seq: Sequence, start: int, drafts: list[int]) -> list[SampleRow]:
    """The k + 1 sample rows of a drafted sequence whose rows start at `start`: row j is
    sampled as output index num_generated + j (its history holds the drafts before it, its
    grammar's matcher has consumed them)."""
    first = make_sample_row(seq, start)
    req = seq.request
    constraints = [seq.constraint]
    for token in drafts if seq.constraint is not None else []:
        after = constraints[-1].fork()  # type: ignore[union-attr]
        after.advance(token)  # admitted: grammar_cut checked every draft
        constraints.append(after)
    out = []
    for j in range(len(drafts) + 1):
        history = None if first.history is None else first.history + drafts[:j]
        n_out = seq.num_generated + j
        suppress = first.suppress_ids
        if suppress and n_out >= req.min_tokens:
            suppress = ()
        out.append(
            replace(
                first,
                row=start + j,
                output_index=n_out,
                history=history,
                suppress_ids=suppress,
                constraint=constraints[j] if seq.constraint is not None else None,
            )
        )
    return out


def accepted_count(drafts: list[int], sampled: Seq[int]) -> int:
    """Drafts accepted: while row j's sample equals draft j."""
    a = 0
    while a < len(drafts) and int(sampled[a]) == drafts[a]:
        a += 1
    return a
