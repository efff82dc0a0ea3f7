"""Prometheus metrics. The only module that imports prometheus_client; one registry per app.

Engine-side numbers come from engine.stats() at scrape time; latencies are observed by the
server as tokens reach the client. The `vllm:*` gauges are the Kubernetes Gateway API
Inference Extension's model-server protocol (TotalQueuedRequests, TotalRunningRequests,
KVCacheUtilization), with vLLM's names so that an InferencePool can scrape this server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.core import HistogramMetricFamily as HistogramMetricFamily  # metrics_engine
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from scheduler.cache_tier import TierStats
from scheduler.stats import EngineStats, StepStats
from server.process_memory import MemoryParts, memory_breakdown

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

StatsSource = Callable[[], EngineStats | None]


class _ExpertCollector(Collector):
    """A mixture-of-experts model's expert load: per layer and expert, the tokens routed to it
    (each token counts once for each of its top-k experts)."""

    def __init__(self) -> None:
        self.source: Callable[[], list[list[int]]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        family = CounterMetricFamily(
            "cellserve_moe_expert_rows",
            "Tokens routed to each expert of each MoE layer (top-k: k per token)",
            labels=["layer", "expert"],
        )
        for layer, counts in enumerate(self.source()):
            for expert, n in enumerate(counts):
                family.add_metric([str(layer), str(expert)], float(n))
        yield family


class _TierCollector(Collector):
    """The prefix cache's second tier (scheduler/cache_tier.py), labelled by tier (ram, disk):
    what it holds, what it saved or dropped, and the entries and tokens it gave back."""

    def __init__(self) -> None:
        self.source: Callable[[], list[tuple[str, TierStats]]] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        rows = self.source()
        specs = [
            ("cellserve_cache_tier_entries", "Prefix-cache entries the tier holds", "entries", 0),
            ("cellserve_cache_tier_bytes", "Bytes of the entries the tier holds", "bytes", 0),
            ("cellserve_cache_tier_saves", "Holders copied into the tier", "saves", 1),
            (
                "cellserve_cache_tier_dropped_saves",
                "Holders not copied because the tier's writer was behind",
                "dropped_saves",
                1,
            ),
            ("cellserve_cache_tier_hits", "Entries restored into the live cache", "hits", 1),
            (
                "cellserve_cache_tier_hit_tokens",
                "Tokens of the entries restored into the live cache",
                "hit_tokens",
                1,
            ),
            (
                "cellserve_cache_tier_failed_loads",
                "Entries discarded when read (damaged, torn, another layout)",
                "failed_loads",
                1,
            ),
        ]
        for name, doc, attr, is_counter in specs:
            kind = CounterMetricFamily if is_counter else GaugeMetricFamily
            family = kind(name, doc, labels=["tier"])
            for tier, stats in rows:
                family.add_metric([tier], float(getattr(stats, attr)))
            yield family


class _LoraCollector(Collector):
    """vLLM's vllm:lora_requests_info (llm-d's scorers read it): labels max_lora and the
    comma-separated names of the adapters of running and waiting requests, value the scrape
    time (vLLM: the time of the last change)."""

    def __init__(self, source: StatsSource) -> None:
        self.source = source
        self.names: dict[int, str] = {}  # adapter id -> name; {} = no adapters, no metric

    def collect(self) -> Iterator[Metric]:
        s = self.source()
        if s is None or not self.names:
            return
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        # an unloaded adapter's requests may still run (server/lora_runtime.py): its id
        waiting = ",".join(self.names.get(i, str(i)) for i in s.waiting_lora_ids)
        running = ",".join(self.names.get(i, str(i)) for i in s.running_lora_ids)
        info.add_metric([str(len(self.names)), waiting, running], time.time())
        yield info


class _InfoCollector(Collector):
    """An info gauge: `name` 1, labelled; nothing until the labels are set."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self.labels: dict[str, str] = {}

    def collect(self) -> Iterator[Metric]:
        if not self.labels:
            return
        keys = sorted(self.labels)
        info = GaugeMetricFamily(self.name, self.doc, labels=keys)
        info.add_metric([self.labels[k] for k in keys], 1.0)
        yield info


class _CellBytesCollector(Collector):
    """cellserve_kv_cache_bytes_per_cell: one token's K and V over every layer as stored,
    labelled with the cache types (--cache-type-k / --cache-type-v)."""

    def __init__(self) -> None:
        self.value: tuple[int, str, str] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.value is None:
            return
        n, type_k, type_v = self.value
        g = GaugeMetricFamily(
            "cellserve_kv_cache_bytes_per_cell",
            "Bytes of one cell (a token's K and V in every layer) in the cache types stored",
            labels=["cache_type_k", "cache_type_v"],
        )
        g.add_metric([type_k, type_v], float(n))
        yield g


class _MemoryCollector(Collector):
    def __init__(self) -> None:
        self.parts: MemoryParts | None = None

    def collect(self) -> Iterator[Metric]:
        if self.parts is None:
            return
        g = GaugeMetricFamily(
            "cellserve_memory_bytes",
            "Process memory by part: weights mapped from the model file (size; resident file "
            "pages), weights, KV cache and recurrent state slots in process memory, other "
            "anonymous memory, RSS",
            labels=["part"],
        )
        for part, value in memory_breakdown(self.parts).items():
            g.add_metric([part], float(value))
        yield g


class Latency:
    """One latency as two histograms: `cellserve_<name>` over every model (what the bundled
    dashboards read), and vLLM's `vllm:<name>{model_name}` per model (what vLLM's dashboards
    and routers read; several models in one server, server/model_router.py)."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str) -> None:
        buckets = _LATENCY_BUCKETS
        self.all = Histogram(f"cellserve_{name}", doc, buckets=buckets, registry=registry)
        self.per_model = Histogram(
            f"vllm:{name}", doc, ["model_name"], buckets=buckets, registry=registry
        )

    def observe(self, seconds: float, model_name: str) -> None:
        self.all.observe(seconds)
        self.per_model.labels(model_name=model_name).observe(seconds)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._stats_source: StatsSource = lambda: None
        from server.metrics_engine import EngineCollector  # NOTE: it imports this module

        self.registry.register(EngineCollector(lambda: self._stats_source()))
        # what the model runs with (ISA path, kernels, dtype, quant): Backend.runtime
        self._runtime = _InfoCollector(
            "cellserve_runtime_info",
            "What the model runs with: ISA path, C++ kernels, dtype, quantization",
        )
        self.registry.register(self._runtime)
        self._memory = _MemoryCollector()
        self.registry.register(self._memory)
        self._cell_bytes = _CellBytesCollector()
        self.registry.register(self._cell_bytes)
        self._experts = _ExpertCollector()
        self.registry.register(self._experts)
        self._tiers = _TierCollector()
        self.registry.register(self._tiers)
        self._loras = _LoraCollector(lambda: self._stats_source())
        self.registry.register(self._loras)
        # vLLM's name and labels (server.cache_config): the cache geometry llm-d reads
        self._cache_config = _InfoCollector(
            "vllm:cache_config_info", "KV cache geometry: virtual blocks over cells"
        )
        self.registry.register(self._cache_config)
        r = self.registry
        self.requests = Counter(
            "cellserve_requests", "Finished choices by reason", ["finish_reason"], registry=r
        )
        self.ttft = Latency(
            r, "time_to_first_token_seconds", "Seconds from arrival to the first token"
        )
        self.itl = Latency(
            r, "inter_token_latency_seconds", "Seconds between consecutive tokens of a choice"
        )
        self.e2e = Latency(
            r, "e2e_request_latency_seconds", "Seconds from arrival to the last token"
        )
        self.queue_time = Latency(
            r, "request_queue_time_seconds", "Seconds from submit to admission"
        )
        self.tokens_per_step = Histogram(
            "cellserve_tokens_per_step",
            "Tokens in each engine step",
            buckets=_STEP_BUCKETS,
            registry=r,
        )

    def bind_engine(self, source: StatsSource) -> None:
        self._stats_source = source

    def set_runtime(self, labels: dict[str, str]) -> None:
        self._runtime.labels = dict(labels)

    def bind_expert_load(self, source: Callable[[], list[list[int]]] | None) -> None:
        self._experts.source = source

    def bind_tier(self, source: Callable[[], list[tuple[str, TierStats]]] | None) -> None:
        self._tiers.source = source

    def set_lora_names(self, names: dict[int, str]) -> None:
        """The served LoRA adapters' names by id (vllm:lora_requests_info)."""
        self._loras.names = dict(names)

    def set_memory(self, parts: MemoryParts) -> None:
        self._memory.parts = parts

    def set_cell_bytes(self, n: int, type_k: str, type_v: str) -> None:
        self._cell_bytes.value = (n, type_k, type_v)

    def set_cache_config(self, labels: dict[str, str]) -> None:
        self._cache_config.labels = dict(labels)

    def on_step(self, step: StepStats) -> None:
        """Engine thread callback; prometheus_client metrics are thread-safe."""
        self.tokens_per_step.observe(step.num_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
