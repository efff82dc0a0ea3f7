"""Debian's Prometheus, with deploy/prometheus/prometheus.yml pointed at a live cellserve,
scrapes it; its HTTP API then answers for the cache, usage and token series, and for every
expression of the Grafana dashboard."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import LivePrometheus, LiveServer, complete
from tests.deploy.test_dashboard import as_prometheus, dashboard_exprs
from tests.deploy.tooling import require_tool, run

SCRAPE_WAIT_S = 40.0


def query(prometheus: LivePrometheus, expr: str) -> list[dict]:
    r = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def scalar(prometheus: LivePrometheus, expr: str) -> float | None:
    result = query(prometheus, expr)
    if not result:
        return None
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def wait_for(prometheus: LivePrometheus, expr: str, ok) -> float:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + SCRAPE_WAIT_S
    value = None
    while time.monotonic() < deadline:
        value = scalar(prometheus, expr)
        if value is not None and ok(value):
            return value
        time.sleep(1.0)
    pytest.fail(f"{expr} = {value} after {SCRAPE_WAIT_S}s")


@pytest.fixture(scope="module")
def generated_tokens(live_cellserve: LiveServer) -> int:
    """Sends a few completions; returns the tokens they generated."""
    prompts = ["The capital of France is", "Count: one, two,", "The capital of France is"]
    return sum(complete(live_cellserve, p)["usage"]["completion_tokens"] for p in prompts)


def exported_samples(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.labels
    }


def test_the_copied_config_is_valid(live_prometheus: LivePrometheus) -> None:
    promtool = require_tool("promtool")
    result = run([promtool, "check", "config", str(live_prometheus.config)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_cellserve(
    live_prometheus: LivePrometheus, live_cellserve: LiveServer, generated_tokens: int
) -> None:
    assert generated_tokens > 0
    assert wait_for(live_prometheus, 'up{job="cellserve"}', lambda v: v == 1.0) == 1.0
    generated = wait_for(
        live_prometheus, "cellserve_generation_tokens_total", lambda v: v >= generated_tokens
    )
    served = exported_samples(live_cellserve)
    assert generated <= served["cellserve_generation_tokens_total"]
    assert scalar(live_prometheus, "cellserve_kv_cells_total") == float(live_cellserve.n_cells)
    # One scrape carries both, so the ratio is exactly used / total: compared in one query
    # (two queries may read two scrapes, between which the cache changed)
    ratio = scalar(live_prometheus, "cellserve_kv_cache_usage_ratio")
    assert ratio is not None and 0.0 <= ratio <= 1.0
    diff = scalar(
        live_prometheus,
        "cellserve_kv_cache_usage_ratio - cellserve_kv_cells_used / cellserve_kv_cells_total",
    )
    assert diff is not None and abs(diff) < 1e-9
    prompt = scalar(live_prometheus, "cellserve_prompt_tokens_total")
    assert prompt is not None and prompt > 0


def test_every_dashboard_expression_runs(
    live_prometheus: LivePrometheus, generated_tokens: int
) -> None:
    wait_for(live_prometheus, "cellserve_generation_tokens_total", lambda v: v >= generated_tokens)
    answered = [query(live_prometheus, as_prometheus(expr)) for _, expr in dashboard_exprs()]
    assert len(answered) == len(dashboard_exprs())
    # Gauges and counters have series after the requests above; rate() once two scrapes exist.
    assert query(live_prometheus, "cellserve_kv_cells_used")
    rate = "sum(rate(cellserve_generation_tokens_total[1m]))"
    assert wait_for(live_prometheus, rate, lambda v: v >= 0.0) >= 0.0
