"""A fake engine that answers cell_map() (and what create_app's lifespan calls), served by the
real app: create_app with a backend factory, in uvicorn on a free port."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcache.cells import FREE, SHARED
from scheduler.stats import CellMapSnapshot, EngineStats, SlotInfo
from server.backend import Backend
from tests.live_server import LiveServer, start_server


def make_stats(owner_map: np.ndarray, holders: list[int], **counters: int) -> EngineStats:
    single = owner_map[owner_map >= 0]
    values = dict(
        num_waiting=0,
        num_running=0,
        n_cells=owner_map.size,
        cells_used=int(np.count_nonzero(owner_map != FREE)),
        cells_shared=int(np.count_nonzero(owner_map == SHARED)),
        cells_cached=int(np.count_nonzero(np.isin(single, holders))),
        prefix_cache_queried_tokens=0,
        prefix_cache_hit_tokens=0,
        num_context_shifts=0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generated_tokens=0,
        num_steps=0,
        alive=True,
        draining=False,
    )
    values.update(counters)
    return EngineStats(**values)


def make_slot(req_id: str, seq_id: int, owner_map: np.ndarray, num_shared: int = 0) -> SlotInfo:
    cells = np.flatnonzero(owner_map == seq_id)
    return SlotInfo(
        req_id=req_id,
        index=0,
        seq_id=seq_id,
        state="decode",
        num_prompt=len(cells) - 1,
        num_computed=len(cells) - 1,
        num_generated=1,
        cells_owned=len(cells) + num_shared,
        cells_shared=num_shared,
        pos_min=0,
        pos_max=len(cells) + num_shared - 1,
    )


@dataclass
class FakeEngine:
    """Cells laid out by hand: seq 0 at [0, 5), shared [5, 8), seq 1 at [8, 12), holder 7 at
    [20, 24); `head` after seq 1 (see make_busy_engine). Tests mutate `owner_map` and
    `live_slots` to simulate steps."""

    n_cells: int = 64
    owner_map: np.ndarray = field(default_factory=lambda: np.full(64, FREE, dtype=np.int32))
    holders: list[int] = field(default_factory=list)
    live_slots: list[SlotInfo] = field(default_factory=list)
    head: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    num_calls: int = 0

    def start(self) -> None:
        pass

    def shutdown(self, drain_timeout: float) -> None:
        pass

    def stats(self) -> EngineStats:
        return make_stats(self.owner_map, self.holders, **self.counters)

    def slots(self) -> list[SlotInfo]:
        return list(self.live_slots)

    def cell_map(self) -> CellMapSnapshot:
        self.num_calls += 1
        owner_map = self.owner_map.copy()
        return CellMapSnapshot(
            n_cells=self.n_cells,
            head=self.head,
            owner_map=owner_map,
            slots=list(self.live_slots),
            holder_seq_ids=list(self.holders),
            stats=make_stats(owner_map, self.holders, **self.counters),
        )


def make_busy_engine(n_cells: int = 64) -> FakeEngine:
    owner_map = np.full(n_cells, FREE, dtype=np.int32)
    owner_map[0:5] = 0
    owner_map[5:8] = SHARED
    owner_map[8:12] = 1
    owner_map[20:24] = 7
    slots = [make_slot("chatcmpl-a", 0, owner_map, 3), make_slot("chatcmpl-b", 1, owner_map, 3)]
    counters = dict(prefix_cache_hit_tokens=3, prefix_cache_queried_tokens=12, num_running=2)
    return FakeEngine(n_cells, owner_map, [7], slots, head=12, counters=counters)


def start_fake_server(engine: FakeEngine, expert_load=None, **settings) -> LiveServer:
    """The whole app (routes, auth, the page) over the fake engine; `expert_load`: a MoE
    model's (Backend.expert_load)."""

    def factory(_settings, _on_step) -> Backend:
        backend = Backend(engine, None, None, "fake-model", 512, engine.n_cells, 0)
        backend.expert_load = expert_load
        return backend

    return start_server(factory, ready_timeout=20, **settings)
