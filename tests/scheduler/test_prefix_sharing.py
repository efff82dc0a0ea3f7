"""Prefix sharing with running sequences (scheduler/sharing.py): a burst of requests with the
same new system prompt computes it once, on every memory kind, and an abort or a preemption of
the request that computes it loses nothing and leaks nothing."""

from __future__ import annotations

from kvcache.spec import Attention, MemorySpec, Recurrent
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from tests.scheduler.fakes import (
    FakeWorker,
    Outcome,
    make_config,
    make_prompt,
    make_request,
    reference_output,
    run,
    step,
)

SYSTEM = make_prompt(400, seed=77)
N_QUESTION = 20
STATE = Recurrent(((3, 8), (2, 4, 4)))
W = 16
SPECS: dict[str, tuple[MemorySpec | None, tuple[int, ...]]] = {
    "unified": (None, (0,)),
    "iswa": (MemorySpec.of([Attention(1, 4), Attention(1, 4, W)]), (0, W)),
    "recurrent": (MemorySpec.of([STATE, STATE]), (0,)),
    # the fake's recurrent state hashes the whole context: a window of 0 in the reference
    "hybrid": (MemorySpec.of([STATE, Attention(1, 4), STATE, Attention(1, 4, W)]), (0, 0, W)),
}


def chat(req_id: str, question_seed: int, max_tokens: int = 10) -> Request:
    req = make_request(req_id, max_tokens=max_tokens)
    # questions differ from their first token on: they share exactly the system prompt
    question = [1 + question_seed, *make_prompt(N_QUESTION - 1, seed=question_seed)]
    req.prompt_ids = SYSTEM + question
    return req


def burst(n: int = 6) -> list[Request]:
    return [chat(f"q{i}", question_seed=i) for i in range(n)]


def make_sched(kind: str = "unified", **kw: object) -> tuple[Scheduler, FakeWorker]:
    spec, _ = SPECS[kind]
    kw = {"n_cells": 2048, "n_seq_max": 8, "n_batch": 128, "n_ctx_seq": 1024, **kw}
    config = make_config(memory_spec=spec, state_checkpoint_interval=64, **kw)
    return Scheduler(config), FakeWorker(config.n_cells)


def assert_cold_outputs(outcome: Outcome, reqs: list[Request], kind: str) -> None:
    windows = SPECS[kind][1]
    for r in reqs:
        expected = reference_output(r, 1024, windows=windows)[0]
        assert outcome.tokens[(r.req_id, 0)] == expected, (kind, r.req_id)


def assert_nothing_leaks(sched: Scheduler) -> None:
    assert not sched.running and not sched.waiting
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0
    assert sched.num_free_seq_ids == sched.config.n_seq_max
    sched.memory.check()


def by_id(sched: Scheduler, req_id: str) -> Sequence:
    return next(s for s in sched.running if s.req_id == req_id)


def test_a_burst_with_one_new_system_prompt_computes_it_once() -> None:
    sched, worker = make_sched()
    reqs = burst()
    out = run(sched, worker, reqs)
    prompt_len = len(SYSTEM) + N_QUESTION
    # one request reads its whole prompt, the five others their questions only
    assert sched.counters.num_prompt_tokens == prompt_len + 5 * N_QUESTION
    assert sched.counters.prefix_hit_tokens == 5 * len(SYSTEM)
    assert sched.counters.prefix_running_hit_tokens == 5 * len(SYSTEM)
    assert sorted(e.num_cached_tokens for e in out.finish.values()) == [0] + [len(SYSTEM)] * 5
    assert_cold_outputs(out, reqs, "unified")

    cold, cold_worker = make_sched(prefix_cache=False)
    run(cold, cold_worker, burst())
    assert cold.counters.num_prompt_tokens == 6 * prompt_len


def test_every_memory_kind_shares_the_running_prefix_with_the_cold_output() -> None:
    for kind in SPECS:
        sched, worker = make_sched(kind)
        reqs = burst()
        out = run(sched, worker, reqs)
        assert sched.counters.prefix_running_hit_tokens == 5 * len(SYSTEM), kind
        assert sched.counters.num_prompt_tokens == len(SYSTEM) + 6 * N_QUESTION, kind
        assert_cold_outputs(out, reqs, kind)
        assert_nothing_leaks(sched)


def test_the_waiters_take_the_prefix_only_once_it_is_computed() -> None:
    sched, worker = make_sched("iswa")
    for r in burst(3):
        sched.add_request(r)
    outcome = Outcome()
    chunks = []
    while len(sched.running) < 3:
        plan = step(sched, worker, outcome)
        reader = sched.running[0]
        chunks.append(int((plan.seq_ids == reader.seq_id).sum()))
        if len(sched.running) == 1:
            assert len(sched.waiting) == 2  # no seq id, no cell while waiting
            assert sched.memory.seq_num_cells(reader.seq_id) == sched.memory.num_used
    # the sliding-window pool prunes: the reader's chunks stop exactly at the shared length
    assert chunks[:4] == [128, 128, 128, 16]
    assert sum(chunks[:4]) == len(SYSTEM)


def test_a_request_arriving_while_another_decodes_shares_its_prompt() -> None:
    sched, worker = make_sched()
    outcome = Outcome()
    sched.add_request(chat("first", 1, max_tokens=40))
    while not (sched.running and sched.running[0].is_decoding):
        step(sched, worker, outcome)
    before = sched.counters.num_prompt_tokens
    sched.add_request(chat("second", 2))
    step(sched, worker, outcome)
    assert sched.counters.prefix_running_hit_tokens == len(SYSTEM)
    assert sched.counters.num_prompt_tokens - before == N_QUESTION
    while sched.has_work:
        step(sched, worker, outcome)
    assert_cold_outputs(outcome, [chat("first", 1, 40), chat("second", 2)], "unified")


def test_a_short_common_header_does_not_make_anyone_wait() -> None:
    sched, worker = make_sched(prefix_wait_min=32, n_batch=1024)
    header = make_prompt(10, seed=5)
    a, b = make_request("a", prompt_len=300, seed=1), make_request("b", prompt_len=300, seed=2)
    a.prompt_ids, b.prompt_ids = header + a.prompt_ids, header + b.prompt_ids
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker, Outcome())
    assert len(sched.running) == 2 and not sched.waiting


def test_aborting_the_reader_keeps_what_it_computed_for_the_waiters() -> None:
    for kind in SPECS:
        sched, worker = make_sched(kind)
        reqs = burst()
        for r in reqs:
            sched.add_request(r)
        outcome = Outcome()
        step(sched, worker, outcome)
        step(sched, worker, outcome)  # the reader has computed 256 tokens; 5 wait
        assert len(sched.running) == 1 and len(sched.waiting) == 5
        sched.abort("q0")
        while sched.has_work:
            step(sched, worker, outcome)
        assert outcome.finish[("q0", 0)].reason == "abort"
        assert_cold_outputs(outcome, reqs[1:], kind)
        # the aborted reader's 256 tokens became a holder that the next reader started from;
        # the four others waited for that one
        rest = len(SYSTEM) - 256 + N_QUESTION
        assert sched.counters.num_prompt_tokens == 256 + rest + 4 * N_QUESTION, kind
        assert_nothing_leaks(sched)


def test_preempting_the_reader_loses_no_waiter_and_no_follower() -> None:
    for kind in SPECS:
        sched, worker = make_sched(kind)
        reqs = burst()
        for r in reqs:
            sched.add_request(r)
        outcome = Outcome()
        step(sched, worker, outcome)
        sched.admission.preempt(by_id(sched, "q0"))  # while the others wait for its prompt
        while len(sched.running) < 6:
            step(sched, worker, outcome)
        assert sched.counters.num_preemptions == 1
        sched.admission.preempt(by_id(sched, "q0"))  # after the others took its cells by seq_cp
        while sched.has_work:
            step(sched, worker, outcome)
        assert_cold_outputs(outcome, reqs, kind)
        assert_nothing_leaks(sched)


def test_an_n_choice_waiter_forks_from_the_shared_prefix() -> None:
    sched, worker = make_sched("hybrid")
    first = chat("one", 1)
    many = chat("many", 2)
    many.n = 3
    out = run(sched, worker, [first, many])
    assert sched.counters.prefix_running_hit_tokens == len(SYSTEM)
    for i in range(3):
        assert out.tokens[("many", i)] == reference_output(many, 1024, i, SPECS["hybrid"][1])[0]


def test_a_waiter_does_not_hold_up_the_queue_behind_it() -> None:
    sched, worker = make_sched(n_batch=512)
    reader, waiter = chat("reader", 1), chat("waiter", 2)
    other = make_request("other", prompt_len=30, seed=3)
    for r in (reader, waiter, other):
        sched.add_request(r)
    outcome = Outcome()
    step(sched, worker, outcome)
    assert [s.req_id for s in sched.running] == ["reader", "other"]
    assert [s.req_id for s in sched.waiting] == ["waiter"]
    while sched.has_work:
        step(sched, worker, outcome)
    assert outcome.finish[("waiter", 0)].num_cached_tokens == len(SYSTEM)
    assert_cold_outputs(outcome, [reader, waiter, other], "unified")
