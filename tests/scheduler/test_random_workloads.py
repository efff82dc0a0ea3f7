"""Property test: any mix of arrivals, lengths, n > 1, shared prefixes, context shifts, aborts
and preemptions ends cleanly, and every completed output is the cacheless reference, on the
unified cache and, for a model with sliding-window layers, on both memory variants (the fake
worker checks that every row sees exactly its window)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache.spec import Attention, MemorySpec
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.scheduler.fakes import (
    FakeWorker,
    Outcome,
    make_config,
    make_prompt,
    reference_output,
    step,
)

SYSTEMS = [make_prompt(30, seed=1000), make_prompt(12, seed=1001)]


@dataclass
class Arrival:
    at_step: int
    request: Request
    abort_at: int | None  # steps after arrival
    abort_index: int | None


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    n_cells = draw(st.integers(48, 256))
    return dict(
        n_cells=n_cells,
        n_seq_max=draw(st.integers(3, 8)),
        n_batch=draw(st.integers(1, 64)),
        n_ctx_seq=draw(st.integers(16, min(n_cells, 96))),
        prefix_cache=draw(st.booleans()),
        context_shift=draw(st.booleans()),
        # small values make queued requests wait for running prompts' cells (sharing.py)
        prefix_wait_min=draw(st.integers(1, 40)),
    )


@st.composite
def arrivals(draw: st.DrawFn, i: int) -> Arrival:
    system = draw(st.sampled_from([[], *SYSTEMS]))
    prompt = system + make_prompt(draw(st.integers(1, 40)), seed=draw(st.integers(0, 5)))
    seeded = draw(st.booleans())
    sampling = SamplingParams(temperature=0.7 if seeded else 0.0, seed=i if seeded else None)
    request = Request(
        f"r{i}",
        prompt,
        sampling=sampling,
        max_tokens=draw(st.integers(1, 60)),
        min_tokens=draw(st.integers(0, 3)),
        stop_token_ids=frozenset({0, 1}),
        ignore_eos=draw(st.booleans()),
        n=draw(st.integers(1, 3)),
        n_keep=draw(st.integers(0, 20)),
        context_shift=draw(st.sampled_from([None, True, False])),
    )
    aborted = draw(st.booleans()) and draw(st.booleans())
    return Arrival(
        at_step=draw(st.integers(0, 30)),
        request=request,
        abort_at=draw(st.integers(0, 40)) if aborted else None,
        abort_index=draw(st.sampled_from([None, 0, 1])),
    )


def workloads() -> st.SearchStrategy[list[Arrival]]:
    return (
        st.integers(1, 8).flatmap(lambda k: st.tuples(*[arrivals(i) for i in range(k)])).map(list)
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), work=workloads())
def test_random_workloads_end_cleanly(cfg: dict[str, object], work: list[Arrival]) -> None:
    run_workload(cfg, work, windows=(0,))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs(),
    work=st.integers(6, 14).flatmap(lambda k: st.tuples(*[arrivals(i) for i in range(k)])),
)
def test_random_workloads_past_the_seq_ids(cfg: dict[str, object], work: list[Arrival]) -> None:
    """More requests than seq ids: holders are demoted into the prefix index and its leaves
    evicted under pressure, checked against the memory's held cells after every step."""
    run_workload({**cfg, "n_seq_max": 3, "prefix_cache": True}, list(work), windows=(0,))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs(),
    work=workloads(),
    window=st.one_of(st.integers(1, 12), st.integers(13, 120)),
    kind=st.sampled_from(["iswa", "unified"]),
    index_cells=st.sampled_from([None, 0, 6, 40]),
)
def test_random_workloads_with_a_sliding_window(
    cfg: dict[str, object], work: list[Arrival], window: int, kind: str, index_cells: int | None
) -> None:
    """Layers 0 and 2 full attention, layer 1 a window: iSWA gives it its own small pool,
    the unified cache only narrows what it reads. iSWA's prefix index keeps windows within
    `index_cells` of the window pool (None: n_cells / 4; 0: no index)."""
    spec = MemorySpec.of([Attention(1, 4), Attention(1, 4, window), Attention(1, 4)])
    cfg = {**cfg, "memory_spec": spec, "memory": kind, "swa_index_cells": index_cells}
    run_workload(cfg, work, windows=(0, window))
    event(f"memory: {kind}")


def run_workload(cfg: dict[str, object], work: list[Arrival], windows: tuple[int, ...]) -> None:
    config = make_config(**cfg)
    sched = Scheduler(config)
    worker = FakeWorker(config.n_cells)
    outcome = Outcome()
    accepted: dict[str, Arrival] = {}
    n_step = 0
    while n_step <= 30 or sched.has_work:
        for a in work:
            if a.at_step == n_step:
                try:
                    sched.add_request(a.request)
                except ValueError:
                    assert (
                        len(a.request.prompt_ids) >= config.n_ctx_seq
                        or a.request.n > config.n_seq_max
                        or a.request.min_tokens > a.request.max_tokens
                    )
                    continue
                accepted[a.request.req_id] = a
            if a.abort_at is not None and a.at_step + a.abort_at == n_step:
                sched.abort(a.request.req_id, a.abort_index)
        step(sched, worker, outcome)
        check_prefix_index(sched)
        n_step += 1
        assert n_step < 5000, "no progress"

    for req_id, a in accepted.items():
        r = a.request
        for i in range(r.n):
            finish = outcome.finish[(req_id, i)]
            tokens = outcome.tokens.get((req_id, i), [])
            assert finish.num_output_tokens in (len(tokens), len(tokens) + 1)
            if len(r.prompt_ids) >= config.n_ctx_seq:
                continue  # truncated prompt: the reference reads the whole prompt
            expected, _ = reference_output(r, config.n_ctx_seq, choice=i, windows=windows)
            if r.sampling.seed is None and r.sampling.temperature > 0:
                continue
            if finish.reason == "abort":
                assert tokens == expected[: len(tokens)]
            else:
                shift = r.context_shift if r.context_shift is not None else config.context_shift
                limit = len(expected) if shift else config.n_ctx_seq - len(r.prompt_ids) + 1
                assert tokens == expected[:limit]
    c = sched.counters
    radix = sched.seq_ids.radix
    event(f"prefix index used: {radix is not None and radix.num_nodes > 0}")
    event(f"preempted: {c.num_preemptions > 0}")
    event(f"shifted: {c.num_context_shifts > 0}")
    event(f"prefix hit: {c.prefix_hit_tokens > 0}")
    event(f"shared a running prefix: {sched.counters.prefix_running_hit_tokens > 0}")
    event(f"aborted: {any(e.reason == 'abort' for e in outcome.finish.values())}")
    holders = sched.prefix.seq_ids
    assert sched.num_free_seq_ids == config.n_seq_max - len(holders)
    owned = sum(sched.memory.seq_num_cells(h) for h in holders)
    # the prefix index's (scheduler/radix.py): its cells and, on iSWA, its windows' cells
    held = 0 if radix is None else radix.num_cells + sum(radix.num_window_cells)
    assert sched.memory.num_used <= owned + held
    sched.clear_prefix_cache()
    assert sched.memory.num_used == 0
    assert sched.num_free_seq_ids == config.n_seq_max
    sched.memory.check()


def check_prefix_index(sched: Scheduler) -> None:
    """The cells the prefix index points at are exactly the cells the memory holds."""
    radix = sched.seq_ids.radix
    if radix is None:
        return
    tree = np.sort(radix.held())
    assert np.unique(tree).size == tree.size == radix.num_cells
    held = sched.memory.pools[0].cells.held  # type: ignore[attr-defined]
    assert (tree == np.flatnonzero(held)).all()
    # every window pool: the cells some window holds are exactly those the memory holds there
    for p, cells in enumerate(radix.held_windows(), start=1):
        pool_held = sched.memory.pools[p].cells.held  # type: ignore[attr-defined]
        assert (cells == np.flatnonzero(pool_held)).all()
        assert cells.size == radix.num_window_cells[p - 1] <= radix.budget[p - 1]
