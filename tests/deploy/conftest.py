"""Fixtures of the deploy tests: the suite's live cellserve and a Debian Prometheus scraping it.
(deploy/smoke_install.sh starts a server the way the image does: `cellserve serve` + env.)"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.tooling import DEPLOY, free_port, require_tool
from tests.live_server import LiveServer as SharedLiveServer


@dataclass(slots=True)
class LiveServer:
    url: str
    port: int
    n_cells: int


@dataclass(slots=True)
class LivePrometheus:
    url: str
    config: Path


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} not 200 after {timeout_s}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="session")
def live_cellserve(live_server: SharedLiveServer) -> LiveServer:
    """The suite's shared live server (tests/conftest.py): the embedded SmolLM2, real uvicorn."""
    port = httpx.URL(live_server.url).port
    assert port is not None
    return LiveServer(url=live_server.url, port=port, n_cells=live_server.settings.n_cells)


def complete(server: LiveServer, prompt: str, max_tokens: int = 8) -> dict:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def exported_sample_names(server: LiveServer) -> set[str]:
    """Every sample name on the live /metrics (histograms give _bucket, _sum and _count)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture(scope="session")
def live_metric_names(live_cellserve: LiveServer) -> set[str]:
    """Names from the live server after one finished request, so labelled series exist too."""
    complete(live_cellserve, "Hello", max_tokens=4)
    return exported_sample_names(live_cellserve)


def prometheus_config_for(target: str, dest: Path) -> Path:
    """A copy of deploy/prometheus/prometheus.yml with every target pointed at `target`."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            static["targets"] = [target]
    dest.write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


@pytest.fixture(scope="session")
def live_prometheus(
    live_cellserve: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LivePrometheus]:
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = prometheus_config_for(f"127.0.0.1:{live_cellserve.port}", tmp / "prometheus.yml")
    port = free_port()
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_http(f"http://127.0.0.1:{port}/-/ready", proc, log, timeout_s=60)
        yield LivePrometheus(url=f"http://127.0.0.1:{port}", config=config)
    finally:
        _stop(proc)
        shutil.rmtree(tmp / "data", ignore_errors=True)
