"""One choice of a request as the scheduler tracks it: its tokens, cache progress and seq id."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.constraint import Constraint
from scheduler.plan import SampleRow
from scheduler.request import Request


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Pace:
    """How one proposer (n-gram lookup, a draft model) drafts for one sequence."""

    k: int = -1  # tokens it may draft next (-1: not drafted yet)
    skip: int = 0  # decode steps it still sits out after rounds that accepted nothing
    misses: int = 0  # consecutive rounds that accepted nothing


@dataclass(slots=True, eq=False)
class Sequence:
    """`tokens` is the context the cache holds (or will hold) for this sequence: token i sits
    at position i. A context shift deletes a slice of it, so positions stay dense; `output_ids`
    keeps every generated token for the client and for penalties.

    NOTE: invariant while RUNNING: the cache holds tokens[:num_computed] at positions
    0..num_computed-1 under `seq_id`, and nothing else under that id.
    """

    request: Request
    index: int  # choice index
    seed: int
    prompt_ids: list[int]  # what the model reads (after any truncation)
    tokens: list[int]
    submit_time: float
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    seq_id: int = -1
    state: SeqState = SeqState.WAITING
    admit_order: int = -1  # bigger = admitted later; the preemption victim is the biggest
    num_cached: int = 0  # prompt tokens served by the prefix cache at first admission
    queue_time: float | None = None
    num_shifts: int = 0
    num_preemptions: int = 0
    # choices 1..n-1 while choice 0 reads the shared prompt; forked by seq_cp when it is done
    forks: list[Sequence] = field(default_factory=list)
    parent: Sequence | None = None  # set on a choice that waits in its parent's `forks`
    constraint: Constraint | None = None  # the request's grammar; has consumed output_ids
    # speculative decoding (scheduler/speculative.py): each proposer's pace for this
    # sequence, and which one proposed the drafts being verified
    pace: dict[str, Pace] = field(default_factory=dict)
    spec_from: str = ""
    # the prefix cache's second tier (scheduler/cache_tier.py): looked up once; queued while
    # a stored entry it will take is read
    tier_checked: bool = False
    tier_wait: bool = False

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """The prompt (and any recomputed output) is in the cache: one token left to feed."""
        return self.num_generated > 0 and self.num_uncomputed == 1

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_seq_ids(self) -> int:
        return 1 + len(self.forks)


def make_sample_row(seq: Sequence, row: int) -> SampleRow:
    req = seq.request
    params = req.sampling
    history = seq.prompt_ids + seq.output_ids if params.needs_history else None
    suppress: tuple[int, ...] = ()
    if seq.num_generated < req.min_tokens and not req.ignore_eos:
        suppress = tuple(sorted(req.stop_token_ids))
    return SampleRow(
        row=row,
        params=params,
        seed=seq.seed,
        output_index=seq.num_generated,
        num_prompt=seq.num_prompt,
        history=history,
        suppress_ids=suppress,
        embed=req.embed,
        constraint=seq.constraint,
    )
