"""The engine's metric families (server/metrics.py registers them; the families come from
there, the only module that imports prometheus_client): the request and KV cache gauges, the
Gateway API's `vllm:*` protocol gauges, per-pool gauges, and the cumulative counters, read from
engine.stats() at scrape time. One row with no labels for a single model; with several models
(server/metrics_models.py) one row per loaded model, labelled `model_name` as vLLM labels them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from scheduler.speculative import SpecStats
from scheduler.stats import EngineStats
from server.metrics import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    StatsSource,
)

# (label values, stats) per engine: one row with no labels for a single model, or one row per
# loaded model labelled model_name (server/metrics_models.py)
EngineRows = list[tuple[list[str], EngineStats]]


class EngineCollector(Collector):
    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        s = self.source()
        if s is not None:
            yield from engine_metrics([([], s)], [])


def engine_metrics(rows: EngineRows, labels: list[str]) -> Iterator[Metric]:
    """The engine-wide families: each row's samples labelled `labels` (none for a single
    model: the unlabelled gauges dashboards and the Gateway API read; ["model_name"], vLLM's
    label, for each loaded model of a multi-model server)."""
    gauges = {
        "cellserve_requests_waiting": ("Requests waiting for admission", "num_waiting"),
        "cellserve_requests_running": ("Requests holding a sequence", "num_running"),
        "cellserve_kv_cells_total": ("Cells in the KV cache", "n_cells"),
        "cellserve_kv_cells_used": ("Cells owned by a sequence", "cells_used"),
        "cellserve_kv_cells_shared": ("Cells with more than one owner", "cells_shared"),
        "cellserve_kv_cells_cached": ("Cells held only by the prefix cache", "cells_cached"),
        "cellserve_kv_cache_usage_ratio": (
            "(cells_used - cells held only by the prefix index) / cells_total",
            "cache_usage",
        ),
        "cellserve_prefix_index_nodes": (
            "Nodes of the prefix index over held cells",
            "prefix_index_nodes",
        ),
        "cellserve_prefix_index_cells": (
            "Cells the prefix index holds (some also owned by running requests)",
            "prefix_index_cells",
        ),
        "cellserve_prefix_index_window_cells": (
            "Cells of the sliding-window pools the prefix index holds for its windows (iSWA)",
            "prefix_index_window_cells",
        ),
        "vllm:num_requests_waiting": ("Gateway API protocol: queued requests", "num_waiting"),
        "vllm:num_requests_running": ("Gateway API protocol: running requests", "num_running"),
        "vllm:gpu_cache_usage_perc": ("Gateway API protocol: KV cache usage 0..1", "cache_usage"),
        "vllm:kv_cache_usage_perc": ("Gateway API protocol: KV cache usage 0..1", "cache_usage"),
    }
    for name, (doc, attr) in gauges.items():
        yield _family(GaugeMetricFamily, name, doc, labels, rows, attr)
    yield from _pool_gauges(rows, labels)
    counters = {
        "cellserve_prefix_cache_queried_tokens": (
            "Prompt tokens looked up in the prefix cache",
            "prefix_cache_queried_tokens",
        ),
        "cellserve_prefix_cache_hit_tokens": (
            "Prompt tokens served by the prefix cache",
            "prefix_cache_hit_tokens",
        ),
        "cellserve_prefix_cache_running_hit_tokens": (
            "Of the prefix-cache hits, tokens shared from running sequences",
            "prefix_cache_running_hit_tokens",
        ),
        "cellserve_context_shifts": ("Context shifts applied", "num_context_shifts"),
        "cellserve_preemptions": ("Sequences preempted for cells", "num_preemptions"),
        "cellserve_prompt_tokens": ("Prompt tokens computed by the model", "num_prompt_tokens"),
        "cellserve_generation_tokens": ("Tokens generated", "num_generated_tokens"),
    }
    for name, (doc, attr) in counters.items():
        yield _family(CounterMetricFamily, name, doc, labels, rows, attr)
    spec_rows = [(values, s.spec) for values, s in rows if s.spec is not None]
    if spec_rows:
        yield from _spec_metrics(spec_rows, labels)


def _family(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    labels: list[str],
    rows: list[tuple[list[str], Any]],
    attr: str,
) -> Metric:
    family = kind(name, doc, labels=labels)
    for values, stats in rows:
        family.add_metric(values, float(getattr(stats, attr)))
    return family


def _spec_metrics(rows: list[tuple[list[str], SpecStats]], labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding (scheduler/speculative.py), under vLLM's spec_decode names and
    cellserve's: rounds (a drafted sequence verified), drafted / accepted / emitted tokens,
    acceptances per draft position, and the accepted length of each round."""
    totals = {
        "num_drafts": "Speculation rounds: a drafted sequence verified",
        "num_draft_tokens": "Draft tokens verified",
        "num_accepted_tokens": "Draft tokens accepted",
    }
    for key, doc in totals.items():
        for prefix in ("vllm:spec_decode_", "cellserve_spec_decode_"):
            yield _family(CounterMetricFamily, prefix + key, doc, labels, rows, key)
    yield _family(
        CounterMetricFamily,
        "cellserve_spec_decode_num_emitted_tokens",
        "Tokens emitted by speculation rounds (accepted drafts + the target's own token)",
        labels,
        rows,
        "num_emitted_tokens",
    )
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, per position in the draft",
        labels=[*labels, "position"],
    )
    lengths = HistogramMetricFamily(
        "cellserve_spec_decode_acceptance_length",
        "Draft tokens accepted per speculation round",
        labels=labels,
    )
    by_source = [
        CounterMetricFamily(
            f"cellserve_spec_decode_source_{key}",
            f"Draft tokens {doc}, per proposer (ngram: prompt lookup; draft: the draft model)",
            labels=[*labels, "source"],
        )
        for key, doc in (("num_draft_tokens", "verified"), ("num_accepted_tokens", "accepted"))
    ]
    for values, spec in rows:
        for source, counts in spec.by_source.items():
            for family, n in zip(by_source, counts, strict=True):
                family.add_metric([*values, source], float(n))
        for pos, n in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([*values, str(pos)], float(n))
        cumulative, buckets = 0, []
        for length, n in enumerate(spec.acceptance_lengths):
            cumulative += n
            buckets.append((str(float(length)), float(cumulative)))
        buckets.append(("+Inf", float(cumulative)))
        total = sum(length * n for length, n in enumerate(spec.acceptance_lengths))
        lengths.add_metric(values, buckets, float(total))
    yield per_pos
    yield lengths
    yield from by_source


def _pool_gauges(rows: EngineRows, labels: list[str]) -> Iterator[Metric]:
    """Per pool of cells, labelled pool="full" | "swa": the unlabelled cellserve_kv_cells_*
    gauges above are the full pool's (every pool of the unified cache; the one that grows
    with context under iSWA), so existing dashboards keep their meaning. Pools of recurrent
    state slots get cellserve_state_* gauges instead."""
    per_pool = {
        "cellserve_kv_pool_cells_total": "Cells in each pool of the KV cache",
        "cellserve_kv_pool_cells_used": "Cells owned by a sequence, per pool",
        "cellserve_kv_pool_cells_shared": "Cells with more than one owner, per pool",
        "cellserve_kv_pool_usage_ratio": "used / total, per pool",
    }
    families = [
        GaugeMetricFamily(name, doc, labels=[*labels, "pool"]) for name, doc in per_pool.items()
    ]
    for values, s in rows:
        for p in s.pools:
            if p.kind != "cells":
                continue
            usage = p.used / p.n_cells if p.n_cells else 0.0
            for family, value in zip(families, (p.n_cells, p.used, p.shared, usage), strict=True):
                family.add_metric([*values, p.name], float(value))
    yield from families
    yield from _slot_gauges(rows, labels)


def _slot_gauges(rows: EngineRows, labels: list[str]) -> Iterator[Metric]:
    """Recurrent (Mamba-style) state slots, labelled by pool: one per sequence id plus the
    prefix-cache checkpoints; a slot holds one whole state of `bytes` bytes."""
    per_pool = {
        "cellserve_state_slots_total": "Recurrent state slots (one state each)",
        "cellserve_state_slots_used": "State slots holding a sequence's state or a checkpoint",
        "cellserve_state_slots_shared": "State slots more than one sequence references",
        "cellserve_state_slot_bytes": "Bytes of one state slot (every recurrent layer)",
        "cellserve_state_bytes_used": "Bytes of the used state slots",
    }
    slots = [(values, p) for values, s in rows for p in s.pools if p.kind == "slots"]
    if not slots:
        return
    families = [
        GaugeMetricFamily(name, doc, labels=[*labels, "pool"]) for name, doc in per_pool.items()
    ]
    for values, p in slots:
        numbers = (p.n_cells, p.used, p.shared, p.bytes_per_cell, p.used * p.bytes_per_cell)
        for family, value in zip(families, numbers, strict=True):
            family.add_metric([*values, p.name], float(value))
    yield from families
