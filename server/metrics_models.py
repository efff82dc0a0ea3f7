"""Per-model metrics of a multi-model server (server/model_router.py), read at scrape time.

Beside server/metrics.py (the one registry per app): the engine-wide families there (`vllm:*`,
`cellserve_kv_*`, ...) once per loaded model, labelled `model_name` as vLLM labels them, and the
router's own: each model's status, loads and unloads.
"""

from __future__ import annotations

from collections.abc import Iterator

from server.metrics import Collector, CounterMetricFamily, GaugeMetricFamily, Metric
from server.metrics_engine import EngineRows, engine_metrics
from server.model_router import ModelRouter

_STATUSES = ("unloaded", "loading", "loaded", "unloading")


class ModelsCollector(Collector):
    def __init__(self, models: ModelRouter) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        entries = list(self.models.entries.values())
        status = GaugeMetricFamily(
            "cellserve_model_status",
            "1 for each model's status (unloaded, loading, loaded, unloading), else 0",
            labels=["model", "status"],
        )
        counters = [
            ("cellserve_model_loads", "Models loaded (each load once)", "num_loads"),
            ("cellserve_model_unloads", "Models unloaded (LRU or asked)", "num_unloads"),
            ("cellserve_model_load_failures", "Loads that failed", "num_load_failures"),
        ]
        families = [(CounterMetricFamily(n, d, labels=["model"]), a) for n, d, a in counters]
        load_time = CounterMetricFamily(
            "cellserve_model_load_seconds", "Seconds spent loading the model", labels=["model"]
        )
        running = GaugeMetricFamily(
            "cellserve_model_requests_running", "Requests holding a sequence", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            "cellserve_model_requests_waiting", "Requests waiting for admission", labels=["model"]
        )
        cells = GaugeMetricFamily(
            "cellserve_model_kv_cells_used", "Cells owned by a sequence", labels=["model"]
        )
        engines: EngineRows = []
        for e in entries:
            for value in _STATUSES:
                status.add_metric([e.name, value], float(e.status == value))
            for family, attr in families:
                family.add_metric([e.name], float(getattr(e, attr)))
            load_time.add_metric([e.name], sum(e.load_seconds))
            backend = e.backend
            if backend is not None:
                s = backend.engine.stats()
                running.add_metric([e.name], float(s.num_running))
                waiting.add_metric([e.name], float(s.num_waiting))
                cells.add_metric([e.name], float(s.cells_used))
                engines.append(([e.name], s))
        yield status
        yield from (f for f, _ in families)
        yield from (load_time, running, waiting, cells)
        yield from engine_metrics(engines, ["model_name"])
