"""Embedding requests: prompt-only sequences that finish with their last row's vector, share
steps with generating requests without changing them, and leave no cells behind."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.errors import PromptError
from scheduler.plan import BatchPlan, StepOutput
from scheduler.request import EmbeddingEvent, FinishEvent, Request, TokenEvent
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import FakeWorker, make_config, make_prompt, make_request, run


class EmbedWorker(FakeWorker):
    """FakeWorker; an embed row's vector is [position, token id, number of rows in the step]."""

    def execute(self, plan: BatchPlan) -> StepOutput:
        out = super().execute(plan)
        vectors = [
            np.array([plan.positions[s.row], plan.token_ids[s.row], 0.0], dtype=np.float32)
            if s.embed
            else None
            for s in plan.samples
        ]
        token_ids = [-1 if s.embed else t for s, t in zip(plan.samples, out.token_ids, strict=True)]
        return StepOutput(token_ids, embeddings=vectors)


def embed_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, max_tokens=1, embed=True, context_shift=False)


def drive(sched: Scheduler, worker: FakeWorker, requests: list[Request]) -> list:
    for r in requests:
        sched.add_request(r)
    events: list = []
    for _ in range(1000):
        if not sched.has_work:
            return events
        plan = sched.schedule()
        out = worker.execute(plan) if plan.num_tokens else StepOutput(token_ids=[])
        events += sched.update(plan, out)
        sched.memory.check()
    raise AssertionError("no progress")


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_embedding_returns_the_last_prompt_row_and_frees_its_cells(prefix_cache: bool) -> None:
    config = make_config(n_batch=16, prefix_cache=prefix_cache)
    sched, worker = Scheduler(config), EmbedWorker(config.n_cells)
    prompt = make_prompt(40, seed=3)  # three chunks of at most 16 rows
    events = drive(sched, worker, [embed_request("e", prompt)])
    kinds = [type(ev) for _, ev in events]
    assert kinds == [EmbeddingEvent, FinishEvent]
    vector = events[0][1].vector
    assert vector.tolist() == [39.0, float(prompt[-1]), 0.0]
    finish = events[1][1]
    assert finish.reason == "stop" and finish.num_output_tokens == 0
    assert finish.num_prompt_tokens == 40
    assert sched.memory.num_used == 0 and sched.counters.num_generated_tokens == 0


def test_embeddings_share_steps_with_generation_without_changing_it() -> None:
    config = make_config(n_batch=32)
    gen = [make_request(f"g{i}", prompt_len=12, max_tokens=10, seed=i) for i in range(3)]
    alone = run(*_fresh(config), [make_request(f"g{i}", 12, 10, seed=i) for i in range(3)])
    sched, worker = _fresh(config)
    embeds = [embed_request(f"e{i}", make_prompt(20 + i, seed=10 + i)) for i in range(3)]
    events = drive(sched, worker, [gen[0], embeds[0], gen[1], embeds[1], gen[2], embeds[2]])
    tokens: dict[str, list[int]] = {}
    vectors = {}
    for req_id, ev in events:
        if isinstance(ev, TokenEvent):
            tokens.setdefault(req_id, []).append(ev.token_id)
        elif isinstance(ev, EmbeddingEvent):
            vectors[req_id] = ev.vector
    assert {k: tokens[k] for k in ("g0", "g1", "g2")} == {k[0]: v for k, v in alone.tokens.items()}
    assert sorted(vectors) == ["e0", "e1", "e2"] and not any(k.startswith("e") for k in tokens)
    assert sched.memory.num_used == sum(len(r.prompt_ids) + 9 for r in gen)  # the holders only


def test_an_embedding_request_has_one_choice() -> None:
    sched = Scheduler(make_config())
    with pytest.raises(ValueError, match="one choice"):
        sched.add_request(Request("e", [1, 2, 3], n=2, embed=True))


def _fresh(config) -> tuple[Scheduler, EmbedWorker]:
    return Scheduler(config), EmbedWorker(config.n_cells)


def test_an_embedding_may_fill_the_whole_context() -> None:
    """It generates nothing, so its prompt may take every position a sequence has."""
    config = make_config(n_batch=16)
    sched, worker = Scheduler(config), EmbedWorker(config.n_cells)
    n_ctx = config.n_ctx_seq
    events = drive(sched, worker, [embed_request("e", make_prompt(n_ctx, seed=1))])
    assert events[0][1].vector[0] == n_ctx - 1
    with pytest.raises(PromptError):
        sched.add_request(embed_request("f", make_prompt(n_ctx + 1, seed=2)))


def test_whole_prompts_never_split_an_input_and_pack_several_per_step() -> None:
    """An encoder's mode: an input waits for a step with room for all of it."""
    config = make_config(n_batch=32, prefix_cache=False, whole_prompts=True, n_ctx_seq=32)
    sched, worker = Scheduler(config), EmbedWorker(config.n_cells)
    lengths = [20, 20, 5, 7, 32]
    for i, n in enumerate(lengths):
        sched.add_request(embed_request(f"e{i}", make_prompt(n, seed=i)))
    steps = []
    while sched.has_work:
        plan = sched.schedule()
        steps.append([s.end - s.start for s in plan.seqs])
        assert all(plan.positions[s.start] == 0 for s in plan.seqs)
        out = worker.execute(plan) if plan.num_tokens else StepOutput(token_ids=[])
        sched.update(plan, out)
        sched.memory.check()
    assert steps == [[20], [20, 5, 7], [32]]
    assert sched.memory.num_used == 0
