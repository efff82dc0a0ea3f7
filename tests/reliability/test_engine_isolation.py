"""The engine isolates a request that makes the worker raise: that request fails, every other
sequence of the same batch goes on with exactly the tokens it would have had, and the batch's
pending cache work (K-shifts, copies) is applied once, not again on the re-runs."""

from __future__ import annotations

import asyncio
import time

from scheduler.engine import Engine
from scheduler.plan import BatchPlan, StepOutput
from scheduler.request import Event, FinishEvent, TokenEvent
from tests.scheduler.fakes import FakeWorker, make_config, make_request, reference_output

CULPRIT = 1000  # a prompt token id; the fake model never samples it (its vocab is 97)
N_CTX = 16


class LateFailingWorker(FakeWorker):
    """Fails the way a forward pass that breaks half-way does: the plan's pending copies and
    K-shifts are applied and its rows written before the exception. A K-shift applied twice
    trips FakeWorker's 'K rotated to its position' check on the next step."""

    def __init__(self, n_cells: int) -> None:
        super().__init__(n_cells)
        self.failed_plans: list[BatchPlan] = []
        self.shifts_in_failed_steps: list[int] = []
        self._shifts = 0  # K-shifts applied since the last successful forward

    def execute(self, plan: BatchPlan) -> StepOutput:
        time.sleep(0.002)  # lets the test submit while others are mid-generation
        self._shifts += sum(int(g.pending.shift_cells.size) for g in plan.groups)
        out = super().execute(plan)
        if (plan.token_ids == CULPRIT).any():
            self.failed_plans.append(plan)
            self.shifts_in_failed_steps.append(self._shifts)
            raise RuntimeError(f"injected fault: token {CULPRIT} in the batch")
        if plan.num_tokens:
            self._shifts = 0
        return out


def tokens_of(events: list[Event]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def finish_of(events: list[Event]) -> FinishEvent:
    (finish,) = [e for e in events if isinstance(e, FinishEvent)]
    return finish


def test_culprit_fails_alone_and_pending_work_is_applied_once() -> None:
    config = make_config(n_cells=256, n_seq_max=16, n_batch=64, n_ctx_seq=N_CTX)
    worker = LateFailingWorker(config.n_cells)
    engine = Engine(worker, config)
    engine.start()
    # n_discard=2: each innocent shifts every other step once at its limit, so nearly every
    # batch carries pending K-shifts
    innocents = [
        make_request(f"ok{i}", prompt_len=8 + i, max_tokens=120, seed=i, n_discard=2)
        for i in range(6)
    ]
    culprits = []
    for i in range(3):
        req = make_request(f"bad{i}", prompt_len=6, max_tokens=10, seed=50 + i)
        req.prompt_ids[3] = CULPRIT
        culprits.append(req)

    async def main() -> tuple[list[list[Event]], list[list[Event]]]:
        async def events(req) -> list[Event]:  # noqa: ANN001
            return [ev async for ev in engine.submit(req)]

        ok = [asyncio.create_task(events(r)) for r in innocents]
        bad = []
        for req in culprits:
            while not all(t.done() for t in ok) and (
                sum(s.state == "decode" and s.pos_max >= N_CTX - 2 for s in engine.slots()) < 3
            ):
                await asyncio.sleep(0.001)  # innocents are at their limit: shifting
            bad.append(await events(req))
        return await asyncio.gather(*ok), bad

    ok_events, bad_events = asyncio.run(main())
    for req, events in zip(innocents, ok_events, strict=True):
        assert finish_of(events).reason == "length", finish_of(events)
        assert tokens_of(events) == reference_output(req, N_CTX)[0]
    for events in bad_events:
        finish = finish_of(events)
        assert finish.reason == "error" and "injected fault" in (finish.error or ""), finish
    assert len(worker.failed_plans) >= len(culprits)
    with_innocents = [p for p in worker.failed_plans if len(p.seqs) > 1]
    assert with_innocents, "no culprit shared a batch with others"
    assert any(worker.shifts_in_failed_steps), "no failing step carried K-shifts"

    stats = engine.stats()
    assert stats.alive and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.cells_used == stats.cells_cached  # only prefix-cache holders keep cells
    after = make_request("after", prompt_len=9, max_tokens=5, seed=99)

    async def one() -> list[Event]:
        return [ev async for ev in engine.submit(after)]

    assert tokens_of(asyncio.run(one())) == reference_output(after, N_CTX)[0]
    engine.shutdown(drain_timeout=1)
