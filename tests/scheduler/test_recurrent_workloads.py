"""The scheduler over the recurrent and hybrid memories, with a fake worker whose per-slot state
is a hash of the tokens consumed (tests/scheduler/fakes.py: FakeStates): every output equals
the cacheless reference, so a wrong slot, a missed state copy or a checkpoint with the wrong
state changes the text. The scheduler asks the memory only; nothing here tells it the variant."""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache.hybrid import HybridMemory
from kvcache.recurrent import RecurrentMemory
from kvcache.spec import Attention, MemorySpec, Recurrent
from scheduler.engine import Engine
from scheduler.plan import BatchPlan, SamplingParams
from scheduler.request import Event, FinishEvent, Request, TokenEvent
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
from tests.scheduler.test_random_workloads import Arrival, configs, run_workload, workloads

STATE = Recurrent(((3, 8), (2, 4, 4)))
RECURRENT = MemorySpec.of([STATE, STATE])
HYBRID = MemorySpec.of([STATE, Attention(1, 4), STATE, Attention(1, 4)])
W = 8
HYBRID_SWA = MemorySpec.of([Attention(1, 4), STATE, Attention(1, 4, W)])


def make_sched(spec: MemorySpec = RECURRENT, **kw: object) -> tuple[Scheduler, FakeWorker]:
    kw.setdefault("state_checkpoint_interval", 16)
    config = make_config(memory_spec=spec, **kw)
    return Scheduler(config), FakeWorker(config.n_cells)


def ref(req, n_ctx_seq: int, choice: int = 0, windows=(0,)) -> list[int]:  # type: ignore[no-untyped-def]
    return reference_output(req, n_ctx_seq, choice, windows=windows)[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), work=workloads(), interval=st.integers(1, 16), n_ckpt=st.integers(0, 6))
def test_random_workloads_on_the_recurrent_memory(
    cfg: dict[str, object], work: list[Arrival], interval: int, n_ckpt: int
) -> None:
    cfg = {
        **cfg,
        "memory_spec": RECURRENT,
        "state_checkpoint_interval": interval,
        "state_checkpoints": n_ckpt,
    }
    run_workload(cfg, work, windows=(0,))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs(),
    work=workloads(),
    interval=st.integers(1, 16),
    swa=st.booleans(),
    kind=st.sampled_from(["auto", "unified"]),
)
def test_random_workloads_on_the_hybrid_memory(
    cfg: dict[str, object], work: list[Arrival], interval: int, swa: bool, kind: str
) -> None:
    """Attention cells (unified, or iSWA with a window layer) beside the state slots."""
    spec, windows = (HYBRID_SWA, (0, 0, W)) if swa else (HYBRID, (0, 0))
    cfg = {**cfg, "memory_spec": spec, "memory": kind, "state_checkpoint_interval": interval}
    run_workload(cfg, work, windows=windows)
    event(f"swa: {swa}, memory: {kind}")


def test_make_memory_gives_the_scheduler_slots_or_both() -> None:
    assert isinstance(make_sched()[0].memory, RecurrentMemory)
    sched = make_sched(HYBRID)[0]
    assert isinstance(sched.memory, HybridMemory)
    assert [p.name for p in sched.memory.pools] == ["full", "recurrent"]


def test_n_choices_fork_the_state_and_diverge() -> None:
    sched, worker = make_sched()
    req = make_request("r", prompt_len=30, max_tokens=20, n=3)
    req.sampling = SamplingParams(temperature=0.9, seed=5)
    out = run(sched, worker, [req])
    texts = [out.tokens[("r", i)] for i in range(3)]
    assert texts == [ref(req, 128, choice=i) for i in range(3)]
    assert len({tuple(t) for t in texts}) == 3


def test_preemption_recomputes_the_state() -> None:
    """Few attention cells: sequences are preempted and recompute into fresh slots."""
    sched, worker = make_sched(HYBRID, n_cells=96, n_ctx_seq=64, n_seq_max=4)
    reqs = [make_request(f"r{i}", prompt_len=30, max_tokens=30, seed=i) for i in range(4)]
    out = run(sched, worker, reqs)
    assert sched.counters.num_preemptions > 0
    for r in reqs:
        assert out.tokens[(r.req_id, 0)] == ref(r, 64, windows=(0, 0))


def test_a_shared_system_prompt_hits_a_grid_checkpoint() -> None:
    sched, worker = make_sched(n_ctx_seq=256, n_cells=256)
    system = make_prompt(40, seed=3)
    a = make_request("a", max_tokens=6)
    a.prompt_ids = system + make_prompt(10, seed=4)
    b = make_request("b", max_tokens=6)
    b.prompt_ids = system + make_prompt(10, seed=5)
    run(sched, worker, [a])
    before = sched.counters.num_prompt_tokens
    out = run(sched, worker, [b])
    assert out.finish[("b", 0)].num_cached_tokens == 32  # the last multiple of 16 in 40
    assert sched.counters.num_prompt_tokens - before == 50 - 32
    assert out.tokens[("b", 0)] == ref(b, 256)
    # b wrote on from the shared checkpoint's slot: the checkpoint kept a copy for c
    c = make_request("c", max_tokens=6)
    c.prompt_ids = system + make_prompt(10, seed=6)
    out = run(sched, worker, [c])
    assert out.finish[("c", 0)].num_cached_tokens == 32
    assert out.tokens[("c", 0)] == ref(c, 256)


def test_the_same_prompt_twice_is_served_by_the_state_before_its_last_token() -> None:
    """The scheduler matches tokens[:n-1] (the last token must give logits): the checkpoint
    at n - 1 serves it, so only the last token is computed again."""
    for spec, windows in ((RECURRENT, (0,)), (HYBRID, (0, 0))):
        sched, worker = make_sched(spec)
        first = run(sched, worker, [make_request("a", prompt_len=45, max_tokens=5, seed=2)])
        before = sched.counters.num_prompt_tokens
        again = make_request("b", prompt_len=45, max_tokens=5, seed=2)
        out = run(sched, worker, [again])
        assert out.finish[("b", 0)].num_cached_tokens == 44
        assert sched.counters.num_prompt_tokens - before == 1
        assert out.tokens[("b", 0)] == first.tokens[("a", 0)] == ref(again, 128, windows=windows)


def test_a_conversation_continues_from_the_finished_state() -> None:
    sched, worker = make_sched(n_ctx_seq=256, n_cells=256)
    first_req = make_request("turn1", prompt_len=60, max_tokens=12, seed=1)
    first = run(sched, worker, [first_req])
    follow = make_request("turn2", prompt_len=60, max_tokens=12, seed=1)
    follow.prompt_ids = follow.prompt_ids + first.tokens[("turn1", 0)] + make_prompt(5, seed=7)
    before = sched.counters.num_prompt_tokens
    out = run(sched, worker, [follow])
    assert out.finish[("turn2", 0)].num_cached_tokens == 60 + 12 - 1
    assert sched.counters.num_prompt_tokens - before == 6
    assert out.tokens[("turn2", 0)] == ref(follow, 256)


def test_an_edited_turn_reuses_the_earlier_turn_the_next_one_did_not_make_redundant() -> None:
    """Chat UIs resend a conversation with its last user message edited: the state after
    turn 1 must survive turn 2's holder, which has no state at that length (a KV holder
    would serve it, so there the turn-1 holder is dropped as redundant)."""
    for spec, kept in ((RECURRENT, True), (MemorySpec.of([Attention(1, 4)]), False)):
        sched, worker = make_sched(spec, n_ctx_seq=256, n_cells=256, state_checkpoint_interval=1000)
        t1 = make_request("t1", prompt_len=40, max_tokens=8, seed=1)
        history = t1.prompt_ids + run(sched, worker, [t1]).tokens[("t1", 0)]
        t2 = make_request("t2", max_tokens=8)
        t2.prompt_ids = history + make_prompt(7, seed=2)
        run(sched, worker, [t2])
        assert len(sched.prefix) == (2 if kept else 1)
        edited = make_request("edit", max_tokens=8)
        edited.prompt_ids = history + make_prompt(9, seed=3)
        out = run(sched, worker, [edited])
        # the turn-1 holder's state (all but the last token of turn 1); KV cells serve all
        want = len(history) - 1 if kept else len(history)
        assert out.finish[("edit", 0)].num_cached_tokens == want
        assert out.tokens[("edit", 0)] == ref(edited, 256)


def test_context_shift_on_a_recurrent_model_recomputes() -> None:
    for spec, windows in ((RECURRENT, (0,)), (HYBRID, (0, 0))):
        sched, worker = make_sched(spec, n_ctx_seq=40, prefix_cache=False)
        req = make_request("r", prompt_len=20, max_tokens=100, n_keep=6)
        out = run(sched, worker, [req])
        expected, num_shifts = reference_output(req, 40, windows=windows)
        assert out.tokens[("r", 0)] == expected
        assert sched.counters.num_context_shifts == num_shifts > 0
        assert sched.counters.num_prompt_tokens > 20  # the shifted context was recomputed
        assert sched.memory.num_used == 0


def test_abort_leaks_no_slot() -> None:
    sched, worker = make_sched(HYBRID)
    reqs = [make_request(f"r{i}", prompt_len=20 + i, max_tokens=40, seed=i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outcome = Outcome()
    for _ in range(3):
        step(sched, worker, outcome)
    sched.abort("r1")
    sched.abort("r3")
    while sched.has_work:
        step(sched, worker, outcome)
    assert outcome.finish[("r1", 0)].reason == "abort"
    assert outcome.tokens[("r0", 0)] == ref(reqs[0], 128, windows=(0, 0))
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0
    assert sched.num_free_seq_ids == sched.config.n_seq_max


def test_a_failing_sequence_is_isolated_and_the_others_keep_their_states() -> None:
    """The engine bisects a failing batch (scheduler/isolate.py): the re-runs carry each
    sequence's slot and captures, and the states of the others come out right."""
    poison = 1000
    shared_failures = []

    def poisoned(plan: BatchPlan) -> bool:
        bad = bool(np.any(plan.token_ids == poison))
        if bad and len(plan.seqs) > 1:
            shared_failures.append(len(plan.seqs))
        return bad

    config = make_config(memory_spec=HYBRID, state_checkpoint_interval=8)
    engine = Engine(FakeWorker(config.n_cells, fail_when=poisoned), config)
    bad = make_request("bad", prompt_len=30, max_tokens=5)
    bad.prompt_ids = [*bad.prompt_ids, poison]
    goods = [make_request(f"g{i}", prompt_len=20 + 3 * i, max_tokens=12, seed=i) for i in range(3)]
    reqs = [goods[0], bad, *goods[1:]]

    async def collect(req: Request) -> list[Event]:
        return [ev async for ev in engine.submit(req)]

    async def main() -> list[list[Event]]:
        streams = [collect(r) for r in reqs]
        engine.start()  # every request is queued before the first step
        return await asyncio.gather(*streams)

    results = dict(zip([r.req_id for r in reqs], asyncio.run(main()), strict=True))
    engine.shutdown(drain_timeout=1)
    assert shared_failures, "the poisoned prompt shared a batch"
    last = results["bad"][-1]
    assert isinstance(last, FinishEvent) and last.reason == "error"
    for r in goods:
        tokens = [e.token_id for e in results[r.req_id] if isinstance(e, TokenEvent)]
        assert tokens == ref(r, 128, windows=(0, 0)), r.req_id
    # a good prompt again: the checkpoint its re-run took holds its state
    again = make_request("again", prompt_len=26, max_tokens=12, seed=2)
    out = run(engine.scheduler, engine.worker, [again])  # type: ignore[arg-type]
    assert out.finish[("again", 0)].num_cached_tokens == 25
    assert out.tokens[("again", 0)] == ref(again, 128, windows=(0, 0))
