"""A fake worker whose output depends on what its cells actually hold, and test factories.

The worker keeps its own copy of each cell (token id, the position its K was rotated to),
applies the plan's pending copies and K-shifts, writes the new rows, and derives each
sampled token from the tokens the row attends to. Wrong cell bookkeeping (a lost copy, a
missed shift, a foreign cell) changes the output or trips an assertion.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scheduler.config import EngineConfig
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, StepOutput
from scheduler.request import FinishEvent, Request, TokenEvent
from scheduler.scheduler import Routed, Scheduler

VOCAB = 97
STOP_ID = 0
_P = 2_147_483_629  # prime < 2**31: token * weight stays far inside int64
_WEIGHTS = np.array([pow(1_000_003, i, _P) for i in range(1 << 14)], dtype=np.int64)


def next_token(context: list[int] | np.ndarray, sample: SampleRow) -> int:
    """The fake model: a hash of the attended tokens in position order, plus a draw from
    the (seed, output_index) stream when sampling at temperature > 0."""
    ctx = np.asarray(context, dtype=np.int64)
    token = int((ctx * _WEIGHTS[: ctx.size]).sum() % _P) % VOCAB
    if sample.params.temperature > 0:
        draw = random.Random(sample.seed * 1_000_003 + sample.output_index).randrange(VOCAB)
        token = (token + draw) % VOCAB
    while token in sample.suppress_ids:
        token = (token + 1) % VOCAB
    return token


class FakeWorker:
    def __init__(self, n_cells: int, fail_when: Callable[[BatchPlan], bool] | None = None) -> None:
        self.token = np.full(n_cells, -1, dtype=np.int64)
        self.k_pos = np.full(n_cells, -1, dtype=np.int64)  # the position K is rotated for
        self.fail_when = fail_when
        self.num_calls = 0

    def execute(self, plan: BatchPlan) -> StepOutput:
        self.num_calls += 1
        if self.fail_when is not None and self.fail_when(plan):
            raise RuntimeError("injected worker failure")
        p = plan.pending
        for src, dst in zip(p.copy_src.tolist(), p.copy_dst.tolist(), strict=True):
            self.token[dst] = self.token[src]
            self.k_pos[dst] = self.k_pos[src]
        np.add.at(self.k_pos, p.shift_cells, p.shift_deltas)
        self.token[plan.cells] = plan.token_ids
        self.k_pos[plan.cells] = plan.positions

        row_seq = np.full(plan.num_tokens, -1, dtype=np.int64)
        for i, sb in enumerate(plan.seqs):
            assert (plan.seq_ids[sb.start : sb.end] == sb.seq_id).all()
            assert (np.diff(sb.kv_pos) > 0).all(), "kv_pos sorted, one cell per position"
            assert np.isin(plan.cells[sb.start : sb.end], sb.kv_cells).all()
            row_seq[sb.start : sb.end] = i
        out: list[int] = []
        for sample in plan.samples:
            sb = plan.seqs[int(row_seq[sample.row])]
            mask = sb.kv_pos <= plan.positions[sample.row]
            cells = sb.kv_cells[mask]
            assert (self.k_pos[cells] == sb.kv_pos[mask]).all(), "K rotated to its position"
            assert (sb.kv_pos[mask] == np.arange(mask.sum())).all(), "dense positions from 0"
            out.append(next_token(self.token[cells], sample))
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
    sched.cells.check()
    assert plan.num_tokens <= sched.config.n_batch
    assert plan.num_tokens == 0 or plan.positions.max() < sched.config.n_ctx_seq
    out = worker.execute(plan) if plan.num_tokens else StepOutput(token_ids=[])
    outcome.add(sched.update(plan, out))
    sched.cells.check()
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


def reference_output(req: Request, n_ctx_seq: int, choice: int = 0) -> tuple[list[int], int]:
    """What a correct engine generates for one choice of `req` with the fake model, computed
    without any cache: (tokens streamed, number of context shifts). Needs a seeded or greedy
    request and a prompt shorter than n_ctx_seq."""
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
        token = next_token(ctx, row)
        if token in req.stop_token_ids and not req.ignore_eos:
            break
        out.append(token)
        ctx.append(token)
    return out, num_shifts
