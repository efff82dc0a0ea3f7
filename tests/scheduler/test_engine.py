from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from scheduler.engine import Engine
from scheduler.errors import EngineDeadError, EngineDrainingError, QueueFullError
from scheduler.plan import BatchPlan
from scheduler.request import Event, FinishEvent, TokenEvent
from scheduler.stats import StepStats
from tests.scheduler.fakes import FakeWorker, make_config, make_request, reference_output

POISON = 1000  # a prompt token that makes the fake worker raise


def make_engine(worker: FakeWorker | None = None, **kw: object) -> Engine:
    config = make_config(**kw)
    engine = Engine(worker or FakeWorker(config.n_cells), config)
    engine.start()
    return engine


async def collect(stream) -> list[Event]:  # noqa: ANN001
    return [ev async for ev in stream]


def tokens_of(events: list[Event], index: int = 0) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.index == index]


def finishes(events: list[Event]) -> list[FinishEvent]:
    return [e for e in events if isinstance(e, FinishEvent)]


def test_concurrent_streams_match_the_reference() -> None:
    engine = make_engine()
    reqs = [
        make_request(f"r{i}", prompt_len=10 + i, max_tokens=20, seed=i, n=1 + i % 2)
        for i in range(6)
    ]

    async def main() -> list[list[Event]]:
        return await asyncio.gather(*[collect(engine.submit(r)) for r in reqs])

    results = asyncio.run(main())
    for req, events in zip(reqs, results, strict=True):
        assert [f.reason for f in finishes(events)] == ["length"] * req.n
        for i in range(req.n):
            assert tokens_of(events, i) == reference_output(req, 128, choice=i)[0]
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_generated_tokens == sum(20 * r.n for r in reqs)
    engine.shutdown(drain_timeout=1)


def test_abort_from_asyncio_ends_the_stream_and_frees_the_cells() -> None:
    engine = make_engine(prefix_cache=False)

    async def main() -> list[Event]:
        stream = engine.submit(make_request("long", max_tokens=100_000, n=2))
        events: list[Event] = []
        async for ev in stream:
            events.append(ev)
            if len(events) == 10:
                engine.abort("long")
        return events

    events = asyncio.run(main())
    assert sorted((f.index, f.reason) for f in finishes(events)) == [(0, "abort"), (1, "abort")]
    assert engine.stats().cells_used == 0
    engine.shutdown(drain_timeout=1)


def test_a_consumer_that_leaves_early_aborts_its_request() -> None:
    engine = make_engine(prefix_cache=False)

    async def main() -> None:
        stream = engine.submit(make_request("gone", max_tokens=100_000))
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().num_running == 0
    assert engine.stats().cells_used == 0
    engine.shutdown(drain_timeout=1)


def test_worker_failure_fails_the_batch_and_the_engine_serves_on() -> None:
    def poisoned(plan: BatchPlan) -> bool:
        return bool(np.any(plan.token_ids == POISON))

    engine = make_engine(FakeWorker(256, fail_when=poisoned))
    bad = make_request("bad", max_tokens=5)
    bad.prompt_ids = [*bad.prompt_ids, POISON]

    async def main() -> tuple[list[Event], list[Event]]:
        failed = await collect(engine.submit(bad))
        served = await collect(engine.submit(make_request("good", max_tokens=5)))
        return failed, served

    failed, served = asyncio.run(main())
    (f,) = finishes(failed)
    assert f.reason == "error" and "injected worker failure" in (f.error or "")
    assert finishes(served)[0].reason == "length"
    assert tokens_of(served) == reference_output(make_request("good", max_tokens=5), 128)[0]
    assert engine.stats().alive
    engine.shutdown(drain_timeout=1)


def test_a_dead_loop_finishes_every_stream_with_an_error() -> None:
    class Dying(FakeWorker):
        def execute(self, plan: BatchPlan):  # noqa: ANN201
            raise SystemExit("the loop itself breaks")

    engine = make_engine(Dying(256))

    async def main() -> list[Event]:
        return await collect(engine.submit(make_request("r", n=2)))

    events = asyncio.run(main())
    assert sorted(f.index for f in finishes(events)) == [0, 1]
    assert {f.reason for f in finishes(events)} == {"error"}
    assert not engine.stats().alive

    async def again() -> None:
        engine.submit(make_request("late"))

    with pytest.raises(EngineDeadError):
        asyncio.run(again())
    engine.shutdown(drain_timeout=0)


def test_submit_errors() -> None:
    config = make_config(max_queue=1)
    engine = Engine(FakeWorker(256), config)  # not started: requests stay queued

    async def main() -> None:
        with pytest.raises(ValueError, match="empty prompt"):
            engine.submit(make_request("empty", prompt_len=0))
        engine.submit(make_request("first"))
        with pytest.raises(QueueFullError):
            engine.submit(make_request("second"))

    asyncio.run(main())


def test_shutdown_drains_running_requests_then_refuses_new_ones() -> None:
    steps: list[StepStats] = []
    config = make_config()
    engine = Engine(FakeWorker(256), config, on_step=steps.append)
    engine.start()

    async def main() -> list[list[Event]]:
        streams = [engine.submit(make_request(f"r{i}", max_tokens=30, seed=i)) for i in range(3)]
        drain = threading.Thread(target=engine.shutdown, args=(30.0,))
        drain.start()
        results = await asyncio.gather(*[collect(s) for s in streams])
        with pytest.raises(EngineDrainingError):
            engine.submit(make_request("late"))
        await asyncio.to_thread(drain.join)
        return results

    results = asyncio.run(main())
    assert all(finishes(r)[0].reason == "length" for r in results)
    assert steps and all(s.num_tokens > 0 and s.schedule_time <= s.step_time for s in steps)
    assert sum(s.num_decode for s in steps) + 3 == 90
    assert engine.stats().draining


def test_shutdown_timeout_aborts_the_rest() -> None:
    engine = make_engine()

    async def main() -> list[Event]:
        stream = engine.submit(make_request("endless", max_tokens=10_000_000))
        first = await anext(aiter(stream))
        await asyncio.to_thread(engine.shutdown, 0.05)
        return [first, *[ev async for ev in stream]]

    events = asyncio.run(main())
    assert finishes(events)[-1].reason == "abort"


def test_idle_engine_sleeps_and_snapshots_are_consistent() -> None:
    worker = FakeWorker(256)
    engine = make_engine(worker)

    async def main() -> None:
        stream = engine.submit(make_request("r", prompt_len=30, max_tokens=200, n=2))
        async for ev in stream:
            if isinstance(ev, TokenEvent) and ev.index == 0 and ev.token_id >= 0:
                snap = engine.cell_map()
                owned = {s.seq_id for s in snap.slots if s.seq_id >= 0}
                live = set(np.asarray(snap.owner_map).tolist()) - {-1, -2}
                assert live <= owned | set(snap.holder_seq_ids)
                assert snap.stats.cells_used == int((np.asarray(snap.owner_map) != -1).sum())
                break
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
    time.sleep(0.1)
    calls = worker.num_calls
    steps = engine.stats().num_steps
    time.sleep(0.3)
    assert worker.num_calls == calls and engine.stats().num_steps == steps
    engine.shutdown(drain_timeout=1)
