from __future__ import annotations

import pytest

from scheduler.plan import SamplingParams
from tests.scheduler.fakes import (
    Outcome,
    make_request,
    make_scheduler,
    reference_output,
    run,
    step,
)


def test_outputs_match_the_cacheless_reference() -> None:
    sched, worker = make_scheduler(n_batch=16)
    reqs = [make_request(f"r{i}", prompt_len=5 + 7 * i, max_tokens=6 + i, seed=i) for i in range(5)]
    outcome = run(sched, worker, reqs)
    for r in reqs:
        assert outcome.tokens[(r.req_id, 0)] == reference_output(r, 128)[0]
        assert outcome.finish[(r.req_id, 0)].reason == "length"


def test_chunked_prefill_never_stalls_decoders() -> None:
    sched, worker = make_scheduler(n_batch=16)
    sched.add_request(make_request("short", prompt_len=4, max_tokens=40))
    outcome = Outcome()
    step(sched, worker, outcome)  # "short" reads its prompt and samples
    sched.add_request(make_request("long", prompt_len=100, max_tokens=2, seed=1))
    for _ in range(6):
        plan = step(sched, worker, outcome)
        assert plan.num_tokens == 16  # 1 decode + a 15-token chunk of the long prompt
        assert sched.counters.last_num_decode == 1
    assert len(outcome.tokens[("short", 0)]) == 7


def test_decode_rows_and_last_prompt_row_are_sampled() -> None:
    sched, worker = make_scheduler(n_batch=64)
    sched.add_request(make_request("a", prompt_len=10))
    sched.add_request(make_request("b", prompt_len=100, seed=1))
    plan = sched.schedule()
    assert [s.row for s in plan.samples] == [9]  # "b" gets 54 of 100 tokens: no logits yet
    assert [(s.start, s.end) for s in plan.seqs] == [(0, 10), (10, 64)]
    sched.update(plan, worker.execute(plan))
    plan = sched.schedule()
    assert [s.row for s in plan.samples] == [0, 46]  # a's decode row, b's last prompt row


def test_n_choices_share_the_prompt_and_draw_their_own_streams() -> None:
    sched, worker = make_scheduler()
    sampling = SamplingParams(temperature=1.0, seed=42)
    req = make_request("r", prompt_len=30, max_tokens=10, n=3, sampling=sampling)
    outcome = run(sched, worker, [req])
    outs = [outcome.tokens[("r", i)] for i in range(3)]
    assert len({tuple(o) for o in outs}) == 3
    for i in range(3):
        assert outs[i] == reference_output(req, 128, choice=i)[0]
    assert sched.counters.num_prompt_tokens == 30  # the prompt was read once


def test_n_choices_fork_with_seq_cp() -> None:
    sched, worker = make_scheduler()
    sched.add_request(make_request("r", prompt_len=30, n=3))
    plan = sched.schedule()
    sched.update(plan, worker.execute(plan))
    assert len(plan.samples) == 3 and len({s.row for s in plan.samples}) == 1
    assert sched.memory.stats()[0].stats.shared == 30
    assert sched.memory.num_used == 30


def test_stop_token_and_min_tokens() -> None:
    stop_all = frozenset(range(97))  # every token is a stop token
    sched, worker = make_scheduler()
    reqs = [
        make_request("stop", ignore_eos=False, stop_token_ids=stop_all),
        make_request("min", ignore_eos=False, stop_token_ids=stop_all - {5}, min_tokens=3),
        make_request("eos", ignore_eos=True, stop_token_ids=stop_all, max_tokens=4),
    ]
    outcome = run(sched, worker, reqs)
    assert outcome.finish[("stop", 0)].reason == "stop"
    assert outcome.finish[("stop", 0)].num_output_tokens == 1
    assert ("stop", 0) not in outcome.tokens  # the stop token is not streamed
    assert outcome.tokens[("min", 0)] == [5, 5, 5]
    assert outcome.finish[("min", 0)].reason == "stop"
    assert len(outcome.tokens[("eos", 0)]) == 4
    assert outcome.finish[("eos", 0)].reason == "length"


def test_abort_frees_every_cell_within_one_step() -> None:
    sched, worker = make_scheduler(prefix_cache=False)
    sched.add_request(make_request("a", prompt_len=40, max_tokens=50, n=2))
    sched.add_request(make_request("b", prompt_len=200, max_tokens=50, seed=1))
    outcome = Outcome()
    for _ in range(3):
        step(sched, worker, outcome)
    assert sched.memory.num_used > 0
    sched.abort("a")
    sched.abort("b")
    step(sched, worker, outcome)
    assert sched.memory.num_used == 0
    assert sched.num_free_seq_ids == 8
    assert {k: e.reason for k, e in outcome.finish.items()} == {
        ("a", 0): "abort",
        ("a", 1): "abort",
        ("b", 0): "abort",
    }


def test_abort_one_choice_while_the_prompt_is_read() -> None:
    sched, worker = make_scheduler(n_batch=8)
    req = make_request("r", prompt_len=30, max_tokens=5, n=3, seed=3)
    sched.add_request(req)
    outcome = Outcome()
    step(sched, worker, outcome)
    sched.abort("r", 0)
    while sched.has_work:
        step(sched, worker, outcome)
    assert outcome.finish[("r", 0)].reason == "abort"
    assert ("r", 0) not in outcome.tokens
    for i in (1, 2):
        assert outcome.tokens[("r", i)] == reference_output(req, 128, choice=i)[0]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(prompt_len=0), "empty"),
        (dict(n=9), "n must be"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(prompt_len=128, context_shift=False), "context shift is off"),
        (dict(prompt_len=257), "more than the whole KV cache"),  # n_cells 256, shift on
    ],
)
def test_invalid_requests_are_rejected(kw: dict[str, object], match: str) -> None:
    sched, _ = make_scheduler()
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("bad", **kw))  # type: ignore[arg-type]
    assert not sched.has_work


def test_long_prompt_is_truncated_in_the_middle_with_context_shift() -> None:
    sched, worker = make_scheduler(n_ctx_seq=64)
    req = make_request("r", prompt_len=200, max_tokens=3, n_keep=10)
    outcome = run(sched, worker, [req])
    n_block = (64 - 10) // 2
    n_erased = (200 - 10 - n_block) // n_block
    seen = req.prompt_ids[:10] + req.prompt_ids[10 + n_erased * n_block :]
    assert len(seen) < 64
    truncated = make_request("t", max_tokens=3)
    truncated.prompt_ids = seen
    assert outcome.tokens[("r", 0)] == reference_output(truncated, 64)[0]
    assert outcome.finish[("r", 0)].num_prompt_tokens == 200
