from __future__ import annotations

import numpy as np

from scheduler.plan import SamplingParams
from tests.scheduler.fakes import (
    Outcome,
    make_prompt,
    make_request,
    make_scheduler,
    reference_output,
    run,
    step,
)


def test_generating_three_times_the_context_shifts_and_keeps_n_keep() -> None:
    sched, worker = make_scheduler(n_ctx_seq=64, prefix_cache=False)
    req = make_request("r", prompt_len=20, max_tokens=192, n_keep=8)
    sched.add_request(req)
    outcome = Outcome()
    while sched.has_work:
        step(sched, worker, outcome)
        if sched.running:
            kv_cells, kv_pos = sched.memory.pools[0].cells.seq_cells(sched.running[0].seq_id)
            assert kv_pos.max() < 64
            assert worker.token[0][kv_cells[:8]].tolist() == req.prompt_ids[:8]
    expected, num_shifts = reference_output(req, 64)
    assert outcome.tokens[("r", 0)] == expected
    assert outcome.finish[("r", 0)].reason == "length"
    assert num_shifts >= 6
    assert sched.counters.num_context_shifts == num_shifts
    assert sched.memory.num_used == 0


def test_context_shift_off_finishes_with_length_at_the_limit() -> None:
    sched, worker = make_scheduler(n_ctx_seq=64, context_shift=False)
    outcome = run(sched, worker, [make_request("r", prompt_len=20, max_tokens=500)])
    assert outcome.finish[("r", 0)].reason == "length"
    assert len(outcome.tokens[("r", 0)]) == 64 - 20 + 1
    assert sched.counters.num_context_shifts == 0


def test_per_request_override_of_the_engine_default() -> None:
    sched, worker = make_scheduler(n_ctx_seq=64, context_shift=False)
    req = make_request("r", prompt_len=20, max_tokens=100, context_shift=True)
    outcome = run(sched, worker, [req])
    assert outcome.tokens[("r", 0)] == reference_output(req, 64)[0]
    assert sched.counters.num_context_shifts > 0


def test_choices_sharing_their_prompt_both_shift() -> None:
    # n_keep < prompt: the shifted tail includes shared prompt cells -> copy-on-write
    sched, worker = make_scheduler(n_ctx_seq=64, n_cells=256)
    sampling = SamplingParams(temperature=1.0, seed=5)
    req = make_request("r", prompt_len=40, max_tokens=100, n=2, n_keep=4, sampling=sampling)
    outcome = run(sched, worker, [req])
    for i in range(2):
        expected, num_shifts = reference_output(req, 64, choice=i)
        assert outcome.tokens[("r", i)] == expected
    assert sched.counters.num_context_shifts == 2 * num_shifts


def test_shift_of_a_sequence_sharing_cells_with_a_prefix_holder() -> None:
    sched, worker = make_scheduler(n_ctx_seq=64, n_cells=160)
    system = make_prompt(40, seed=1)
    first = make_request("a", max_tokens=3)
    first.prompt_ids = system + [5, 6]
    run(sched, worker, [first])
    second = make_request("b", max_tokens=120, n_keep=4)
    second.prompt_ids = system + [7, 8]
    outcome = run(sched, worker, [second])
    assert outcome.finish[("b", 0)].num_cached_tokens == 40
    assert outcome.tokens[("b", 0)] == reference_output(second, 64)[0]
    assert sched.counters.num_context_shifts > 0
    # the holder's cells were not moved by b's shifts
    holder = sched.prefix.match(np.asarray(system)).seq_id
    kv_cells, kv_pos = sched.memory.pools[0].cells.seq_cells(holder)
    assert kv_pos[:40].tolist() == list(range(40))
    assert worker.token[0][kv_cells[:40]].tolist() == system


def test_choices_shifting_in_a_cache_too_small_to_copy_their_shared_prompt() -> None:
    # 48 cells: the shared 33-token prompt and two 5-token tails leave 5 free, and the shift
    # copies 14 shared cells. Preempting the sibling makes them private (no copy needed): the
    # shifting choice must see that, not preempt itself and requeue both forever.
    sched, worker = make_scheduler(n_cells=48, n_ctx_seq=38, n_batch=33)
    sampling = SamplingParams(temperature=0.7, seed=1)
    req = make_request("r", prompt_len=33, max_tokens=16, n=2, n_keep=1, sampling=sampling)
    outcome = Outcome()
    sched.add_request(req)
    for _ in range(200):
        if not sched.has_work:
            break
        step(sched, worker, outcome)
    assert not sched.has_work, "no progress"
    for i in range(2):
        assert outcome.tokens[("r", i)] == reference_output(req, 38, choice=i)[0]
    assert sched.counters.num_context_shifts >= 1
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0
