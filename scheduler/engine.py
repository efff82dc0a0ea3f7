"""The engine: a thread that runs `schedule -> execute -> update` and streams events to asyncio.

The lock guards the scheduler; it is released while the worker runs, so submit, abort and
the snapshots never wait for a forward pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvcache.memory import Memory
from scheduler.cache_tier import CacheTier, TierStats
from scheduler.config import EngineConfig
from scheduler.errors import EngineDeadError, EngineDrainingError, QueueFullError
from scheduler.isolate import describe, isolate
from scheduler.kv_blocks import BlockLedger, KVEvent
from scheduler.plan import BatchPlan, StepOutput, Worker
from scheduler.request import Event, FinishEvent, Request
from scheduler.scheduler import Routed, Scheduler
from scheduler.snapshot import engine_stats, pool_cell_bytes, pool_maps, slot_infos
from scheduler.speculative import Drafter
from scheduler.stats import CellMapSnapshot, EngineStats, SlotInfo, StepStats

__all__ = ["Engine", "EngineConfig", "Worker"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[Event]]
    open: set[int]  # choice indices without a FinishEvent yet


class Engine:
    def __init__(
        self,
        worker: Worker,
        config: EngineConfig,
        on_step: Callable[[StepStats], None] | None = None,
        memory: Memory | None = None,
        drafter: Drafter | None = None,
        tier: CacheTier | None = None,
    ) -> None:
        """`memory`: the one the worker's storage was built for; None: built from config.
        `drafter`: the draft model of speculative decoding (config.spec.kind "draft").
        `tier`: the prefix cache's second tier (RAM / disk), if any."""
        self.worker = worker
        self.config = config
        self.on_step = on_step
        self.scheduler = Scheduler(config, memory, drafter)
        self.tier = tier
        # a recurrent model's worker says what one state slot costs (/metrics, the cell map)
        self.state_bytes_per_slot = int(getattr(worker, "state_bytes_per_slot", 0) or 0)
        # and what one cell of each K/V pool costs as stored (its cache types)
        group_bytes = list(getattr(worker, "kv_bytes_per_group", None) or ())
        self.cell_bytes = pool_cell_bytes(self.scheduler.memory, group_bytes)
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._dead = False
        self._publish_kv: Callable[[list[KVEvent]], None] | None = None
        self._calls: list[tuple[Callable[[Scheduler, Any], Any], Future[Any]]] = []

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._run, name="cellserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, drain_timeout: float) -> None:
        """Stops admission, lets accepted requests finish for up to `drain_timeout` seconds,
        aborts the rest, and joins the thread."""
        deadline = time.monotonic() + drain_timeout
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while self.scheduler.has_work and not self._dead:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    break
                self._cond.wait(min(left, 0.05))
            self._stopping = True
            events = self.scheduler.abort_all()
            self._dispatch(events)
            self._publish_kv_events()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self.tier is not None:
            self.tier.close()

    # ---- requests -------------------------------------------------------------------------

    def submit(self, request: Request) -> AsyncIterator[Event]:
        """Queues `request`; its events arrive through the returned iterator, which ends
        after the last choice's FinishEvent. Call from a running event loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        with self._cond:
            if self._dead:
                raise EngineDeadError("the engine thread died")
            if self._draining or self._stopping:
                raise EngineDrainingError("the engine is shutting down")
            if self.scheduler.num_waiting_requests >= self.config.max_queue:
                raise QueueFullError(f"{self.config.max_queue} requests are waiting")
            self.scheduler.add_request(request)
            self._streams[request.req_id] = _Stream(loop, queue, set(range(request.n)))
            self._cond.notify_all()
        return self._iterate(request.req_id, queue, request.n)

    async def _iterate(
        self, req_id: str, queue: asyncio.Queue[list[Event]], n: int
    ) -> AsyncIterator[Event]:
        num_open = n
        try:
            while num_open:
                for event in await queue.get():
                    if isinstance(event, FinishEvent):
                        num_open -= 1
                    yield event
        finally:
            if num_open:  # the consumer left early (client gone): free its cells
                self.abort(req_id)

    def abort(self, req_id: str, index: int | None = None) -> None:
        with self._cond:
            self.scheduler.abort(req_id, index)
            self._cond.notify_all()

    def call(self, fn: Callable[[Scheduler, Any], T]) -> T:
        """fn(scheduler, worker) on the engine thread between two steps, where the worker is
        idle and the cells cannot move (slot save/restore); blocks the calling thread (never
        call it from the event loop) and returns fn's result or raises its exception."""
        future: Future[T] = Future()
        with self._cond:
            if self._dead:
                raise EngineDeadError("the engine thread died")
            if self._stopping or self._thread is None:
                raise EngineDrainingError("the engine is not running")
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def _run_calls(self) -> None:
        """The queued calls (engine lock held)."""
        calls, self._calls = self._calls, []
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.scheduler, self.worker))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
                future.set_exception(exc)
        if calls:
            self._publish_kv_events()

    def _cancel_calls(self) -> None:
        calls, self._calls = self._calls, []
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDrainingError("the engine stopped"))

    # ---- snapshots ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._cond:
            return engine_stats(
                self.scheduler,
                not self._dead,
                self._draining,
                self.state_bytes_per_slot,
                self.cell_bytes,
            )

    def tier_stats(self) -> list[tuple[str, TierStats]]:
        """Per store of the prefix cache's second tier: (its name, a copy of its counts)."""
        with self._cond:
            if self.tier is None:
                return []
            return [
                (store.name, dataclasses.replace(stats))
                for store, stats in zip(self.tier.stores, self.tier.stats, strict=True)
            ]

    def slots(self) -> list[SlotInfo]:
        with self._cond:
            return slot_infos(self.scheduler)

    def cell_map(self) -> CellMapSnapshot:
        with self._cond:
            pools = pool_maps(self.scheduler.memory, self.state_bytes_per_slot, self.cell_bytes)
            return CellMapSnapshot(
                n_cells=pools[0].n_cells,
                head=pools[0].head,
                owner_map=pools[0].owner_map,
                pools=pools,
                slots=slot_infos(self.scheduler),
                holder_seq_ids=self.scheduler.prefix.seq_ids,
                stats=engine_stats(
                    self.scheduler,
                    not self._dead,
                    self._draining,
                    self.state_bytes_per_slot,
                    self.cell_bytes,
                ),
            )

    # ---- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as exc:  # noqa: BLE001 - nobody may hang on a dead engine
            log.exception("engine loop died")
            message = f"engine died: {type(exc).__name__}: {exc}"
            with self._cond:
                self._dead = True
                try:
                    self._dispatch(self.scheduler.abort_all("error", message))
                except Exception:  # noqa: BLE001 - the scheduler may be what broke
                    log.exception("could not abort the scheduler's requests")
                for stream in self._streams.values():
                    self._send(stream, [_error_event(i, message) for i in sorted(stream.open)])
                self._streams.clear()
                self._cancel_calls()
                self._cond.notify_all()

    def enable_kv_events(self, block_size: int, publish: Callable[[list[KVEvent]], None]) -> None:
        """Announce the virtual blocks (scheduler.kv_blocks) of the prefix cache and of the
        running sequences: `publish` gets each step's events on the engine thread and must
        not block."""
        with self._cond:
            ledger = BlockLedger(block_size)
            for sid in self.scheduler.prefix.seq_ids:
                prefix = self.scheduler.prefix
                ledger.add(sid, prefix.tokens(sid), prefix.lora(sid))
            self.scheduler.prefix.ledger = ledger
            if self.scheduler.seq_ids.radix is not None:
                self.scheduler.seq_ids.radix.announce(ledger)
            self._publish_kv = publish

    def _publish_kv_events(self) -> None:
        if self._publish_kv is None:
            return
        kv_events = self.scheduler.take_kv_events()
        if kv_events:
            try:
                self._publish_kv(kv_events)
            except Exception:  # noqa: BLE001 - a publisher's fault never stops the engine
                log.exception("KV events publisher failed")

    def _step(self) -> bool:
        """One step; False when the engine stops."""
        with self._cond:
            while not self.scheduler.has_work and not self._stopping and not self._calls:
                self._cond.wait()
            if self._stopping:
                self._cancel_calls()
                return False
            self._run_calls()
            if not self.scheduler.has_work:
                return True
            t0 = time.perf_counter()
            if self.tier is not None:
                self.tier.before_schedule(self.scheduler, self.worker)
            plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        error: str | None = None
        out = StepOutput(token_ids=[])
        failed: dict[int, str] = {}
        if plan.num_tokens:
            try:
                out, failed = self._execute(plan)
            except Exception as exc:  # noqa: BLE001 - the batch fails, the engine serves on
                log.exception("worker failed on the pending cache work of a batch")
                error = describe(exc)
        t2 = time.perf_counter()
        with self._cond:
            if error is None:
                self.scheduler.fail_seqs(failed)
                events = self.scheduler.update(plan, out)
                if self.tier is not None:
                    self.tier.after_update(self.scheduler, self.worker)
            else:
                events = self.scheduler.fail_plan(error)
            self._dispatch(events)
            self._publish_kv_events()
            self._cond.notify_all()
            t3 = time.perf_counter()
            if not plan.num_tokens and not events:
                self._cond.wait(0.01)  # NOTE: nothing could run; never spin on the lock
        if self.on_step is not None and plan.num_tokens:
            counters = self.scheduler.counters
            stats = StepStats(
                num_tokens=plan.num_tokens,
                num_decode=counters.last_num_decode,
                num_prefill=counters.last_num_prefill,
                step_time=t3 - t0,
                schedule_time=(t1 - t0) + (t3 - t2),
            )
            try:
                self.on_step(stats)
            except Exception:  # noqa: BLE001
                log.exception("on_step callback failed")
        return True

    def _execute(self, plan: BatchPlan) -> tuple[StepOutput, dict[int, str]]:
        """-> (the plan's output, {seq_id: error} of the sequences the worker fails on). A
        failing batch is bisected so that only the culprits' requests fail (scheduler/isolate.py).
        An exception from the pending cache work itself propagates: the whole batch fails."""
        if plan.has_pending:
            self.worker.execute(plan.pending_only())
        forward = plan.without_pending()
        try:
            return self.worker.execute(forward), {}
        except Exception as exc:  # noqa: BLE001 - find the culprit, the others go on
            log.exception("worker failed on a batch of %d tokens; isolating", plan.num_tokens)
            out, failed = isolate(self.worker, forward, describe(exc))
            log.warning("failing %d of %d sequences: %s", len(failed), len(plan.seqs), failed)
            return out, failed

    def _dispatch(self, routed: list[Routed]) -> None:
        """Hands each request its events of this step in one call (engine lock held)."""
        by_req: dict[str, list[Event]] = {}
        for req_id, event in routed:
            by_req.setdefault(req_id, []).append(event)
        for req_id, events in by_req.items():
            stream = self._streams.get(req_id)
            if stream is None:
                continue
            for event in events:
                if isinstance(event, FinishEvent):
                    stream.open.discard(event.index)
            if not stream.open:
                del self._streams[req_id]
            if not self._send(stream, events):
                self.scheduler.abort(req_id)

    @staticmethod
    def _send(stream: _Stream, events: list[Event]) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, events)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            return False
        return True


def _error_event(index: int, message: str) -> FinishEvent:
    return FinishEvent(
        index=index,
        reason="error",
        num_prompt_tokens=0,
        num_cached_tokens=0,
        num_output_tokens=0,
        error=message,
    )
