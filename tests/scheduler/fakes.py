"""A fake worker whose output depends on what its cells actually hold, and test factories.

The worker keeps, per layer group of the plan, its own copy of each cell (token id, the
position its K was rotated to), applies the group's pending copies and K-shifts, writes the
new rows, and derives each sampled token from the tokens the row attends to in every group.
It checks that each row sees exactly its window: positions (q - W, q] of its context (all of
[0, q] for full attention). Wrong cell bookkeeping (a lost copy, a missed shift, a foreign
cell, a pruned cell still needed) changes the output or trips an assertion.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scheduler.config import EngineConfig
from scheduler.plan import BatchPlan, GroupBatch, SampleRow, SamplingParams, StepOutput
from scheduler.request import FinishEvent, Request, TokenEvent
from scheduler.scheduler import Routed, Scheduler

VOCAB = 97
STOP_ID = 0
_P = 2_147_483_629  # prime < 2**31: token * weight stays far inside int64
_WEIGHTS = np.array([pow(1_000_003, i, _P) for i in range(1 << 14)], dtype=np.int64)


def next_token(
    contexts: list[list[int] | np.ndarray], sample: SampleRow, hashes: tuple[int, ...] = ()
) -> int:
    """The fake model: a hash of the tokens each layer group attends, in position order (or
    a recurrent group's state: the same hash, accumulated token by token), plus a draw from
    the (seed, output_index) stream when sampling at temperature > 0."""
    total = sum(hashes)
    for context in contexts:
        ctx = np.asarray(context, dtype=np.int64)
        total += int((ctx * _WEIGHTS[: ctx.size]).sum() % _P)
    token = total % VOCAB
    if sample.params.temperature > 0:
        draw = random.Random(sample.seed * 1_000_003 + sample.output_index).randrange(VOCAB)
        token = (token + draw) % VOCAB
    while token in sample.suppress_ids:
        token = (token + 1) % VOCAB
    return token


class FakeStates:
    """A recurrent group's slots: each holds (hash of the tokens consumed, how many). The
    pending copies (src -1: zero) run first; each sequence then reads its slot, consumes its
    rows, fills its captures and leaves its state in the slot (scheduler/plan.py's contract).
    A wrong slot or a missed copy changes the hash; the count must equal the first row's
    position."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, int]] = {}

    def run(self, plan: BatchPlan, group: GroupBatch) -> np.ndarray:
        """-> [n_tokens]: each row's state hash after it is consumed."""
        p = group.pending
        assert p.shift_cells.size == 0 and group.seqs == []
        for src, dst in zip(p.copy_src.tolist(), p.copy_dst.tolist(), strict=True):
            self.slots[dst] = (0, 0) if src < 0 else self.slots[src]
        captures = {(c.seq, c.m): c.slot for c in group.captures}
        assert [(c.seq, c.m) for c in group.captures] == sorted(captures), "sorted captures"
        hashes = np.zeros(plan.num_tokens, dtype=np.int64)
        for i, sb in enumerate(plan.seqs):
            slot = int(group.cells[sb.start])
            assert (group.cells[sb.start : sb.end] == slot).all(), "one slot per sequence"
            h, n = self.slots[slot]
            assert n == plan.positions[sb.start], "the slot holds the state before the rows"
            for r in range(sb.start, sb.end):
                h = (h + int(plan.token_ids[r]) * int(_WEIGHTS[n])) % _P
                n += 1
                hashes[r] = h
                if (i, n) in captures:
                    self.slots[captures.pop((i, n))] = (h, n)
            self.slots[slot] = (h, n)
        assert not captures, f"captures outside their sequence's rows: {captures}"
        return hashes


class FakeWorker:
    def __init__(
        self,
        n_cells: int,
        fail_when: Callable[[BatchPlan], bool] | None = None,
        model: Callable[..., int] | None = None,
    ) -> None:
        self.n_cells = n_cells  # at least the largest pool
        self.model = next_token if model is None else model  # next_token's signature
        self.token: list[np.ndarray] = []  # per group: the token each cell holds
        self.k_pos: list[np.ndarray] = []  # per group: the position its K is rotated for
        self.states = FakeStates()  # the recurrent group's, if any
        self.fail_when = fail_when
        self.num_calls = 0

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.num_calls += 1
        if self.fail_when is not None and self.fail_when(plan):
            raise RuntimeError("injected worker failure")
        while len(self.token) < len(plan.groups):
            self.token.append(np.full(self.n_cells, -1, dtype=np.int64))
            self.k_pos.append(np.full(self.n_cells, -1, dtype=np.int64))
        row_seq = np.full(plan.num_tokens, -1, dtype=np.int64)
        for i, sb in enumerate(plan.seqs):
            assert (plan.seq_ids[sb.start : sb.end] == sb.seq_id).all()
            row_seq[sb.start : sb.end] = i
        state_hashes = None
        for g, group in enumerate(plan.groups):
            if group.key == "recurrent":
                state_hashes = self.states.run(plan, group)
                continue
            p = group.pending
            top = max([int(group.cells.max(initial=-1)), *p.copy_dst.tolist(), -1]) + 1
            if top > self.token[g].shape[0]:  # a pool larger than n_cells (iSWA's index room)
                grow = np.full(top - self.token[g].shape[0], -1, dtype=np.int64)
                self.token[g] = np.concatenate([self.token[g], grow])
                self.k_pos[g] = np.concatenate([self.k_pos[g], grow])
            token, k_pos = self.token[g], self.k_pos[g]
            for src, dst in zip(p.copy_src.tolist(), p.copy_dst.tolist(), strict=True):
                token[dst] = token[src]
                k_pos[dst] = k_pos[src]
            np.add.at(k_pos, p.shift_cells, p.shift_deltas)
            token[group.cells] = plan.token_ids
            k_pos[group.cells] = plan.positions
            for sb, view in zip(plan.seqs, group.seqs, strict=True):
                assert (np.diff(view.kv_pos) > 0).all(), "kv_pos sorted, one cell per position"
                assert np.isin(group.cells[sb.start : sb.end], view.kv_cells).all()
                assert view.lo.shape == view.hi.shape == (sb.end - sb.start,)
        out: list[int] = []
        for sample in plan.samples:
            i = int(row_seq[sample.row])
            q = int(plan.positions[sample.row])
            contexts = []
            for g, group in enumerate(plan.groups):
                if group.key == "recurrent":
                    continue
                view = group.seqs[i]
                r = sample.row - plan.seqs[i].start
                cells = view.kv_cells[view.lo[r] : view.hi[r]]
                seen = view.kv_pos[view.lo[r] : view.hi[r]]
                first = max(0, q - group.window + 1) if group.window else 0
                assert (seen == np.arange(first, q + 1)).all(), "the row sees exactly its window"
                assert (self.k_pos[g][cells] == seen).all(), "K rotated to its position"
                contexts.append(self.token[g][cells])
            hashes = () if state_hashes is None else (int(state_hashes[sample.row]),)
            out.append(self.model(contexts, sample, hashes))
        return StepOutput(token_ids=out)


def make_config(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(n_cells=256, n_seq_max=8, n_batch=64, n_ctx_seq=128, seed=0)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def make_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def make_request(
    req_id: str, prompt_len: int = 20, max_tokens: int = 8, seed: int = 0, **kw: object
) -> Request:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    kw.setdefault("ignore_eos", True)
    kw.setdefault("stop_token_ids", frozenset({STOP_ID}))
    return Request(req_id, make_prompt(prompt_len, seed), max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


@dataclass
class Outcome:
    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    finish: dict[tuple[str, int], FinishEvent] = field(default_factory=dict)
    num_steps: int = 0

    def add(self, routed: list[Routed]) -> None:
        for req_id, ev in routed:
            key = (req_id, ev.index)
            assert key not in self.finish, f"event after finish: {key}"
            if isinstance(ev, TokenEvent):
                self.tokens.setdefault(key, []).append(ev.token_id)
            else:
                self.finish[key] = ev


def step(sched: Scheduler, worker: FakeWorker, outcome: Outcome) -> BatchPlan:
    """One checked step: the budget holds, the cells stay consistent."""
    plan = sched.schedule()
    sched.memory.check()
    assert plan.num_tokens <= sched.config.n_batch
    assert plan.num_tokens == 0 or plan.positions.max() < sched.config.n_ctx_seq
    out = worker.execute(plan) if plan.num_tokens else StepOutput(token_ids=[])
    outcome.add(sched.update(plan, out))
    sched.memory.check()
    outcome.num_steps += 1
    return plan


def run(
    sched: Scheduler, worker: FakeWorker, requests: list[Request], max_steps: int = 10_000
) -> Outcome:
    outcome = Outcome()
    for r in requests:
        sched.add_request(r)
    while sched.has_work:
        step(sched, worker, outcome)
        assert outcome.num_steps < max_steps, "no progress"
    return outcome


def make_scheduler(**kw: object) -> tuple[Scheduler, FakeWorker]:
    config = make_config(**kw)
    return Scheduler(config), FakeWorker(config.n_cells)


def reference_output(
    req: Request, n_ctx_seq: int, choice: int = 0, windows: tuple[int, ...] = (0,)
) -> tuple[list[int], int]:
    """What a correct engine generates for one choice of `req` with the fake model, computed
    without any cache: (tokens streamed, number of context shifts). `windows`: each layer
    group's (0: full attention). Needs a seeded or greedy request and a prompt shorter than
    n_ctx_seq."""
    assert req.sampling.temperature == 0 or req.sampling.seed is not None
    seed = (req.sampling.seed or 0) + choice
    ctx = list(req.prompt_ids)
    out: list[int] = []
    num_shifts = 0
    n_keep = max(0, min(req.n_keep, n_ctx_seq - 4))
    while len(out) < req.max_tokens:
        if len(ctx) - 1 >= n_ctx_seq:
            n_left = len(ctx) - 1 - n_keep
            n_discard = req.n_discard if req.n_discard is not None else n_left // 2
            n_discard = max(1, min(n_discard, n_left))
            del ctx[n_keep : n_keep + n_discard]
            num_shifts += 1
        early = len(out) < req.min_tokens and not req.ignore_eos
        suppress = tuple(sorted(req.stop_token_ids)) if early else ()
        row = SampleRow(0, req.sampling, seed, len(out), len(req.prompt_ids), None, suppress)
        token = next_token([ctx[-w:] if w else ctx for w in windows], row)
        if token in req.stop_token_ids and not req.ignore_eos:
            break
        out.append(token)
        ctx.append(token)
    return out, num_shifts
