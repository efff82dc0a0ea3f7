"""Both pools of an iSWA memory, labelled, in /v1/cache/cells's payload and in /metrics."""

from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvcache.spec import Attention, MemorySpec
from scheduler.scheduler import Scheduler
from scheduler.snapshot import engine_stats, pool_maps, slot_infos
from scheduler.stats import CellMapSnapshot
from server.cache_map import cell_map_payload, decode_runs
from server.metrics import Metrics
from tests.scheduler.fakes import FakeWorker, Outcome, make_config, make_request, step

SPEC = MemorySpec.of([Attention(1, 4), Attention(1, 4, 8)])


def busy_scheduler() -> Scheduler:
    config = make_config(n_cells=256, n_seq_max=4, n_batch=32, memory_spec=SPEC)
    sched, worker, outcome = Scheduler(config), FakeWorker(256), Outcome()
    for i in range(2):
        sched.add_request(make_request(f"r{i}", prompt_len=40, max_tokens=20, seed=i))
    for _ in range(6):
        step(sched, worker, outcome)
    return sched


def test_the_cell_map_payload_lists_both_pools() -> None:
    sched = busy_scheduler()
    stats = engine_stats(sched, alive=True, draining=False)
    pools = pool_maps(sched.memory)
    slots = slot_infos(sched)
    snap = CellMapSnapshot(256, pools[0].head, pools[0].owner_map, slots, [], stats, pools)
    body = cell_map_payload(snap)
    full, swa = body["pools"]
    assert (full["name"], full["window"], full["n_cells"]) == ("full", 0, 256)
    # W x n_seq_max + n_batch, and n_cells / 4 for the prefix index's windows
    assert (swa["name"], swa["window"], swa["n_cells"]) == ("swa", 8, 8 * 4 + 32 + 256 // 4)
    assert full["used"] == body["totals"]["used"] == sum(s.num_computed for s in sched.running)
    assert swa["used"] == len(decode_runs(swa["owner_runs"])) - swa["free"]
    assert swa["used"] <= 2 * 8 + 2  # each sequence's window, plus its last row
    assert body["owner_runs"] == full["owner_runs"]


def test_metrics_label_each_pool_and_keep_the_unlabelled_full_pool_gauges() -> None:
    sched = busy_scheduler()
    stats = engine_stats(sched, alive=True, draining=False)
    metrics = Metrics()
    metrics.bind_engine(lambda: stats)
    text = metrics.render()[0].decode()
    samples = {
        (s.name, s.labels.get("pool")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    swa = sched.memory.pools[1].cells
    assert samples[("cellserve_kv_pool_cells_used", "full")] == stats.cells_used
    assert samples[("cellserve_kv_pool_cells_used", "swa")] == swa.used
    assert samples[("cellserve_kv_pool_cells_total", "swa")] == swa.n_cells
    assert samples[("cellserve_kv_cells_used", None)] == stats.cells_used  # the full pool
    assert samples[("cellserve_kv_cells_total", None)] == 256
    ratio = samples[("cellserve_kv_pool_usage_ratio", "swa")]
    assert np.isclose(ratio, swa.used / swa.n_cells)
