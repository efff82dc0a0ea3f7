"""deploy/compose.yaml through `docker compose config`, the Prometheus config through promtool,
and the Grafana provisioning files that compose mounts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy.tooling import DEPLOY, require_tool, run

COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"


@pytest.fixture(scope="module")
def compose_config() -> dict:
    compose = require_tool("docker-compose")
    result = run([compose, "-f", str(COMPOSE), "config", "--format", "json"])
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_compose_rejects_a_misspelt_key(tmp_path: Path) -> None:
    compose = require_tool("docker-compose")
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  a:\n    image: x\n    stop_grace_perid: 4s\n")
    result = run([compose, "-f", str(bad), "config"])
    assert result.returncode != 0
    assert "stop_grace_perid" in result.stderr


def test_compose_runs_cellserve_prometheus_and_grafana(compose_config: dict) -> None:
    services = compose_config["services"]
    assert set(services) == {"cellserve", "prometheus", "grafana"}
    cellserve = services["cellserve"]
    assert cellserve["build"]["args"]["VARIANT"] == "cpu"
    assert [p["target"] for p in cellserve["ports"]] == [8000]
    assert any(v["target"] == "/models" for v in cellserve["volumes"])
    drain = float(cellserve["environment"]["CELLSERVE_DRAIN_TIMEOUT"])
    assert float(cellserve["stop_grace_period"].rstrip("s")) > drain
    assert services["grafana"]["depends_on"].keys() == {"prometheus"}


def test_compose_mounts_files_that_exist(compose_config: dict) -> None:
    mounts = {
        v["target"]: Path(v["source"])
        for name in ("prometheus", "grafana")
        for v in compose_config["services"][name]["volumes"]
        if v["type"] == "bind"
    }
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_YML
    assert mounts["/etc/grafana/provisioning"] == DEPLOY / "grafana" / "provisioning"
    assert mounts["/var/lib/grafana/dashboards"] == DEPLOY / "grafana" / "dashboards"
    for source in mounts.values():
        assert source.exists(), source


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = require_tool("promtool")
    result = run([promtool, "check", "config", str(PROMETHEUS_YML)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_bad_config(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    bad = tmp_path / "prometheus.yml"
    bad.write_text("global:\n  scrape_interval: 5 seconds\n")
    assert run([promtool, "check", "config", str(bad)]).returncode != 0


def test_prometheus_scrapes_the_compose_service_every_5s(compose_config: dict) -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in compose_config["services"]
    assert int(port) == compose_config["services"][host]["ports"][0]["target"]


def test_grafana_provisions_the_datasource_and_the_dashboard_folder(compose_config: dict) -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in compose_config["services"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "cellserve.yml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "cellserve.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} | {
        p["datasource"]["uid"] for p in dashboard["panels"]
    }
    assert uids == {source["uid"]}
