"""A multi-model server's /metrics (server/metrics_models.py): the one-model families
(`vllm:*`, `cellserve_kv_*`, ...) once per loaded model, labelled `model_name` as vLLM labels
them, so that a dashboard built for one model still reads a router; the latency histograms
per model under vLLM's names (server.metrics.Latency), and over all models under ours."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.test_models_dir import FakeModels, chat, make_models_dir

ENGINE_FAMILIES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "cellserve_kv_cells_total",
    "cellserve_kv_cells_used",
    "cellserve_generation_tokens_total",
)


@pytest.fixture
def start(server_factory, tmp_path):
    return lambda models, **settings: server_factory(
        models, models_dir=str(make_models_dir(tmp_path)), **settings
    )


def samples(url: str) -> dict[tuple[str, str | None], float]:
    """(sample name, model_name label or None) -> value, of the engine families."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ENGINE_FAMILIES:
                out[(s.name, s.labels.get("model_name"))] = s.value
    return out


def test_each_loaded_model_has_the_one_model_gauges_labelled(start) -> None:
    server = start(FakeModels(n_cells=512), models_max=2)
    assert samples(server.url) == {}  # nothing loaded yet: no engine, no sample
    resp = chat(server.url, "alpha")
    assert resp.status_code == 200
    generated = resp.json()["usage"]["completion_tokens"]
    by_model = samples(server.url)
    assert by_model[("cellserve_kv_cells_total", "alpha")] == 512
    assert by_model[("vllm:num_requests_waiting", "alpha")] == 0
    assert by_model[("cellserve_generation_tokens_total", "alpha")] == generated
    assert all(model == "alpha" for _, model in by_model)
    replies = [chat(server.url, "beta") for _ in range(2)]
    generated = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    by_model = samples(server.url)
    assert {model for _, model in by_model} == {"alpha", "beta"}
    assert by_model[("cellserve_generation_tokens_total", "beta")] == generated
    assert by_model[("vllm:kv_cache_usage_perc", "beta")] == 0.0
    # an unloaded model's samples go with it
    assert httpx.post(f"{server.url}/models/unload", json={"model": "alpha"}).status_code == 200
    assert {model for _, model in samples(server.url)} == {"beta"}


def test_a_single_model_keeps_its_unlabelled_gauges(server_factory) -> None:
    server = server_factory(FakeModels(n_cells=512), model="only", served_model_name="only")
    assert chat(server.url, None).status_code == 200
    by_model = samples(server.url)
    assert by_model[("cellserve_kv_cells_total", None)] == 512
    assert {model for _, model in by_model} == {None}


LATENCIES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


def latency_counts(url: str) -> dict[tuple[str, str | None], float]:
    """(histogram name, model_name label or None) -> its _count."""
    names = {f"{prefix}{n}" for n in LATENCIES for prefix in ("vllm:", "cellserve_")}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_count")
            if s.name.endswith("_count") and name in names:
                out[(name, s.labels.get("model_name"))] = s.value
    return out


def test_latency_histograms_per_model_under_vllms_names(start) -> None:
    server = start(FakeModels(), models_max=2)
    replies = {"alpha": [chat(server.url, "alpha")], "beta": [chat(server.url, "beta")]}
    replies["beta"].append(chat(server.url, "beta"))
    assert all(r.status_code == 200 for rs in replies.values() for r in rs)
    tokens = {
        m: sum(r.json()["usage"]["completion_tokens"] for r in rs) for m, rs in replies.items()
    }
    counts = latency_counts(server.url)
    for model, n in (("alpha", 1), ("beta", 2)):
        assert counts[("vllm:time_to_first_token_seconds", model)] == n
        assert counts[("vllm:e2e_request_latency_seconds", model)] == n
        assert counts[("vllm:request_queue_time_seconds", model)] == n
        # every token of a choice after its first one
        assert counts[("vllm:inter_token_latency_seconds", model)] == tokens[model] - n
    for name in LATENCIES:  # ours: every model together, unlabelled
        total = counts[(f"vllm:{name}", "alpha")] + counts[(f"vllm:{name}", "beta")]
        assert counts[(f"cellserve_{name}", None)] == total
