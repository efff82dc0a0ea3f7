from __future__ import annotations

from scheduler.plan import SamplingParams
from tests.scheduler.fakes import make_request, make_scheduler, reference_output, run


def workload() -> list:  # noqa: ANN001
    reqs = [make_request(f"g{i}", prompt_len=20 + i, max_tokens=40, seed=i) for i in range(6)]
    for i in range(3):
        sampling = SamplingParams(temperature=0.8, seed=100 + i)
        reqs.append(
            make_request(f"s{i}", prompt_len=15, max_tokens=30, seed=50 + i, sampling=sampling, n=2)
        )
    return reqs


def test_a_cache_too_small_preempts_and_every_output_is_unchanged() -> None:
    small, small_worker = make_scheduler(n_cells=100, n_ctx_seq=64, n_seq_max=16)
    tight = run(small, small_worker, workload())
    large, large_worker = make_scheduler(n_cells=2048, n_ctx_seq=64, n_seq_max=16)
    roomy = run(large, large_worker, workload())
    assert small.counters.num_preemptions > 0
    assert large.counters.num_preemptions == 0
    assert tight.tokens == roomy.tokens
    assert {k: e.reason for k, e in tight.finish.items()} == dict.fromkeys(roomy.finish, "length")
    for r in workload():
        for i in range(r.n):
            assert tight.tokens[(r.req_id, i)] == reference_output(r, 64, choice=i)[0]


def test_preemption_without_prefix_cache_ends_with_an_empty_cache() -> None:
    sched, worker = make_scheduler(n_cells=80, n_ctx_seq=64, n_seq_max=16, prefix_cache=False)
    run(sched, worker, workload())
    assert sched.counters.num_preemptions > 0
    assert sched.memory.num_used == 0
    assert sched.num_free_seq_ids == 16
