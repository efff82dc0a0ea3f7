from __future__ import annotations

import numpy as np

from scheduler.request import Request
from tests.scheduler.fakes import (
    make_prompt,
    make_request,
    make_scheduler,
    reference_output,
    run,
)

SYSTEM = make_prompt(500, seed=99)


def chat(req_id: str, question_seed: int, max_tokens: int = 12) -> Request:
    req = make_request(req_id, max_tokens=max_tokens)
    req.prompt_ids = SYSTEM + make_prompt(20, seed=question_seed)
    return req


def big_cache(**kw: object):  # noqa: ANN201
    return make_scheduler(n_cells=2048, n_ctx_seq=1024, n_batch=256, **kw)


def test_second_request_prefills_only_its_suffix_and_matches_a_cold_cache() -> None:
    sched, worker = big_cache()
    run(sched, worker, [chat("first", 1)])
    computed_before = sched.counters.num_prompt_tokens
    warm = run(sched, worker, [chat("second", 2)])
    assert sched.counters.num_prompt_tokens - computed_before == 20
    assert warm.finish[("second", 0)].num_cached_tokens == 500
    assert sched.counters.prefix_hit_tokens == 500

    cold_sched, cold_worker = big_cache(prefix_cache=False)
    cold = run(cold_sched, cold_worker, [chat("second", 2)])
    assert cold.finish[("second", 0)].num_cached_tokens == 0
    assert warm.tokens[("second", 0)] == cold.tokens[("second", 0)]
    assert warm.tokens[("second", 0)] == reference_output(chat("x", 2), 1024)[0]


def test_same_prompt_again_keeps_one_token_to_compute() -> None:
    sched, worker = big_cache()
    first = run(sched, worker, [chat("a", 1)])
    before = sched.counters.num_prompt_tokens
    again = run(sched, worker, [chat("b", 1)])
    assert sched.counters.num_prompt_tokens - before == 1
    assert again.finish[("b", 0)].num_cached_tokens == 519
    assert again.tokens[("b", 0)] == first.tokens[("a", 0)]


def test_a_conversation_continues_from_the_cached_answer() -> None:
    sched, worker = big_cache()
    first = run(sched, worker, [chat("turn1", 1)])
    follow = chat("turn2", 1)
    follow.prompt_ids = follow.prompt_ids + first.tokens[("turn1", 0)] + make_prompt(5, seed=7)
    before = sched.counters.num_prompt_tokens
    out = run(sched, worker, [follow])
    # the last answer token was sampled but never fed, so it is recomputed with the new turn
    assert sched.counters.num_prompt_tokens - before == 6
    assert out.tokens[("turn2", 0)] == reference_output(follow, 1024)[0]


def test_holders_are_dropped_lru_when_seq_ids_run_out() -> None:
    sched, worker = make_scheduler(n_cells=512, n_seq_max=3, n_ctx_seq=256)
    for i in range(3):
        run(sched, worker, [make_request(f"r{i}", prompt_len=30, max_tokens=2, seed=i)])
    assert len(sched.prefix) == 3
    out = run(sched, worker, [make_request("n", prompt_len=30, max_tokens=2, seed=10, n=2)])
    assert len(out.finish) == 2
    assert len(sched.prefix) <= 3

    def cached(seed: int) -> int:
        return sched.prefix.match(np.asarray(make_prompt(30, seed))).length

    assert cached(0) == 0 and cached(1) == 0  # the two least recently used
    assert cached(2) == 30 and cached(10) == 30
    # their seq ids went, their cells stay in the prefix index (scheduler/radix.py)
    assert sched.sharing.cached(np.asarray(make_prompt(30, 0))).length == 30
    assert sched.sharing.cached(np.asarray(make_prompt(30, 1))).length == 30


def test_without_the_prefix_index_holders_are_dropped_with_their_cells() -> None:
    sched, worker = make_scheduler(n_cells=512, n_seq_max=3, n_ctx_seq=256, prefix_index=False)
    for i in range(4):
        run(sched, worker, [make_request(f"r{i}", prompt_len=30, max_tokens=2, seed=i)])
    assert sched.seq_ids.radix is None
    assert sched.sharing.cached(np.asarray(make_prompt(30, 0))).length == 0


def test_holders_are_dropped_when_cells_run_out_and_cleared_to_zero() -> None:
    sched, worker = make_scheduler(n_cells=128, n_seq_max=8, n_ctx_seq=100)
    for i in range(6):
        run(sched, worker, [make_request(f"r{i}", prompt_len=40, max_tokens=5, seed=i)])
        sched.memory.check()
    assert sched.counters.num_preemptions == 0
    assert 0 < len(sched.prefix) < 6
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0
    assert sched.num_free_seq_ids == 8
