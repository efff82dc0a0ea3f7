"""The Grafana dashboard: its PromQL parses (promtool), every metric it names is exported by the
live server, and the panels the deployment promises are there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy.tooling import DEPLOY, promql_metric_names, require_tool, run

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "cellserve.json"
# Grafana's range variables, replaced by a fixed range where Prometheus reads the expression.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def as_prometheus(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job="x", le!="1"}[$__rate_interval])))'
        " / on (pod) group_left b_total offset 5m + c"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert promql_metric_names('vllm:num_requests_waiting{model_name="m"} > bool 2') == {
        "vllm:num_requests_waiting"
    }


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": as_prometheus(expr)}
                    for i, (_, expr) in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(dashboard_exprs())} rules found" in result.stdout


def test_promtool_rejects_broken_promql(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    path = tmp_path / "rules.yml"
    path.write_text("groups:\n- name: g\n  rules:\n  - record: r\n    expr: rate(x[1m]\n")
    assert run([promtool, "check", "rules", str(path)]).returncode != 0


@pytest.mark.parametrize(
    ("panel", "needed"),
    [
        ("KV cells", {"cellserve_kv_cells_used", "cellserve_kv_cells_shared"}),
        ("KV cells", {"cellserve_kv_cells_total"}),
        ("usage ratio", {"cellserve_kv_cache_usage_ratio"}),
        ("running and waiting", {"cellserve_requests_running", "cellserve_requests_waiting"}),
        ("Prefix-cache hit rate", {"cellserve_prefix_cache_hit_tokens_total"}),
        ("Prefix-cache hit rate", {"cellserve_prefix_cache_queried_tokens_total"}),
        ("per minute", {"cellserve_context_shifts_total", "cellserve_preemptions_total"}),
        ("Tokens per second", {"cellserve_prompt_tokens_total"}),
        ("Tokens per second", {"cellserve_generation_tokens_total"}),
        ("Time to first token", {"cellserve_time_to_first_token_seconds_bucket"}),
        ("Inter-token latency", {"cellserve_inter_token_latency_seconds_bucket"}),
    ],
)
def test_dashboard_has_the_promised_panels(panel: str, needed: set[str]) -> None:
    names = {
        name
        for title, expr in dashboard_exprs()
        if panel.lower() in title.lower()
        for name in promql_metric_names(expr)
    }
    assert needed <= names


def test_latency_panels_are_percentiles() -> None:
    for title, expr in dashboard_exprs():
        if any(name.endswith("_bucket") for name in promql_metric_names(expr)):
            assert expr.startswith("histogram_quantile("), title


def test_every_dashboard_metric_is_exported_by_the_live_server(
    live_metric_names: set[str],
) -> None:
    used = {name for _, expr in dashboard_exprs() for name in promql_metric_names(expr)}
    assert len(used) >= 15
    assert used - live_metric_names == set()
