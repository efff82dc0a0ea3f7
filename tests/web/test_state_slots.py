"""Recurrent state slots beside the KV cells: in /metrics, in /v1/cache/cells and on the page."""

from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvcache.spec import Attention, MemorySpec, Recurrent
from scheduler.engine import Engine
from scheduler.scheduler import Scheduler
from scheduler.snapshot import engine_stats, pool_maps, slot_infos
from scheduler.stats import CellMapSnapshot, PoolMap
from server.cache_map import cell_map_payload
from server.metrics import Metrics
from tests.scheduler.fakes import FakeWorker, Outcome, make_config, make_request, step
from tests.web.fakes import FREE, FakeEngine, make_busy_engine
from tests.web.page import wait_for

STATE = Recurrent(((3, 8), (2, 4, 4)))
HYBRID = MemorySpec.of([STATE, Attention(1, 4), STATE])
RECURRENT = MemorySpec.of([STATE, STATE])
SLOT_BYTES = 4096


def busy_scheduler(spec: MemorySpec) -> Scheduler:
    config = make_config(n_cells=256, n_seq_max=4, n_batch=128, memory_spec=spec)
    sched, worker, outcome = Scheduler(config), FakeWorker(256), Outcome()
    for i in range(2):
        sched.add_request(make_request(f"r{i}", prompt_len=40, max_tokens=20, seed=i))
    for _ in range(6):
        step(sched, worker, outcome)
    return sched


def samples_of(text: str) -> dict[tuple[str, str | None], float]:
    return {
        (s.name, s.labels.get("pool")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_payload_lists_the_slots_after_the_cells() -> None:
    sched = busy_scheduler(HYBRID)
    stats = engine_stats(sched, True, False, SLOT_BYTES)
    pools = pool_maps(sched.memory, SLOT_BYTES)
    snap = CellMapSnapshot(
        256, pools[0].head, pools[0].owner_map, slot_infos(sched), [], stats, pools
    )
    body = cell_map_payload(snap)
    full, recr = body["pools"]
    assert (full["name"], full["kind"], full["bytes_per_cell"]) == ("full", "cells", 0)
    assert (recr["name"], recr["kind"], recr["n_cells"]) == ("recurrent", "slots", 4 + 4)
    slots = sched.memory.pools[1].cells
    # two running sequences: a tail each, plus the checkpoint before each prompt's last row
    assert recr["used"] == slots.used == 4
    assert recr["bytes_per_cell"] == SLOT_BYTES and recr["bytes_used"] == 4 * SLOT_BYTES
    assert body["totals"]["used"] == full["used"]  # the top-level numbers stay the cells'
    assert stats.n_cells == 256


def test_metrics_count_slots_and_state_bytes() -> None:
    sched = busy_scheduler(HYBRID)
    stats = engine_stats(sched, True, False, SLOT_BYTES)
    metrics = Metrics()
    metrics.bind_engine(lambda: stats)
    samples = samples_of(metrics.render()[0].decode())
    used = sched.memory.pools[1].cells.used
    assert samples[("cellserve_state_slots_total", "recurrent")] == 8
    assert samples[("cellserve_state_slots_used", "recurrent")] == used > 0
    assert samples[("cellserve_state_slot_bytes", "recurrent")] == SLOT_BYTES
    assert samples[("cellserve_state_bytes_used", "recurrent")] == used * SLOT_BYTES
    assert ("cellserve_kv_pool_cells_total", "recurrent") not in samples
    assert samples[("cellserve_kv_cells_total", None)] == 256


def test_a_model_without_attention_reports_its_slots_as_its_cells() -> None:
    sched = busy_scheduler(RECURRENT)
    stats = engine_stats(sched, True, False)
    assert (stats.n_cells, stats.cells_used) == (8, sched.memory.pools[0].cells.used)
    infos = slot_infos(sched)
    assert [s.cells_owned for s in infos] == [2, 2]  # its tail and one checkpoint
    assert all(s.pos_max == s.num_computed - 1 for s in infos)


def test_the_engine_reads_the_slot_size_from_its_worker() -> None:
    class StateWorker(FakeWorker):
        state_bytes_per_slot = SLOT_BYTES

    config = make_config(memory_spec=HYBRID)
    engine = Engine(StateWorker(config.n_cells), config)
    assert engine.stats().pools[1].bytes_per_cell == SLOT_BYTES
    assert engine.cell_map().pools[1].bytes_per_cell == SLOT_BYTES
    assert Engine(FakeWorker(config.n_cells), config).stats().pools[1].bytes_per_cell == 0


class SlotEngine(FakeEngine):
    """The busy engine's map as the full pool, and 8 state slots: seq 0 in 0 and 1, seq 1 in 4."""

    def cell_map(self) -> CellMapSnapshot:
        snap = super().cell_map()
        slots = np.full(8, FREE, dtype=np.int32)
        slots[0:2] = 0
        slots[4] = 1
        snap.pools = [
            PoolMap("full", 0, snap.n_cells, snap.head, snap.owner_map),
            PoolMap("recurrent", 0, 8, 0, slots, "slots", SLOT_BYTES),
        ]
        return snap


POOL_JS = """
const wrap = document.querySelector('.pool-wrap[data-pool="recurrent"]');
if (!wrap) return null;
const canvas = wrap.querySelector('canvas');
return {label: wrap.querySelector('.pool-label').textContent, drawn: canvas.dataset.drawnSeqs};
"""


def test_the_page_shows_the_slots_and_their_bytes(open_page):  # type: ignore[no-untyped-def]
    busy = make_busy_engine()
    engine = SlotEngine(
        busy.n_cells, busy.owner_map, busy.holders, busy.live_slots, busy.head, busy.counters
    )
    driver = open_page(engine)
    view = wait_for(lambda: driver.execute_script(POOL_JS), what="the slots' canvas")
    assert (
        view["label"] == "recurrent state slots · 3 / 8 slots used · states 12.0 KiB (4.0 KiB each)"
    )
    assert view["drawn"] == "0,1"
