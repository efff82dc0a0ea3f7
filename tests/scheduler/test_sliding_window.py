"""The scheduler over the iSWA memory: a small pool for the sliding-window layers, and every
output equal to the cacheless reference (whose window layer reads the last W tokens)."""

from __future__ import annotations

from kvcache.iswa import ISWAMemory
from kvcache.spec import Attention, MemorySpec
from scheduler.plan import SamplingParams
from scheduler.scheduler import Scheduler
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

W = 16


def make_swa_scheduler(**kw: object) -> tuple[Scheduler, FakeWorker]:
    spec = MemorySpec.of([Attention(1, 4), Attention(1, 4, W)])
    config = make_config(memory_spec=spec, **kw)
    return Scheduler(config), FakeWorker(config.n_cells)


def ref(req, n_ctx_seq: int, choice: int = 0) -> list[int]:  # type: ignore[no-untyped-def]
    return reference_output(req, n_ctx_seq, choice, windows=(0, W))[0]


def test_the_window_pool_is_sized_by_window_times_sequences_not_by_context() -> None:
    kw = dict(n_cells=1024, n_seq_max=8, n_batch=64, n_ctx_seq=512)
    # by default the pool has n_cells / 4 more for the prefix index's windows
    default_pools = make_swa_scheduler(**kw)[0].memory.pools
    assert default_pools[1].cells.n_cells == W * 8 + 64 + 1024 // 4
    sched, worker = make_swa_scheduler(**kw, swa_index_cells=0)
    assert isinstance(sched.memory, ISWAMemory)
    full, swa = sched.memory.pools
    assert (full.name, full.cells.n_cells) == ("full", 1024)
    assert (swa.name, swa.cells.n_cells, swa.window) == ("swa", W * 8 + 64, W)
    reqs = [make_request(f"r{i}", prompt_len=100 + 10 * i, max_tokens=40, seed=i) for i in range(5)]
    outcome = Outcome()
    for r in reqs:
        sched.add_request(r)
    peak_full = 0
    while sched.has_work:
        step(sched, worker, outcome)
        # between steps each sequence holds its window plus at most its last step's rows
        assert swa.cells.used <= W * (len(sched.running) + len(sched.prefix)) + 64
        peak_full = max(peak_full, full.cells.used)
    assert peak_full > 3 * swa.cells.n_cells  # the contexts never fit the window pool
    for r in reqs:
        assert outcome.tokens[(r.req_id, 0)] == ref(r, 512)


def test_a_conversation_continues_from_the_cached_answer_with_the_cold_output() -> None:
    sched, worker = make_swa_scheduler(n_cells=1024, n_ctx_seq=1024)
    first_req = make_request("turn1", prompt_len=60, max_tokens=12, seed=1)
    first = run(sched, worker, [first_req])
    follow = make_request("turn2", prompt_len=60, max_tokens=12, seed=1)
    follow.prompt_ids = follow.prompt_ids + first.tokens[("turn1", 0)] + make_prompt(5, seed=7)
    before = sched.counters.num_prompt_tokens
    out = run(sched, worker, [follow])
    # the holder keeps the last W positions: the whole answer is reused, the new turn computed
    assert out.finish[("turn2", 0)].num_cached_tokens == 60 + 12 - 1
    assert sched.counters.num_prompt_tokens - before == 6
    assert out.tokens[("turn2", 0)] == ref(follow, 1024)


def test_a_shared_prefix_longer_than_the_window_is_recomputed_not_misread() -> None:
    """The holder no longer has the window of a shorter prefix: no reuse, cold output."""
    sched, worker = make_swa_scheduler(n_cells=1024, n_ctx_seq=1024)
    system = make_prompt(40, seed=3)
    a = make_request("a", max_tokens=8)
    a.prompt_ids = system + make_prompt(10, seed=4)
    b = make_request("b", max_tokens=8)
    b.prompt_ids = system + make_prompt(10, seed=5)
    run(sched, worker, [a])
    out = run(sched, worker, [b])
    assert out.finish[("b", 0)].num_cached_tokens == 0
    assert out.tokens[("b", 0)] == ref(b, 1024)


def test_a_shared_prefix_within_the_window_is_reused() -> None:
    sched, worker = make_swa_scheduler(n_cells=1024, n_ctx_seq=1024)
    a = make_request("a", prompt_len=6, max_tokens=4, seed=8)
    b = make_request("b", max_tokens=4)
    b.prompt_ids = a.prompt_ids + make_prompt(20, seed=9)
    run(sched, worker, [a])  # the holder is 9 tokens long: shorter than W, all reusable
    out = run(sched, worker, [b])
    assert out.finish[("b", 0)].num_cached_tokens == 6
    assert out.tokens[("b", 0)] == ref(b, 1024)


def test_n_choices_fork_both_pools() -> None:
    sched, worker = make_swa_scheduler()
    sampling = SamplingParams(temperature=0.8, seed=11)
    req = make_request("r", prompt_len=50, max_tokens=30, n=3, sampling=sampling)
    out = run(sched, worker, [req])
    for i in range(3):
        assert out.tokens[("r", i)] == ref(req, 128, choice=i)


def test_context_shift_keeps_the_window_or_recomputes() -> None:
    """n_keep 12 with W 16: after a shift the next row's window reaches back into the kept
    part, whose cells were pruned, so the shifted context is recomputed; n_keep 0 and a long
    context: the window survives the shift. Both give the reference output."""
    for n_keep, n_ctx, recomputed in ((12, 40, True), (0, 64, False)):
        sched, worker = make_swa_scheduler(n_ctx_seq=n_ctx, prefix_cache=False)
        req = make_request("r", prompt_len=20, max_tokens=3 * n_ctx, n_keep=n_keep)
        out = run(sched, worker, [req])
        expected, num_shifts = reference_output(req, n_ctx, windows=(0, W))
        assert out.tokens[("r", 0)] == expected
        assert sched.counters.num_context_shifts == num_shifts > 0
        assert sched.memory.num_used == 0
        assert (sched.counters.num_prompt_tokens > 20) == recomputed


def test_preemption_recomputes_into_both_pools() -> None:
    sched, worker = make_swa_scheduler(n_cells=96, n_ctx_seq=64, n_seq_max=4)
    reqs = [make_request(f"r{i}", prompt_len=30, max_tokens=30, seed=i) for i in range(4)]
    out = run(sched, worker, reqs)
    assert sched.counters.num_preemptions > 0
    for r in reqs:
        assert out.tokens[(r.req_id, 0)] == ref(r, 64)
